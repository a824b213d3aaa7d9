"""One step's loss and gradient norm, rlnb against TRL's ``GRPOTrainer``, for every
variant both ship (``vs_trl.py loss``).

The batch: the race's tiny Llama (``trl_baseline.make_model``) at two sets of
weights, ``old`` (the policy that sampled, and the reference) and ``new`` (old plus
a fixed perturbation: the policy being trained, so the PPO ratio is not 1); 16
fixed prompts x 8 completions of 1 to 4 tokens, right-padded, some cut at the
length limit without end-of-sequence, one group all right (flat) and one all
wrong; the race's reward; and behaviour log-probs that differ from the old
policy's (the engine's, for the mismatch-correction rows).

TRL's side (``trl_loss_side.py``, in TRL's venv) runs ``GRPOTrainer``'s own
``_generate_and_score_completions`` and ``_compute_loss``. rlnb's side, here,
computes the same with ``rlnb.algorithms.functional`` as the learner calls it
(advantages from the rewards, ``train_mask``, ``normaliser``, ``policy_loss``)
with log-probs from the model's plain forward.
"""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import trl_baseline as base  # noqa: E402

GROUPS, GROUP_SIZE, MAX_NEW = 16, 8, 4
TOLERANCE = 1e-5
PERTURB = 0.01  # the new weights: old + PERTURB * N(0, 1) per parameter
BEHAV_NOISE = 0.5  # the behaviour log-probs: old's + BEHAV_NOISE * N(0, 1) per token

EPS_NOTE = (
    "the advantages differ, by the epsilon of the std's division alone: TRL's (R - mean) / (std + 1e-4), "
    "rlnb's (R - mean) / (std + 1e-6) (verl's and rlnb's as it was); on TRL's advantages rlnb's loss agrees"
)

_BESSEL = 'preset("grpo").replace(std="bessel")'


@dataclasses.dataclass(frozen=True)
class Variant:
    """A row of the table: TRL's ``GRPOConfig`` settings and rlnb's ``Algorithm``
    (as an expression over ``preset`` and ``Algorithm``); ``note`` says why they
    differ where they should."""

    name: str
    trl: dict[str, Any]
    rlnb: str
    note: str = ""
    expect_equal: bool = True


VARIANTS = (
    Variant("bnpo", {"loss_type": "bnpo"}, _BESSEL),
    Variant("dapo loss (TRL's default)", {"loss_type": "dapo"}, _BESSEL),
    Variant("grpo loss", {"loss_type": "grpo"}, f'{_BESSEL[:-1]}, aggregation="seq_mean_token_mean")'),
    Variant(
        "dapo loss, TRL's advantages as your own",
        {"loss_type": "dapo"},
        'preset("grpo").replace(advantage=trl_group_advantages)',
    ),
    Variant(
        "rlnb's default",
        {"loss_type": "dapo"},
        'preset("grpo")',
        "rlnb's default divides by the population std, TRL by Bessel's (G-1): its advantages are sqrt(8/7) = 1.07x",
        expect_equal=False,
    ),
    Variant("dr_grpo", {"loss_type": "dr_grpo", "scale_rewards": "none"}, 'preset("dr_grpo")'),
    Variant("scale_rewards none", {"loss_type": "dapo", "scale_rewards": "none"}, 'Algorithm(advantage="dr_grpo")'),
    Variant("clip-higher", {"loss_type": "dapo", "epsilon_high": 0.28}, f"{_BESSEL[:-1]}, clip_high=0.28)"),
    Variant(
        "dapo",
        {"loss_type": "dapo", "epsilon_high": 0.28, "mask_truncated_completions": True},
        'preset("dapo")',
        "rlnb's dapo drops the groups of equal rewards (dynamic sampling); TRL keeps their tokens in the "
        "token-mean's denominator",
        expect_equal=False,
    ),
    Variant(
        "dapo, flat groups kept",
        {"loss_type": "dapo", "epsilon_high": 0.28, "mask_truncated_completions": True},
        'preset("dapo").replace(drop_flat_groups=False, dynamic_sampling=False)',
    ),
    Variant(
        "gspo",
        {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4},
        'preset("gspo")',
    ),
    Variant(
        "gspo, clip 0.2",
        {"loss_type": "grpo", "importance_sampling_level": "sequence"},
        'preset("gspo").replace(clip_low=0.2, clip_high=0.2)',
    ),
    Variant("cispo", {"loss_type": "cispo", "epsilon_high": 5.0}, 'preset("cispo")'),
    Variant("sapo", {"loss_type": "sapo"}, 'preset("sapo")'),
    Variant(
        "scale_rewards batch",
        {"loss_type": "dapo", "scale_rewards": "batch"},
        'preset("reinforce_pp_baseline")',
        "TRL divides the group-centred rewards by the std of the raw rewards over the batch; rlnb's "
        "reinforce_pp_baseline (verl's reinforce_plus_plus_baseline) whitens the centred rewards over the "
        "batch's tokens",
        expect_equal=False,
    ),
    Variant(
        "KL k3, beta 0.04",
        {"loss_type": "dapo", "beta": 0.04, "use_bias_correction_kl": False},
        f"{_BESSEL[:-1]}, kl_coef=0.04)",
    ),
    Variant(
        "KL k3, bias-corrected",
        {"loss_type": "dapo", "beta": 0.04},
        f"{_BESSEL[:-1]}, kl_coef=0.04)",
        "TRL's default use_bias_correction_kl=True multiplies the KL by the PPO ratio (with its gradient); "
        "rlnb has no such option",
        expect_equal=False,
    ),
    Variant("entropy bonus", {"loss_type": "dapo", "entropy_coef": 0.01}, f"{_BESSEL[:-1]}, entropy_coef=0.01)"),
    Variant(
        "top 20% entropy",
        {"loss_type": "dapo", "top_entropy_quantile": 0.2},
        f"{_BESSEL[:-1]}, top_entropy_quantile=0.2)",
    ),
    Variant(
        "RLOOTrainer",
        {"trainer": "RLOOTrainer", "beta": 0.0},
        'preset("rloo")',
        "TRL's RLOOTrainer clips each sequence's probability ratio exp(sum_t log r_t) and averages over "
        "sequences; rlnb's rloo (verl's) is token-level PPO-clip averaged over tokens. Their advantages agree",
        expect_equal=False,
    ),
    Variant(
        "RLOOTrainer, as your own loss",
        {"trainer": "RLOOTrainer", "beta": 0.0},
        'Algorithm(advantage="rloo", loss=rloo_sequence_loss)',
    ),
    *(
        Variant(
            f"mismatch {mode}",
            {"loss_type": "dapo", "vllm_importance_sampling_mode": mode},
            f'{_BESSEL[:-1]}, correction="{mode}", correction_high=3.0)',
        )
        for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
    ),
)


def trl_group_advantages(rewards: torch.Tensor, **context: Any) -> torch.Tensor:
    """TRL's GRPO advantages as an rlnb advantage function: ``(R - mean_g) / (std_g + 1e-4)``,
    Bessel's std (rlnb's ``grpo`` adds 1e-6, as verl does)."""
    return (rewards - rewards.mean(dim=1, keepdim=True)) / (rewards.std(dim=1, keepdim=True) + 1e-4)


def rloo_sequence_loss(inputs: Any) -> torch.Tensor:
    """TRL's ``RLOOTrainer`` loss as an rlnb loss function: PPO-clip of each
    sequence's probability ratio ``exp(sum_t (logp - prox))``, averaged over sequences."""
    mask = inputs.mask.to(inputs.logp.dtype)
    prox = inputs.logp.detach() if inputs.prox_logp is None else inputs.prox_logp
    ratio = torch.exp(((inputs.logp - prox) * mask).sum(dim=1))
    adv, alg = inputs.advantages, inputs.algorithm
    clipped = ratio.clamp(1 - alg.clip_low, 1 + alg.clip_high)
    return -torch.minimum(ratio * adv, clipped * adv).mean()


def algorithm_of(variant: Variant) -> Any:
    """``variant``'s rlnb ``Algorithm``."""
    from rlnb.algorithms import Algorithm, preset

    names = {
        "preset": preset,
        "Algorithm": Algorithm,
        "rloo_sequence_loss": rloo_sequence_loss,
        "trl_group_advantages": trl_group_advantages,
    }
    return eval(variant.rlnb, names)  # the text of our own table


# -- the batch -------------------------------------------------------------------------


def _completion(rng: random.Random, answer: str, kind: str) -> list[int]:
    """A completion's token ids: the answer, a near miss, noise, or cut at the limit."""
    v = base.VOCAB
    digits = "0123456789"
    if kind == "right":
        text = answer
    elif kind == "near":
        i = rng.randrange(len(answer))
        text = answer[:i] + rng.choice(digits.replace(answer[i], "")) + answer[i + 1 :]
    elif kind == "empty":  # end-of-sequence at once: reward 0
        text = ""
    elif kind == "short":
        text = "".join(rng.choice(digits) for _ in range(rng.randint(0, 2)))
    else:  # cut: MAX_NEW tokens, no end-of-sequence
        return [v[rng.choice(digits)] for _ in range(MAX_NEW)]
    return [*(v[c] for c in text[: MAX_NEW - 1]), base.EOS]


def _quiet() -> None:
    """transformers without its progress bars (their monitor thread outlives the call)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def make_batch(folder: Path) -> None:
    """Write the models (``old/``, ``new/``), ``batch.json`` and ``batch.safetensors``
    into ``folder``."""
    from safetensors.torch import save_file

    _quiet()
    rng = random.Random(7)
    model = base.make_model(seed=0)
    model.save_pretrained(folder / "old")
    base.make_tokenizer().save_pretrained(folder / "old")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(PERTURB * torch.randn(p.shape, generator=gen))
    model.save_pretrained(folder / "new")
    base.make_tokenizer().save_pretrained(folder / "new")
    kinds = ("right", "near", "short", "cut")
    prompts, answers, prompt_ids, completion_ids, completions = [], [], [], [], []
    inverse = {i: c for c, i in base.VOCAB.items()}
    for g in range(GROUPS):
        a, b = base.training_pair(rng)
        for _ in range(GROUP_SIZE):
            # group 0 all right (flat), group 1 all noise; the others mixed
            kind = "right" if g == 0 else "empty" if g == 1 else rng.choice(kinds)
            ids = _completion(rng, str(a + b), kind)
            prompts.append(f"{a}+{b}=")
            answers.append(str(a + b))
            prompt_ids.append(base.encode_prompt(a, b))
            completion_ids.append(ids)
            completions.append("".join(inverse[i] for i in ids if i != base.EOS))
    old = load_model(folder / "old")
    ids, mask = padded(prompt_ids, completion_ids)
    with torch.no_grad():
        old_logp, _ = token_logp(old, prompt_ids, ids, mask)
    behav = old_logp + BEHAV_NOISE * torch.randn(old_logp.shape, generator=gen)
    rewards = base.reward(prompts, completions, answers)
    batch = {
        "prompts": prompts,
        "answers": answers,
        "completions": completions,
        "prompt_ids": prompt_ids,
        "completion_ids": completion_ids,
        "lengths": [len(c) for c in completion_ids],
        "rewards": rewards,
        "group_size": GROUP_SIZE,
        "max_new": MAX_NEW,
        "variants": [{"name": v.name, "trl": v.trl} for v in VARIANTS],
    }
    (folder / "batch.json").write_text(json.dumps(batch, indent=1))
    save_file({"behav_logp": (behav * mask).contiguous()}, folder / "batch.safetensors")


def load_model(path: Path) -> Any:
    from transformers import LlamaForCausalLM

    _quiet()
    return LlamaForCausalLM.from_pretrained(path).float()


def padded(prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Completion ids [N, C] right-padded with the pad token, and their mask [N, C]."""
    width = max(len(c) for c in completion_ids)
    ids = torch.full((len(completion_ids), width), base.PAD, dtype=torch.long)
    mask = torch.zeros((len(completion_ids), width), dtype=torch.bool)
    for i, c in enumerate(completion_ids):
        ids[i, : len(c)] = torch.tensor(c)
        mask[i, : len(c)] = True
    return ids, mask


def token_logp(
    model: Any, prompt_ids: list[list[int]], ids: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies [N, C] of the completion tokens ``ids`` after their
    prompts (all of one length here), by the model's plain forward."""
    prompts = torch.tensor(prompt_ids)
    full = torch.cat([prompts, ids], dim=1)
    attention = torch.cat([torch.ones_like(prompts, dtype=torch.bool), mask], dim=1).long()
    logits = model(input_ids=full, attention_mask=attention).logits[:, prompts.shape[1] - 1 : -1].float()
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, ids[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


# -- rlnb's side --------------------------------------------------------------------------


def rlnb_step(
    folder: Path,
    batch: dict[str, Any],
    behav: torch.Tensor,
    variant: Variant,
    given: torch.Tensor | None = None,
) -> dict[str, Any]:
    """``variant``'s loss and gradient norm by ``rlnb.algorithms.functional``, as the
    learner computes them with a proximal policy (several updates per batch): the
    old weights' log-probs as proximal, the batch's behaviour log-probs for the
    mismatch rows (else the proximal ones: the sampler was the old policy).
    ``given``: advantages [N] to use in place of rlnb's (TRL's, to compare the loss
    code alone)."""
    from rlnb.algorithms import functional as F
    from rlnb.algorithms import has_signal

    alg = algorithm_of(variant)
    rewards = torch.tensor(batch["rewards"], dtype=torch.float64)
    group_of = torch.arange(len(rewards)) // batch["group_size"]
    rows = torch.arange(len(rewards))
    if alg.drop_flat_groups:  # as the learner does, before the batch is made
        keep = [g for g in range(int(group_of.max()) + 1) if has_signal(rewards[group_of == g].tolist())]
        if keep:
            rows = rows[torch.isin(group_of, torch.tensor(keep))]
    prompt_ids = [batch["prompt_ids"][i] for i in rows.tolist()]
    ids, mask = padded(prompt_ids, [batch["completion_ids"][i] for i in rows.tolist()])
    truncated = torch.tensor([batch["completion_ids"][i][-1] != base.EOS for i in rows.tolist()])
    old, new = load_model(folder / "old"), load_model(folder / "new")
    with torch.no_grad():
        prox, _ = token_logp(old, prompt_ids, ids, mask)
    logp, entropy = token_logp(new, prompt_ids, ids, mask)
    mismatch = "vllm_importance_sampling_mode" in variant.trl
    behav_logp = behav[rows, : ids.shape[1]] if mismatch else prox
    advantages = F.advantages(alg, rewards[rows], group_of[rows], lengths=mask.sum(1), mask=mask)
    if given is not None:
        advantages = given[rows]
    train_mask = F.train_mask(alg, mask, truncated=truncated)
    terms = F.policy_loss(
        F.LossInputs(
            algorithm=alg,
            logp=logp,
            prox_logp=prox,
            behav_logp=behav_logp,
            advantages=advantages,
            mask=train_mask,
            ref_logp=prox if alg.kl_coef > 0 else None,  # the reference is the old policy, as TRL's ref_model
            lengths=mask.sum(1),
            entropy=entropy,
            normaliser=F.normaliser(alg, train_mask),
            update_tokens=int(train_mask.sum()),
        )
    )
    terms.loss.backward()
    grad = sum(float(p.grad.double().square().sum()) for p in new.parameters() if p.grad is not None) ** 0.5
    return {
        "loss": float(terms.loss.detach()),
        "grad_norm": grad,
        "tensors": {"advantages": advantages.float(), "old_logp": prox, "logp": logp.detach()},
        "rows": rows,
        "mask": mask,
    }


# -- the comparison -------------------------------------------------------------------------


def compare(folder: Path, trl_python: str, threads: int = 1) -> list[dict[str, Any]]:
    """Make the batch, run TRL's side in its venv and rlnb's here; returns the table's
    rows and writes ``table.json`` and ``table.md`` into ``folder``."""
    from safetensors.torch import load_file

    folder.mkdir(parents=True, exist_ok=True)
    make_batch(folder)
    side = [trl_python, str(HERE / "trl_loss_side.py"), "--dir", str(folder), "--threads", str(threads)]
    subprocess.run(side, check=True)
    trl = json.loads((folder / "trl.json").read_text())
    trl_tensors = load_file(folder / "trl.safetensors")
    batch = json.loads((folder / "batch.json").read_text())
    behav = load_file(folder / "batch.safetensors")["behav_logp"]
    table = []
    for variant in VARIANTS:
        theirs = trl["variants"][variant.name]
        ours = rlnb_step(folder, batch, behav, variant)
        rows = ours["rows"]
        diffs = {}
        for key in ("advantages", "old_logp", "logp"):
            t, o = trl_tensors[f"{variant.name}/{key}"][rows], ours["tensors"][key]
            if t.dim() == 2:  # the completion tokens only: padding's log-probs mean nothing
                mask = ours["mask"]
                t, o = t[:, : mask.shape[1]][mask], o[mask]
            diffs[key] = float((t - o).abs().max())
        loss_diff = abs(theirs["loss"] - ours["loss"])
        grad_diff = abs(theirs["grad_norm"] - ours["grad_norm"])
        # the loss code alone: rlnb's policy loss on TRL's advantages
        same = rlnb_step(folder, batch, behav, variant, given=trl_tensors[f"{variant.name}/advantages"])
        same_loss_diff = abs(theirs["loss"] - same["loss"])
        same_grad_diff = abs(theirs["grad_norm"] - same["grad_norm"])
        table.append(
            {
                "variant": variant.name,
                "trl": variant.trl,
                "rlnb": variant.rlnb,
                "loss_trl": theirs["loss"],
                "loss_rlnb": ours["loss"],
                "loss_diff": loss_diff,
                "grad_norm_trl": theirs["grad_norm"],
                "grad_norm_rlnb": ours["grad_norm"],
                "grad_norm_diff": grad_diff,
                "max_diff": diffs,
                "agree": loss_diff <= TOLERANCE and grad_diff <= TOLERANCE,
                "same_advantages_loss_diff": same_loss_diff,
                "same_advantages_grad_norm_diff": same_grad_diff,
                "same_advantages_agree": same_loss_diff <= TOLERANCE and same_grad_diff <= TOLERANCE,
                "expected_to_agree": variant.expect_equal,
                "note": variant.note or (EPS_NOTE if diffs["advantages"] > TOLERANCE else ""),
            }
        )
    report = {"trl_version": trl["trl_version"], "tolerance": TOLERANCE, "rows": table}
    (folder / "table.json").write_text(json.dumps(report, indent=1))
    (folder / "table.md").write_text(markdown(table, trl["trl_version"]))
    return table


def _settings(trl: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}".replace("'", '"') for k, v in trl.items())


def markdown(table: list[dict[str, Any]], version: str) -> str:
    """The table in Markdown."""
    lines = [
        f"| Variant | TRL {version} settings | rlnb `Algorithm` | loss TRL | loss rlnb | abs diff "
        "| grad norm TRL | grad norm rlnb | abs diff | within 1e-5 | on TRL's advantages: loss, grad norm abs diff "
        "| within 1e-5 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes: list[str] = []
    for row in table:
        mark = "yes" if row["agree"] else "no"
        if row["note"]:
            if row["note"] not in notes:
                notes.append(row["note"])
            mark += f" ({notes.index(row['note']) + 1})"
        lines.append(
            f"| {row['variant']} | `{_settings(row['trl'])}` | `{row['rlnb']}` | {row['loss_trl']:.7f} "
            f"| {row['loss_rlnb']:.7f} | {row['loss_diff']:.1e} | {row['grad_norm_trl']:.7f} "
            f"| {row['grad_norm_rlnb']:.7f} | {row['grad_norm_diff']:.1e} | {mark} "
            f"| {row['same_advantages_loss_diff']:.1e}, {row['same_advantages_grad_norm_diff']:.1e} "
            f"| {'yes' if row['same_advantages_agree'] else 'no'} |"
        )
    lines.append("")
    lines += [f"({i}) {n}." for i, n in enumerate(notes, 1)]
    return "\n".join(lines) + "\n"

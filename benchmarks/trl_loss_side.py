"""TRL's side of ``vs_trl.py loss``: one step's loss and gradient norm by
``GRPOTrainer``'s (or ``RLOOTrainer``'s) own code, for each TRL setting asked for.
Runs in TRL's venv.

For each variant it builds a ``GRPOTrainer`` (or ``RLOOTrainer``) on the batch's model at the old
weights, with ``_generate`` replaced by one that hands back the batch's fixed
completions (and, for the mismatch-correction rows, its behaviour log-probs as
vLLM's), and ``use_vllm`` set on the instance for those rows (no vLLM runs). Then
TRL's own ``_generate_and_score_completions`` scores the completions with the
reward function and computes the advantages, the old log-probs
(``num_iterations=2`` makes it compute them), the reference's (``beta > 0``) and
the mismatch weights; the model is moved to the new weights and TRL's own
``_compute_loss(model, inputs)`` gives the loss, which is backpropagated once.
Nothing of TRL's loss or advantage code is copied here.

    /tmp/trlenv/bin/python benchmarks/trl_loss_side.py --dir runs/vs_trl_loss

reads ``batch.json`` (the completions, rewards' inputs, the variants' TRL
settings), ``batch.safetensors`` (behaviour log-probs) and the models ``old/`` and
``new/`` from ``--dir``, and writes ``trl.json`` (each variant's loss and gradient
norm) and ``trl.safetensors`` (each variant's advantages, old and current
log-probs) there.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import trl_baseline as base  # noqa: E402  (the tokenizer and the reward)


def grad_norm(model: Any) -> float:
    """The gradient's 2-norm over every parameter, summed in float64 (as the rlnb side does)."""
    total = sum(float(p.grad.double().square().sum()) for p in model.parameters() if p.grad is not None)
    return total**0.5


def run_variant(folder: Path, batch: dict[str, Any], behav: torch.Tensor, variant: dict[str, Any]) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    settings = dict(variant["trl"])  # GRPOConfig's (or RLOOConfig's) fields, and which trainer
    rloo = settings.pop("trainer", "GRPOTrainer") == "RLOOTrainer"
    vllm_mode = settings.get("vllm_importance_sampling_mode")
    config, trainer_class = (RLOOConfig, RLOOTrainer) if rloo else (GRPOConfig, GRPOTrainer)
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(folder / "old")
    with tempfile.TemporaryDirectory() as tmp:
        args = config(
            output_dir=tmp,
            per_device_train_batch_size=len(batch["completions"]),
            num_generations=batch["group_size"],
            max_completion_length=batch["max_new"],
            bf16=False,
            gradient_checkpointing=False,
            report_to="none",
            use_cpu=True,
            seed=0,
            disable_tqdm=True,
            save_strategy="no",
            # GRPOTrainer computes the old log-probs itself (so that the ratio is not 1) with several
            # iterations per batch; RLOOTrainer always does
            **({} if rloo else {"num_iterations": 2}),
            **settings,
        )
        rows = [{"prompt": p, "answer": a} for p, a in zip(batch["prompts"], batch["answers"], strict=True)]
        trainer = trainer_class(
            model=model,
            reward_funcs=base.reward,
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=base.make_tokenizer(),
        )
    sampling = None
    if vllm_mode:  # the engine's log-probs, as vLLM would report them
        trainer.use_vllm = True
        sampling = [behav[i, :n].tolist() for i, n in enumerate(batch["lengths"])]

    def generate(prompts: list[str]) -> tuple[Any, ...]:
        if rloo:  # (prompt ids, completion ids, completions)
            return batch["prompt_ids"], batch["completion_ids"], batch["completions"]
        # (prompt ids, completion ids, tool mask, completions, sampling log-probs, extra fields, images, tool images)
        return (batch["prompt_ids"], batch["completion_ids"], None, batch["completions"], sampling, {}, None, None)

    trainer._generate = generate
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop; one micro-batch per step here
    trainer.model.train()
    inputs = trainer._generate_and_score_completions(rows)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    width = inputs["completion_ids"].size(1)
    if "old_per_token_logps" in inputs:
        old_logp = inputs["old_per_token_logps"]
    else:  # RLOOTrainer keeps only their sums per sequence
        with torch.no_grad():
            old_logp = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attention, width)[0]
    new = LlamaForCausalLM.from_pretrained(folder / "new").state_dict()
    trainer.model.load_state_dict(new)
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    with torch.no_grad():
        logp = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attention, width)[0]
    tensors = {"advantages": inputs["advantages"].float(), "old_logp": old_logp.float(), "logp": logp.float()}
    if "importance_sampling_ratio" in inputs:
        tensors["is_ratio"] = inputs["importance_sampling_ratio"].float()
    return {"loss": float(loss.detach()), "grad_norm": grad_norm(trainer.model), "tensors": tensors}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, required=True, help="the folder vs_trl.py loss wrote the batch into")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")  # TRL's advice on settings (e.g. GSPO with loss_type="dapo") is not ours
    logging.getLogger("trl").setLevel(logging.ERROR)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    import trl
    from safetensors.torch import load_file, save_file

    batch = json.loads((args.dir / "batch.json").read_text())
    behav = load_file(args.dir / "batch.safetensors")["behav_logp"]
    results: dict[str, Any] = {"trl_version": trl.__version__, "variants": {}}
    tensors: dict[str, torch.Tensor] = {}
    for variant in batch["variants"]:
        out = run_variant(args.dir, batch, behav, variant)
        for key, value in out.pop("tensors").items():
            tensors[f"{variant['name']}/{key}"] = value.contiguous()
        results["variants"][variant["name"]] = out
        print(f"trl {variant['name']}: loss {out['loss']:.8f}, grad norm {out['grad_norm']:.8f}", flush=True)
    (args.dir / "trl.json").write_text(json.dumps(results, indent=1))
    save_file(tensors, args.dir / "trl.safetensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())

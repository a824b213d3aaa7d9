"""The learner on one process and split across ranks, on the same batches.

``python -m tests.helpers.ranks compare --world 2 --steps 5 --algorithms grpo,gspo``
trains a tiny policy (in float64) both ways, the ranks as processes on a gloo
process group over loopback, and prints as JSON each algorithm's metrics both ways
and the largest difference of the final weights. ``--model hf`` trains a small
random Llama instead, ``lora`` its LoRA adapter, ``checkpointing`` it with
gradient checkpointing; ``--strategy fsdp`` shards it (default "ddp"). ``... fail
--world 2``: the last rank's loss function raises in step 2; prints what each rank
raised and whether its weights stayed step 1's."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from typing import Any

import torch

import rlnb
from rlnb.algorithms import functional as F
from rlnb.learn import LearnConfig, Learner, _sharding
from rlnb.learn._ranks import Ranks
from rlnb.models import CharTokenizer, TinyPolicy

TOK = CharTokenizer("0123456789+=")
DTYPE = torch.float64  # float32 rounds differently when the rows are split; Adam amplifies it
COMPARED = ("loss", "policy_loss", "grad_norm", "entropy", "kl", "clip_fraction", "tokens_counted", "is_weight_mean")
COMPARED += ("value_loss", "value_clip_fraction", "critic_grad_norm")  # an algorithm with a critic's


def encode(text: str) -> list[int]:
    return TOK.encode(text, bos=True)


# --model: the built-in policy, or a Hugging Face Llama (built into a directory once)
MODELS = ("tiny", "hf", "lora", "checkpointing")


def learner(model: str, model_dir: str | None, algorithm: str, ranks: Ranks | None) -> Learner:
    if model == "tiny":
        return Learner(policy(DTYPE), encode=encode, pad_id=TOK.PAD, config=config(algorithm), share=ranks)
    from rlnb.models import load_hf_model, load_hf_tokenizer

    assert model_dir is not None
    tok = load_hf_tokenizer(model_dir)
    hf = load_hf_model(
        rlnb.ModelConfig(
            path=model_dir,
            max_len=32,
            lora=rlnb.LoraConfig(r=4, alpha=8) if model == "lora" else None,
            gradient_checkpointing=model == "checkpointing",
        )
    )
    return Learner(
        hf.to(DTYPE),  # float64, as the built-in policy's: what the split itself changes, not float32's rounding
        encode=lambda text: tok.encode(text, bos=True),
        pad_id=tok.PAD,
        eos_id=tok.EOS,
        config=config(algorithm),
        share=ranks,
    )


def model_batches(model: str, model_dir: str | None, steps: int) -> list[list[rlnb.Group]]:
    if model == "tiny":
        return batches(steps)
    from rlnb.models import load_hf_tokenizer

    tok = load_hf_tokenizer(model_dir)
    return batches(steps, ids=range(0, 12), eos=tok.EOS)  # the tiny Llama's characters are ids 0-11


def policy(dtype: torch.dtype) -> TinyPolicy:
    model = TinyPolicy(rlnb.ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=2, n_heads=2, max_len=24))
    return model.to(dtype)


def batches(
    steps: int, *, groups: int = 3, size: int = 5, seed: int = 0, ids: range | None = None, eos: int = TOK.EOS
) -> list[list[rlnb.Group]]:
    """``steps`` batches of ``groups`` groups of ``size`` samples: random completions
    of random lengths (tokens of ``ids``, default the built-in tokenizer's characters,
    then ``eos``), behaviour log-probs and rewards (the same for every caller)."""
    ids = ids or range(3, TOK.vocab_size)
    rng = random.Random(seed)
    out = []
    for _ in range(steps):
        batch = []
        for _ in range(groups):
            a, b = rng.randrange(10, 99), rng.randrange(10, 99)
            prompt = f"{a}+{b}="
            samples = []
            for _ in range(size):
                n = rng.randrange(1, 6)
                tokens = (*(rng.choice(ids) for _ in range(n)), eos)
                samples.append(
                    rlnb.Sample(
                        prompt=prompt,
                        completion="",
                        token_ids=tokens,
                        logprobs=tuple(-rng.uniform(1.5, 3.5) for _ in tokens),
                        versions=(0,) * len(tokens),
                        reward=float(rng.random() < 0.5) + rng.uniform(-0.1, 0.1),
                    )
                )
            batch.append(rlnb.Group(prompt, tuple(samples)))
        out.append(batch)
    return out


def config(algorithm: str) -> LearnConfig:
    """``algorithm``, or "name:N": with micro-batches of N rows (the ranks' shares then
    cut into different numbers of chunks: 10 rows as 5 + 5, 5 as 3 + 2)."""
    name, _, micro = algorithm.partition(":")
    return LearnConfig(
        lr=1e-2, algorithm=name, epochs=2, minibatches=2, kl_coef=0.01, micro_batch_size=int(micro) if micro else None
    )


def train(
    algorithm: str, steps: int, ranks: Ranks | None, model: str = "tiny", model_dir: str | None = None
) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    taught = learner(model, model_dir, algorithm, ranks)
    history = [taught.step(batch) for batch in model_batches(model, model_dir, steps)]
    weights = _sharding.gathered(taught.model_state())
    if taught.critic is not None:  # its model and head too
        critic = taught.critic.state()
        weights.update({f"critic.{k}": v for k, v in _sharding.gathered(critic["model"]).items()})
        weights.update({f"critic.head.{k}": v for k, v in _sharding.gathered(critic["head"]).items()})
    return history, weights


def fail_at_step_2(failing: int, ranks: Ranks | None) -> dict[str, Any]:
    """Step 1, then step 2 with a loss function that raises on rank ``failing`` only:
    what each rank raised, and whether its weights are step 1's."""
    learner = Learner(policy(DTYPE), encode=encode, pad_id=TOK.PAD, config=config("grpo"), share=ranks)
    first, second = batches(2)
    learner.step(first)
    kept = _sharding.gathered(learner.policy.state_dict())
    rank = 0 if ranks is None else ranks.rank
    if rank == failing:
        policy_loss = F.policy_loss

        def broken(inputs: Any) -> Any:
            raise ValueError(f"a loss function that fails on rank {rank}")

        F.policy_loss = broken
    try:
        learner.step(second)
        raised = None
    except Exception as exc:
        raised = f"{type(exc).__name__}: {exc}"
    finally:
        if rank == failing:
            F.policy_loss = policy_loss
    same = all(torch.equal(v, kept[k]) for k, v in _sharding.gathered(learner.policy.state_dict()).items())
    return {"raised": raised, "weights kept": same, "version": learner.version}


def _rank(
    rank: int,
    world: int,
    store: str,
    what: str,
    algorithms: list[str],
    steps: int,
    out: str,
    strategy: str,
    model: str,
    model_dir: str | None,
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        ranks = Ranks.current(sharded=strategy == "fsdp")
        if what == "fail":
            result: Any = fail_at_step_2(world - 1, ranks)
        else:
            result = {algorithm: train(algorithm, steps, ranks, model, model_dir) for algorithm in algorithms}
        torch.save(result, f"{out}.{rank}")
        dist.barrier()  # no rank tears the group down while another still uses it
    finally:
        dist.destroy_process_group()


def _on_ranks(
    world: int,
    what: str,
    algorithms: list[str],
    steps: int,
    strategy: str,
    model: str = "tiny",
    model_dir: str | None = None,
) -> list[Any]:
    """What each rank wrote. A rank that wrote its result and then died in gloo's
    teardown (seen once in CI under load: SIGABRT, "terminate called without an active
    exception") is said on stderr, not failed: what is tested is written by then."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as where:
        out = os.path.join(where, "rank")
        args = (world, os.path.join(where, "store"), what, algorithms, steps, out, strategy, model, model_dir)
        context = mp.start_processes(_rank, args=args, nprocs=world, join=False, start_method="spawn")
        for proc in context.processes:
            proc.join(600)
        for rank, proc in enumerate(context.processes):
            if proc.exitcode != 0:
                if not os.path.exists(f"{out}.{rank}"):
                    raise RuntimeError(f"rank {rank} exited with {proc.exitcode} before writing its result")
                print(f"rank {rank} exited with {proc.exitcode} after writing its result", file=sys.stderr)
        return [torch.load(f"{out}.{rank}") for rank in range(world)]


def compare(
    world: int, steps: int, algorithms: list[str], strategy: str, model: str = "tiny", model_dir: str | None = None
) -> dict[str, Any]:
    """Each algorithm's metrics alone and on ``world`` ranks, and the largest
    difference of the final weights (rank 0's; every rank's are the same)."""
    split = _on_ranks(world, "compare", algorithms, steps, strategy, model, model_dir)
    result = {}
    for algorithm in algorithms:
        alone, weights = train(algorithm, steps, None, model, model_dir)
        history, theirs = split[0][algorithm]
        result[algorithm] = {
            "alone": [{k: m[k] for k in COMPARED if k in m} for m in alone],
            "ranks": [{k: m[k] for k in COMPARED if k in m} for m in history],
            "weights": max(float((weights[k] - theirs[k]).abs().max()) for k in weights),
            "ranks agree": all(torch.equal(theirs[k], other[algorithm][1][k]) for other in split[1:] for k in theirs),
        }
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("compare", "fail"))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--algorithms", default="grpo")
    parser.add_argument("--strategy", default="ddp", choices=("ddp", "fsdp"))
    parser.add_argument("--model", default="tiny", choices=MODELS)
    args = parser.parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as where:
        model_dir = None
        if args.model != "tiny":
            from rlnb.models import tiny_llama

            model_dir = str(tiny_llama(os.path.join(where, "llama"), hidden_size=64, intermediate_size=128))
        if args.what == "fail":
            result: Any = _on_ranks(args.world, "fail", [], 2, args.strategy)
        else:
            result = compare(args.world, args.steps, args.algorithms.split(","), args.strategy, args.model, model_dir)
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()

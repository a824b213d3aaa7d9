"""The TRL baseline that `rlnb demo`'s targets are measured against, reproducible here.

Hugging Face TRL's ``GRPOTrainer`` on two-digit addition (``a+b=`` with a, b in
10-99, a character vocabulary of 16 tokens), a randomly initialised 332K-parameter
Llama (hidden 128, 2 layers, 4 heads, intermediate 256), a supervised warm-up to
~0.2 greedy accuracy, then GRPO with 16 prompts x 8 completions at lr 5e-4, bf16
and gradient checkpointing off (TRL turns both on by default, even on a CPU).
Reward: 1 for an exact answer, else 0.4 x the characters in place. Accuracy:
greedy decoding on 200 held-out prompts, answer digits then end-of-sequence.

It needs TRL, which rlnb does not depend on, so it runs in a venv of its own::

    python3.11 -m venv /tmp/trlenv
    /tmp/trlenv/bin/pip install -c .ci/constraints.txt torch "trl==1.16.*" datasets
    /tmp/trlenv/bin/python benchmarks/trl_baseline.py warmup --out /tmp/trl
    /tmp/trlenv/bin/python benchmarks/trl_baseline.py grpo --out /tmp/trl --steps 3800

Measured on the 2-core CI machine (TRL 1.16.0, transformers 5.24.0, one thread):
warm-up 200 steps to 0.235 in 12 s; GRPO 0.02 at step 100, 0.41 at 1,500, 0.59 at
2,000, 0.755 at 3,000, 0.80 at 3,300; 0.183 s/step (0.155 s/step on two threads).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

CHARS = list("0123456789+=")
SPECIAL = ["<bos>", "<eos>", "<pad>", "<unk>"]
VOCAB = {c: i for i, c in enumerate(CHARS + SPECIAL)}  # 16 tokens
BOS, EOS, PAD = VOCAB["<bos>"], VOCAB["<eos>"], VOCAB["<pad>"]
EVAL = [(r.randint(10, 99), r.randint(10, 99)) for r in [random.Random(1234)] for _ in range(200)]
EVAL_SET = set(EVAL)


def make_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one token per character
    tk.decoder = decoders.Fuse()
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def make_model(seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=16,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    return LlamaForCausalLM(config)


def training_pair(rng: random.Random) -> tuple[int, int]:
    while True:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if (a, b) not in EVAL_SET:
            return a, b


def encode_prompt(a: int, b: int) -> list[int]:
    return [BOS] + [VOCAB[c] for c in f"{a}+{b}="]


@torch.no_grad()
def greedy_accuracy(model: Any, max_new: int = 4) -> float:
    was_training = model.training
    model.eval()
    x = torch.tensor([encode_prompt(a, b) for a, b in EVAL])
    for _ in range(max_new):
        x = torch.cat([x, model(input_ids=x).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    correct = 0
    for generated, (a, b) in zip(x[:, -max_new:].tolist(), EVAL, strict=True):
        expected = [VOCAB[c] for c in str(a + b)] + [EOS]
        correct += generated[: len(expected)] == expected
    model.train(was_training)
    return correct / len(EVAL)


def reward(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float]:
    out = []
    for completion, target in zip(completions, answer, strict=True):
        c = completion.replace(" ", "")
        hits = sum(x == y for x, y in zip(c, target, strict=False))
        out.append(1.0 if c == target else 0.4 * hits / max(len(c), len(target), 1))
    return out


def warmup(out: Path, target: float, batch_size: int, lr: float) -> None:
    model, tokenizer = make_model(), make_tokenizer()
    print(f"parameters: {sum(p.numel() for p in model.parameters()):,}", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rng, started, step, accuracy = random.Random(0), time.perf_counter(), 0, 0.0
    while accuracy < target:
        rows, labels = [], []
        for _ in range(batch_size):
            a, b = training_pair(rng)
            prompt, answer = encode_prompt(a, b), [VOCAB[c] for c in str(a + b)] + [EOS]
            rows.append(prompt + answer + [PAD] * (11 - len(prompt) - len(answer)))
            labels.append([-100] * len(prompt) + answer + [-100] * (11 - len(prompt) - len(answer)))
        loss = model(input_ids=torch.tensor(rows), labels=torch.tensor(labels)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step % 25 == 0:
            accuracy = greedy_accuracy(model)
            print(f"warm-up step {step}: accuracy {accuracy:.3f}, {time.perf_counter() - started:.1f} s", flush=True)
    model.save_pretrained(out / "warm")
    tokenizer.save_pretrained(out / "warm")


def grpo_rows(steps: int, seed: int = 0) -> list[dict[str, str]]:
    """The GRPO prompts: 16 per step (and a few spare), never a held-out pair; another
    ``seed`` draws other prompts (seed 0 the baseline's)."""
    rng = random.Random(42 + seed)
    rows = []
    for _ in range(16 * (steps + 5)):
        a, b = training_pair(rng)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return rows


def grpo_args(output_dir: Path, lr: float, steps: int, seed: int = 0, **variant: Any) -> Any:
    """TRL's GRPOConfig for this recipe: 16 prompts x 8 completions per step, lr
    decaying linearly over ``steps``, no KL, fp32, no gradient checkpointing;
    ``seed`` seeds sampling and the data order, ``variant`` are GRPOConfig fields
    on top (``epsilon_high=0.28``, say)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(output_dir),
        learning_rate=lr,
        num_generations=8,
        per_device_train_batch_size=128,  # 16 prompts x 8 completions per optimizer step
        gradient_accumulation_steps=1,
        max_completion_length=4,
        temperature=1.0,
        beta=0.0,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        max_steps=steps,
        save_strategy="no",
        use_cpu=True,
        seed=seed,
        disable_tqdm=True,
        **variant,
    )


def grpo(out: Path, lr: float, steps: int, eval_every: int) -> None:
    from datasets import Dataset
    from transformers import LlamaForCausalLM, TrainerCallback
    from trl import GRPOTrainer

    model = LlamaForCausalLM.from_pretrained(out / "warm")
    rows = grpo_rows(steps)
    args = grpo_args(out / "grpo", lr, steps)
    curve: list[tuple[int, float, float]] = []

    class Evaluate(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, _args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
            self.started = time.perf_counter()
            curve.append((0, greedy_accuracy(model), 0.0))

        def on_step_end(self, _args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
            if state.global_step % eval_every == 0:
                elapsed = time.perf_counter() - self.started
                curve.append((state.global_step, greedy_accuracy(model), elapsed))
                print(
                    f"step {state.global_step}: accuracy {curve[-1][1]:.3f}, {elapsed / state.global_step:.3f} s/step",
                    flush=True,
                )

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=make_tokenizer(),
        callbacks=[Evaluate()],
    )
    trainer.train()
    (out / "curve.json").write_text(json.dumps(curve))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=("warmup", "grpo"))
    parser.add_argument("--out", type=Path, required=True, help="where the warmed-up model and the curve go")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the figures above used 1)")
    parser.add_argument("--target", type=float, default=0.2, help="warm-up: stop at this greedy accuracy")
    parser.add_argument("--lr", type=float, help="default: 1e-3 for the warm-up, 5e-4 for GRPO")
    parser.add_argument("--steps", type=int, default=3800, help="GRPO steps (lr decays linearly to 0 over them)")
    parser.add_argument("--eval-every", type=int, default=100)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stage == "warmup":
        warmup(args.out, args.target, batch_size=64, lr=args.lr or 1e-3)
    else:
        grpo(args.out, lr=args.lr or 5e-4, steps=args.steps, eval_every=args.eval_every)
    return 0


if __name__ == "__main__":
    sys.exit(main())

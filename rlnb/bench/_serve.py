"""``rlnb bench serve``: the endpoint (``sess.serve()``) against the same engine called in process.

One session (the built-in tiny policy on ``reverse`` by default, or a Hugging Face
model directory), one engine, two ways in:

- **in process**: ``await engine.generate(GenerateRequest(...))`` on the session's
  bridge loop (``sess.bridge.run``), the floor;
- **endpoint**: ``POST /v1/completions`` with the real ``openai.AsyncOpenAI`` client
  (``ep.client()``), the same prompt ids, ``extra_body={"ignore_eos": True}``.

At 1, 8 and 32 concurrent clients:

- **tokens/s**: that many requests of ``tokens`` new tokens each (``ignore_eos``: each
  generates exactly that many), all at once; the median over ``rounds``;
- **latency** of a short request (``short_tokens`` new tokens): each client sends
  ``latency_requests`` of them one after another; p50 and p99 over every request of
  every round.

Where the time goes: each thread's CPU time over the latency rounds (Linux's
``/proc/self/task``), per short request: the clients' loop (the openai client and
httpx), the session's loop (uvicorn, Starlette, the endpoint's parsing and replies, and
the engine's callers) and the engine's thread.

The two variants alternate round by round (in process first, then the endpoint
first, ...) after a warm-up round of each, so that load from elsewhere on a shared
machine falls on both alike.

The clients run in this process on an event loop thread of their own, not on the
session's bridge loop, which runs the server and the engine's calls: a client on that
loop would queue behind the server it calls. Not in a process of their own either:
an agent a user writes runs in the notebook's process, so what the openai client
costs there is part of what the endpoint costs them (on the 2-core machine clients in
a process of their own measured the same ratio, 0.62 against 0.63 at 32 clients).

The target: the endpoint's tokens/s at least 0.8x in process's at each concurrency.
The gap is a fixed cost per request (the client's request building, HTTP, Starlette,
pydantic, JSON both ways), and what follows from it: N calls reach the engine spread
over N times that cost, so it decodes them in more, smaller batches. It shrinks as a
request's generation grows, and is widest with the tiny policy, whose 32 sequences
decode a token in about a millisecond.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

from rlnb.bench._common import BenchResult, Target, median, p99
from rlnb.engines import GenerateRequest, SamplingParams

__all__ = ["run"]

T = TypeVar("T")

CLIENTS = (1, 8, 32)
SHORT_TOKENS = 4
PROMPT = "abcdef"  # in the reverse task's alphabet, so a model built for it knows every character
VARIANTS = ("in_process", "endpoint")


class _ClientLoop:
    """An event loop on a thread of its own, for the clients; closed with the block."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rlnb-bench-serve-clients", daemon=True)

    def __enter__(self) -> _ClientLoop:
        self._thread.start()
        return self

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


def _thread_cpu_s(roles: dict[int, str]) -> dict[str, float]:
    """CPU seconds of this process's threads so far, summed by role: ``roles`` maps a
    native thread id to its role; a thread named ``...-engine`` is "engine", any other
    "other". Empty where ``/proc/self/task`` is not there (Linux only)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in map(int, os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ()):
        try:  # schedstat's first field: nanoseconds on a CPU (stat's are 10 ms ticks)
            with open(f"/proc/self/task/{tid}/schedstat", encoding="ascii") as stat:
                seconds = int(stat.read().split()[0]) / 1e9
        except OSError:  # the thread ended meanwhile
            continue
        role = roles.get(tid) or ("engine" if names.get(tid, "").endswith("-engine") else "other")
        out[role] = out.get(role, 0.0) + seconds
    return out


class _Variants:
    """One request of ``max_tokens`` new tokens, by either way in; each returns the
    number of tokens generated."""

    def __init__(self, sess: Any, client: Any, clients: _ClientLoop, prompt_ids: tuple[int, ...]) -> None:
        self._sess, self._client, self._clients, self._prompt_ids = sess, client, clients, prompt_ids
        self._engine = sess._engine  # the session's own; no public handle, by design
        self._ids = itertools.count()
        self.roles = {sess.bridge.run(_native_id()): "loop", clients.run(_native_id()): "clients"}

    async def in_process(self, max_tokens: int) -> int:
        n = next(self._ids)
        sampling = SamplingParams(max_new_tokens=max_tokens, ignore_eos=True)
        result = await self._engine.generate(GenerateRequest(f"bench-serve.{n}", self._prompt_ids, sampling, seed=n))
        return len(result.token_ids)

    async def endpoint(self, max_tokens: int) -> int:
        n = next(self._ids)
        reply = await self._client.completions.create(
            model="bench",
            prompt=list(self._prompt_ids),
            max_tokens=max_tokens,
            seed=n,
            extra_body={"ignore_eos": True},
        )
        return int(reply.usage.completion_tokens)

    def run(self, variant: str, coro: Coroutine[Any, Any, T]) -> T:
        """``coro`` where its variant's caller would run it: the bridge loop, or the clients'."""
        return self._sess.bridge.run(coro) if variant == "in_process" else self._clients.run(coro)

    def call(self, variant: str) -> Callable[[int], Awaitable[int]]:
        return self.in_process if variant == "in_process" else self.endpoint


async def _native_id() -> int:
    return threading.get_native_id()


async def _tokens_per_s(call: Callable[[int], Awaitable[int]], clients: int, tokens: int) -> float:
    start = time.perf_counter()
    counts = await asyncio.gather(*(call(tokens) for _ in range(clients)))
    elapsed = time.perf_counter() - start
    if sum(counts) != clients * tokens:
        raise AssertionError(f"asked for {clients} x {tokens} tokens, got {counts}")
    return sum(counts) / elapsed


async def _latencies_ms(call: Callable[[int], Awaitable[int]], clients: int, tokens: int, each: int) -> list[float]:
    out: list[float] = []

    async def client() -> None:
        for _ in range(each):
            start = time.perf_counter()
            await call(tokens)
            out.append((time.perf_counter() - start) * 1e3)

    await asyncio.gather(*(client() for _ in range(clients)))
    return out


def _orders(rounds: int) -> Iterator[tuple[str, ...]]:
    """Each round's order of the variants: alternating, so neither always goes first."""
    for i in range(rounds):
        yield VARIANTS if i % 2 == 0 else VARIANTS[::-1]


def _measure(
    variants: _Variants, clients: int, *, rounds: int, tokens: int, short_tokens: int, latency_requests: int
) -> dict[str, Any]:
    rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
    latencies: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for variant in VARIANTS:  # warm-up: connections opened, batch shapes seen
        variants.run(variant, _tokens_per_s(variants.call(variant), clients, tokens))
        variants.run(variant, _latencies_ms(variants.call(variant), clients, short_tokens, 1))
    for order in _orders(rounds):
        for variant in order:
            rates[variant].append(variants.run(variant, _tokens_per_s(variants.call(variant), clients, tokens)))
    cpu: dict[str, dict[str, float]] = {v: {} for v in VARIANTS}
    for order in _orders(rounds):
        for variant in order:
            call = variants.call(variant)
            before = _thread_cpu_s(variants.roles)
            latencies[variant] += variants.run(variant, _latencies_ms(call, clients, short_tokens, latency_requests))
            for role, seconds in _thread_cpu_s(variants.roles).items():
                cpu[variant][role] = cpu[variant].get(role, 0.0) + seconds - before.get(role, 0.0)
    figures: dict[str, Any] = {}
    for variant in VARIANTS:
        figures[f"{variant}_tokens_per_s"] = round(median(rates[variant]), 1)
        figures[f"{variant}_p50_ms"] = round(median(latencies[variant]), 3)
        figures[f"{variant}_p99_ms"] = round(p99(latencies[variant]), 3)
        for role in ("clients", "loop", "engine"):
            seconds = cpu[variant].get(role, 0.0)
            figures[f"{variant}_cpu_ms_{role}"] = round(seconds * 1e3 / len(latencies[variant]), 3)
    figures["endpoint_over_in_process_tokens"] = round(
        figures["endpoint_tokens_per_s"] / figures["in_process_tokens_per_s"], 4
    )
    figures["latency_samples"] = len(latencies["endpoint"])
    return figures


def _config(model: str | None, max_len: int) -> Any:
    from rlnb.config import Config, DataConfig, ModelConfig, TrackConfig

    return Config(
        task="reverse",
        model=ModelConfig(path=model, max_len=max_len),
        data=DataConfig(num_workers=0),
        track=TrackConfig(backends=()),
    )


def measure(
    *,
    model: str | None = None,
    clients: tuple[int, ...] = CLIENTS,
    rounds: int = 9,
    tokens: int = 64,
    short_tokens: int = SHORT_TOKENS,
    latency_requests: int = 10,
) -> dict[int, dict[str, Any]]:
    """Each concurrency's figures (see the module docstring), from one session on
    ``model`` (a Hugging Face model directory; None: the built-in tiny policy) and its
    endpoint. Blocks; listens on loopback (run it inside a loopback-only namespace
    where the machine asks for one)."""
    from rlnb.session import Session

    with Session(_config(model, max_len=len(PROMPT) + 2 + tokens), name="bench-serve") as sess:
        endpoint = sess.serve()
        prompt_ids = tuple(sess.tokenizer.encode(PROMPT, bos=True))
        with _ClientLoop() as loop:
            client = loop.run(_make_client(endpoint))
            try:
                variants = _Variants(sess, client, loop, prompt_ids)
                out = {
                    n: _measure(
                        variants,
                        n,
                        rounds=rounds,
                        tokens=tokens,
                        short_tokens=short_tokens,
                        latency_requests=latency_requests,
                    )
                    for n in clients
                }
            finally:
                loop.run(client.close())
        statuses = endpoint.statistics().by_status
    if set(statuses) != {200}:
        raise AssertionError(f"the endpoint answered {statuses}: every call should have had 200")
    return out


async def _make_client(endpoint: Any) -> Any:
    # Made on the clients' loop, where its connections will live. No retries: a retried
    # call would be timed as one.
    return endpoint.client(max_retries=0)


def run(
    *,
    quick: bool = False,
    model: str | None = None,
    clients: tuple[int, ...] | None = None,
    rounds: int | None = None,
    tokens: int | None = None,
) -> BenchResult:
    """Measure; blocks for about half a minute at the defaults on two cores, a few
    seconds with ``quick`` (1 and 8 clients, 3 rounds, 16 tokens, 3 short requests a
    client a round). Listens on loopback."""
    sizes: dict[str, Any] = (
        {"clients": (1, 8), "rounds": 3, "tokens": 16, "latency_requests": 3}
        if quick
        else {"clients": CLIENTS, "rounds": 9, "tokens": 64, "latency_requests": 10}
    )
    for key, value in (("clients", clients), ("rounds", rounds), ("tokens", tokens)):
        if value is not None:
            sizes[key] = value
    per_clients = measure(model=model, **sizes)
    return summarize(per_clients, model=model or "the built-in tiny policy (reverse)", **sizes)


def summarize(
    per_clients: dict[int, dict[str, Any]],
    *,
    model: str,
    clients: tuple[int, ...],
    rounds: int,
    tokens: int,
    latency_requests: int,
) -> BenchResult:
    """The result: each concurrency's figures, prefixed ``c{N}_``, and a target per
    concurrency: the endpoint's tokens/s over in process's, at least 0.8x."""
    figures: dict[str, Any] = {
        "model": model,
        "workload": (
            f"tokens/s: N requests of {tokens} new tokens at once, median of {rounds}; latency: N clients, "
            f"{latency_requests} requests of {SHORT_TOKENS} new tokens each a round, {rounds} rounds; "
            "cpu_ms_ROLE: CPU ms per short request of the clients' thread, the session's loop, the engine's thread"
        ),
        "clients": "openai.AsyncOpenAI on an event loop thread of this process; in process: engine.generate",
    }
    targets = []
    for n in clients:
        for key, value in per_clients[n].items():
            figures[f"c{n}_{key}"] = value
        ratio = per_clients[n]["endpoint_over_in_process_tokens"]
        targets.append(Target(f"endpoint_over_in_process_tokens_c{n}", ratio, ">=", 0.8, "x"))
    return BenchResult("serve", figures, tuple(targets))

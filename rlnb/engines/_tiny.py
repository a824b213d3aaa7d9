"""``TinyEngine``: continuous batching with a slot KV cache, on a thread of its own.

New requests join at step boundaries (one batched prefill), every active sequence
advances one token per decode step, and a finished sequence leaves at once and
frees its slot. torch releases the GIL in its kernels, so the bridge loop stays
responsive while the engine decodes. The thread never sees SIGINT (Python runs
signal handlers on the main thread only), so the notebook's interrupt button
cannot break it.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import heapq
import random
import threading
from collections.abc import Mapping
from typing import Any

import torch

from rlnb._errors import ClosedError, EngineError
from rlnb.config import EngineConfig
from rlnb.engines._protocol import EngineStatistics, GenerateRequest, GenerateResult, PauseMode, PromptTooLong
from rlnb.engines._sampling import sample_next
from rlnb.engines._shared import DEFAULT_ENGINE, check_engine_config, deliver
from rlnb.models import HFPolicy, TinyPolicy

__all__ = ["TinyEngine"]


@dataclasses.dataclass(eq=False)
class _Seq:
    request: GenerateRequest
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[GenerateResult]
    rng: random.Random
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    order: int = 0  # arrival order
    slot: int = -1
    position: int = 0  # where the next fed token goes
    aborted: bool = False


def _slot(seq: _Seq) -> int:
    return seq.slot


class TinyEngine:
    """Serves a :class:`~rlnb.models.TinyPolicy` or a :class:`~rlnb.models.HFPolicy`
    (a private copy) with continuous batching.

    ``config`` (an :class:`~rlnb.EngineConfig`; its ``max_batch`` and ``threads`` are
    read): ``max_batch`` bounds the sequences decoded together (the KV cache's slots),
    ``threads`` sets torch's intra-op threads on the engine's thread only.
    ``continuous=False`` gives static batching (a batch admits new requests only
    once all of its sequences have finished), for comparison.
    ``max_prefill_tokens`` bounds the tokens one prefill runs (distinct inputs; at
    least one request): a resume that continues 128 partial rollouts prefills them
    over a few steps, so a pause or a weight sync waits for one of those, not for all.
    Raises :class:`~rlnb.ConfigError` for a ``config`` that is not an ``EngineConfig``.
    """

    def __init__(
        self,
        policy: TinyPolicy | HFPolicy,
        config: EngineConfig = DEFAULT_ENGINE,
        *,
        eos_id: int,
        continuous: bool = True,
        name: str = "rlnb-engine",
        max_prefill_tokens: int = 2048,
    ) -> None:
        check_engine_config(config, "TinyEngine")
        self._model: Any = copy.deepcopy(policy).eval().requires_grad_(False)
        self._max_len = policy.max_len
        self._eos = eos_id
        self._continuous = continuous
        self._threads = config.threads
        self._device = self._model.device  # where the copy's weights, cache and inputs live
        self._cache = self._model.new_cache(config.max_batch)
        self._free = list(range(config.max_batch))  # a heap: the lowest free slot goes first
        self._admit_chunk = max(1, config.max_batch // 8)
        self._max_prefill_tokens = max_prefill_tokens
        self._cond = threading.Condition()
        self._queue: collections.deque[_Seq] = collections.deque()
        self._active: list[_Seq] = []
        self._paused: PauseMode | None = None
        self._barriers: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._updates: list[tuple[Mapping[str, Any], int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._version = 0
        self._arrivals = 0
        self._wait_cutoff = 0  # in WAIT mode, requests that arrived up to here still run
        self._closed = False
        self._death: EngineError | None = None  # why the engine thread died, if it did
        self._counts = {"finished": 0, "aborted": 0, "tokens": 0, "steps": 0, "batch_sum": 0}
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    # -- the async API (called on the bridge loop) -----------------------------------

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        needed = len(request.prompt_ids) + len(request.prefix_ids) + 1
        if needed > self._max_len:
            raise PromptTooLong(
                f"request {request.request_id}: prompt and prefix take {needed - 1} tokens, "
                f"leaving no room in the model's context of {self._max_len}",
                tokens=needed - 1,
                context=self._max_len,
            )
        loop = asyncio.get_running_loop()
        seq = _Seq(request, loop, loop.create_future(), random.Random(request.seed))
        with self._cond:
            self._check_open()
            self._arrivals += 1
            seq.order = self._arrivals
            self._queue.append(seq)
            self._cond.notify()
        try:
            return await seq.future
        except asyncio.CancelledError:
            with self._cond:  # the caller is gone: free its slot at the next boundary
                seq.aborted = True
                self._cond.notify()
            raise

    async def abort(self, request_ids: list[str]) -> None:
        ids = set(request_ids)
        with self._cond:
            for seq in [*self._queue, *self._active]:
                if seq.request.request_id in ids:
                    seq.aborted = True
            self._cond.notify()

    async def pause(self, mode: PauseMode | str = PauseMode.KEEP) -> None:
        mode = PauseMode(mode)
        with self._cond:
            self._check_open()
            self._paused = mode
            self._wait_cutoff = self._arrivals
            if mode is PauseMode.ABORT:
                for seq in [*self._queue, *self._active]:
                    seq.aborted = True
            self._cond.notify()
        if mode is not PauseMode.WAIT:
            await self._barrier()  # quiescent once the current step has ended

    async def resume(self) -> None:
        with self._cond:
            self._check_open()
            self._paused = None
            self._cond.notify()

    async def update_weights(self, state: Mapping[str, Any], version: int) -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        with self._cond:
            self._check_open()
            self._updates.append((state, version, loop, done))
            self._cond.notify()
        await done

    async def _barrier(self) -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        with self._cond:
            self._barriers.append((loop, done))
            self._cond.notify()
        await done

    def statistics(self) -> EngineStatistics:
        with self._cond:
            steps = self._counts["steps"]
            return EngineStatistics(
                version=self._version,
                paused=None if self._paused is None else self._paused.value,
                waiting=len(self._queue),
                running=len(self._active),
                finished=self._counts["finished"],
                aborted=self._counts["aborted"],
                generated_tokens=self._counts["tokens"],
                decode_steps=steps,
                extra={
                    "mean_batch": self._counts["batch_sum"] / steps if steps else 0.0,
                    "died": None if self._death is None else str(self._death),
                },
            )

    def close(self, timeout: float | None = 5.0) -> None:
        """Stop the engine thread; waiting callers get :class:`~rlnb.ClosedError`. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._fail_waiters(ClosedError("the engine closed"), pause_result=None)

    def _fail_waiters(self, error: Exception, *, pause_result: Exception | None) -> None:
        """Settle everything waiting on the engine: requests and weight updates fail
        with ``error``; pauses get ``pause_result`` (None: they are done)."""
        with self._cond:
            pending = [*self._queue, *self._active]
            self._queue.clear()
            self._active.clear()
            barriers, self._barriers = self._barriers, []
            updates, self._updates = self._updates, []
        for seq in pending:
            deliver(seq.loop, seq.future, error)
        for loop, fut in barriers:
            deliver(loop, fut, pause_result)
        for _, _, loop, fut in updates:
            deliver(loop, fut, error)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the engine is closed")
        if self._death is not None:  # a fresh error each time, chained to what killed the thread
            raise EngineError(str(self._death)) from self._death.__cause__

    # -- the engine thread ---------------------------------------------------------

    def _has_work(self) -> bool:
        if self._closed or self._updates or self._barriers:
            return True
        if any(s.aborted for s in self._queue) or any(s.aborted for s in self._active):
            return True
        if self._paused is PauseMode.KEEP:
            return False
        return bool(self._active) or (bool(self._queue) and self._may_admit())

    def _may_admit(self) -> bool:
        if not self._free or not self._queue:
            return False
        if self._paused is PauseMode.WAIT:  # in flight means already asked for: those still run
            return self._queue[0].order <= self._wait_cutoff
        if self._paused is not None:
            return False
        if not self._continuous:
            return not self._active
        # Admit in chunks: on a CPU a prefill costs about as much for eight sequences
        # as for one, so a step that admits one sequence at a time wastes most of it.
        return not self._active or len(self._free) >= min(self._admit_chunk, len(self._queue))

    def _serve(self) -> None:
        try:
            self._serve_loop()
        except BaseException as exc:  # never die silently: every waiter, now and later, hears of it
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        error = EngineError(f"the engine thread died: {exc!r}; close the session and make a new one")
        error.__cause__ = exc
        with self._cond:
            self._death = error
        self._fail_waiters(error, pause_result=error)

    def _serve_loop(self) -> None:
        torch.set_num_threads(self._threads)  # OpenMP's thread count is per calling thread
        while True:
            with self._cond:
                self._cond.wait_for(self._has_work)
                if self._closed:
                    return
                updates, self._updates = self._updates, []
                finished = self._take_aborted()
                # in slot order: with every slot busy that is one run, which decode() reads in place
                stepping = sorted(self._active, key=_slot) if self._paused is not PauseMode.KEEP else []
                admitted = self._admit() if self._may_admit() else []
            for seq in finished:
                self._finish(seq, "aborted")
            try:
                self._apply_updates(updates)
            except BaseException as exc:  # the thread dies: the updates it had taken hear why too
                self._die(exc)
                for _, _, loop, fut in updates:
                    deliver(loop, fut, self._death)
                return
            try:
                if stepping:
                    self._decode(stepping)
                if admitted:  # joins at this boundary; decodes with the rest from the next step
                    self._prefill(admitted)
            except Exception as exc:  # fail the requests in hand, keep serving the rest
                self._fail_active(exc)
            with self._cond:
                barriers, self._barriers = self._barriers, []
            for loop, fut in barriers:
                deliver(loop, fut, None)

    def _take_aborted(self) -> list[_Seq]:
        """Remove aborted sequences (queued or active) and free their slots. Lock held."""
        out = [s for s in self._queue if s.aborted] + [s for s in self._active if s.aborted]
        if out:
            self._queue = collections.deque(s for s in self._queue if not s.aborted)
            self._active = [s for s in self._active if not s.aborted]
            for seq in out:
                if seq.slot >= 0:
                    heapq.heappush(self._free, seq.slot)
        return out

    def _admit(self) -> list[_Seq]:
        admitted: list[_Seq] = []
        inputs: set[tuple[int, ...]] = set()  # a group's copies of one prompt are prefilled once
        tokens = 0
        while self._queue and self._free:
            if self._paused is PauseMode.WAIT and self._queue[0].order > self._wait_cutoff:
                break
            request = self._queue[0].request
            x = (*request.prompt_ids, *request.prefix_ids)
            if x not in inputs:
                if self._continuous and admitted and tokens + len(x) > self._max_prefill_tokens:
                    break  # the rest join at the next boundaries
                inputs.add(x)
                tokens += len(x)
            seq = self._queue.popleft()
            seq.slot = heapq.heappop(self._free)
            admitted.append(seq)
        self._active.extend(admitted)
        return admitted

    def _apply_updates(self, updates: list[tuple[Mapping[str, Any], int, asyncio.AbstractEventLoop, Any]]) -> None:
        for state, version, loop, fut in updates:
            try:
                self._model.load_state_dict(state)
            except Exception as exc:
                deliver(loop, fut, exc)
            else:
                self._version = version
                deliver(loop, fut, None)

    def _prefill(self, seqs: list[_Seq]) -> None:
        inputs = [(*s.request.prompt_ids, *s.request.prefix_ids) for s in seqs]
        # A group asks for the same prompt group_size times: run each distinct input
        # once and copy its keys and values into the other slots (8x less prefill).
        first: dict[tuple[int, ...], _Seq] = {}  # each distinct input, in order, and its first asker
        for seq, x in zip(seqs, inputs, strict=True):
            first.setdefault(x, seq)
        row = {x: r for r, x in enumerate(first)}
        width = max(len(x) for x in first)
        dev = self._device
        ids = torch.tensor([[*x, *(0,) * (width - len(x))] for x in first], device=dev)
        lengths = torch.tensor([len(x) for x in first], device=dev)
        slots = torch.tensor([s.slot for s in first.values()], device=dev)
        logits = self._model.prefill(self._cache, slots, ids, lengths)
        copies = [(first[x].slot, seq.slot) for seq, x in zip(seqs, inputs, strict=True) if first[x] is not seq]
        if copies:  # positions past an input's length hold padding, as prefill leaves them
            src, dst = torch.tensor(copies, device=dev).unbind(1)
            self._cache.copy_slots(src, dst, width)
        for seq, x in zip(seqs, inputs, strict=True):
            seq.position = len(x)
        self._advance(seqs, logits[torch.tensor([row[x] for x in inputs], device=dev)])

    def _decode(self, seqs: list[_Seq]) -> None:
        dev = self._device
        slots = torch.tensor([s.slot for s in seqs], device=dev)
        ids = torch.tensor([s.tokens[-1] for s in seqs], device=dev)
        positions = torch.tensor([s.position for s in seqs], device=dev)
        logits = self._model.decode(self._cache, slots, ids, positions)
        for seq in seqs:
            seq.position += 1
        self._advance(seqs, logits)

    def _advance(self, seqs: list[_Seq], logits: torch.Tensor) -> None:
        """Sample one token for each sequence from ``logits`` and retire the finished."""
        tokens, logprobs = sample_next(logits, [s.request for s in seqs], [s.rng for s in seqs], self._eos)
        version = self._version
        done: list[tuple[_Seq, str]] = []
        for seq, token, logprob in zip(seqs, tokens, logprobs, strict=True):
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(version)
            if token == self._eos and not seq.request.sampling.ignore_eos:
                done.append((seq, "stop"))
            elif len(seq.tokens) >= seq.request.sampling.max_new_tokens or seq.position >= self._max_len:
                done.append((seq, "length"))
        with self._cond:
            self._counts["tokens"] += len(seqs)
            self._counts["steps"] += 1
            self._counts["batch_sum"] += len(seqs)
            for seq, _ in done:
                self._active.remove(seq)
                heapq.heappush(self._free, seq.slot)
        for seq, reason in done:
            self._finish(seq, reason)

    def _finish(self, seq: _Seq, reason: str) -> None:
        with self._cond:
            self._counts["aborted" if reason == "aborted" else "finished"] += 1
        result = GenerateResult(
            seq.request.request_id, tuple(seq.tokens), tuple(seq.logprobs), tuple(seq.versions), reason
        )
        deliver(seq.loop, seq.future, result)

    def _fail_active(self, exc: Exception) -> None:
        with self._cond:
            failed, self._active = self._active, []
            for seq in failed:
                heapq.heappush(self._free, seq.slot)
        for seq in failed:
            deliver(seq.loop, seq.future, exc)

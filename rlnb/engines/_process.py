"""``ProcessEngine``: the built-in engine in a process of its own, on one machine.

In one process, the engine's thread and the learner's share an interpreter lock,
and at the built-in policy's size both are bound by PyTorch's per-operator
overhead, which holds it: async mode overlaps little. Here the ``TinyEngine``
runs in a spawned child (``_process_server``) and the two sides run at once on
two cores.

* **Requests** go down a pipe in batches: those that arrive in one turn of the
  bridge loop (a rollout's dispatch) in one message; results come back, those
  that end together in one message, read by a thread of this process that hands
  each to the loop that awaits it.
* **Weights** go through shared memory: the policy's tensors have a place in a
  buffer that both processes map (the *mailbox*, one buffer per dtype);
  ``update_weights`` copies the learner's tensors into it and tells the child,
  which loads them between two decode steps (one copy on each side, no pickling).
* **Ownership** (contracts 1 and 8): the session owns the child as it owns
  vLLM's: ``close()`` stops it and waits for it; a guard process (``_guard``)
  kills it if this process dies without closing it; a child that dies fails
  every waiting request with :class:`~rlnb.EngineError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import Mapping
from typing import Any

from rlnb._errors import ClosedError, EngineError, WeightSyncError
from rlnb.config import EngineConfig
from rlnb.engines._guard import Guard
from rlnb.engines._process_server import serve
from rlnb.engines._protocol import EngineStatistics, GenerateRequest, GenerateResult, PauseMode
from rlnb.engines._shared import DEFAULT_ENGINE, check_engine_config, deliver
from rlnb.engines._shared import running as count_running
from rlnb.runtime import spawn_without_main

__all__ = ["ProcessEngine"]

_START_TIMEOUT = 120.0  # seconds for the child to import torch and build its engine


class ProcessEngine:
    """A :class:`~rlnb.engines.TinyEngine` in a child process; see the module docstring.

    Made by :meth:`start`, which blocks until the child serves. Every async method
    runs on the caller's event loop (the session's bridge loop); ``statistics`` and
    ``close`` may be called from any thread.
    """

    def __init__(self, process: Any, conn: Any, mailbox: Mailbox, guard: Guard, name: str) -> None:
        self._process, self._conn, self._mailbox, self._guard = process, conn, mailbox, guard
        self.pid: int = process.pid
        self._name = name
        self._lock = threading.Lock()  # guards the pipe's sending end and the tables below
        self._keys = itertools.count()
        self._requests: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[GenerateResult]]] = {}
        self._controls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        self._outgoing: list[tuple[int, GenerateRequest]] = []
        self._updating: asyncio.Lock | None = None  # one write into the mailbox at a time
        self._version = 0
        self._paused: PauseMode | None = None
        self._arrivals, self._cutoff = 0, 0
        self._in_flight: set[int] = set()  # arrival numbers of the requests in flight
        self._counts = {"finished": 0, "aborted": 0, "tokens": 0, "decode_steps": 0}
        self._mean_batch = 0.0
        self._closed = False
        self._death: EngineError | None = None
        self._reader = threading.Thread(target=self._read, name=f"{name}-reader", daemon=True)
        self._reader.start()

    @classmethod
    def start(
        cls,
        policy: Any,
        config: EngineConfig = DEFAULT_ENGINE,
        *,
        eos_id: int,
        continuous: bool = True,
        name: str = "rlnb-engine",
        timeout: float = _START_TIMEOUT,
    ) -> ProcessEngine:
        """Spawn the child serving a copy of ``policy`` (a CPU
        :class:`~rlnb.models.TinyPolicy` or :class:`~rlnb.models.HFPolicy`) on a
        :class:`TinyEngine` made with ``config`` (an :class:`~rlnb.EngineConfig`) and
        wait until it serves. ConfigError for a ``config`` that is not one; EngineError
        if the child dies or does not answer within ``timeout`` seconds; nothing is left
        running if it fails, Ctrl-C included."""
        import pickle

        import torch.multiprocessing  # registers the passing of shared-memory tensors to a child

        check_engine_config(config, "ProcessEngine.start")
        if policy.device.type != "cpu":
            raise EngineError(
                f"ProcessEngine serves on the CPU, and the policy is on {policy.device}: "
                "use the in-process engine or vLLM on a GPU"
            )
        mailbox = Mailbox.of(policy.state_dict())
        served = pickle.dumps(policy)  # by value: the child unpickles its own copy
        ctx = torch.multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        options = {"eos_id": eos_id, "config": config, "continuous": continuous, "name": name}
        process = ctx.Process(target=serve, args=(child, served, mailbox, options), name=name, daemon=True)
        guard = Guard()
        try:
            with spawn_without_main():
                process.start()
            child.close()  # ours closed: the child's death reads as the end of the pipe
            assert process.pid is not None  # started
            guard.watch([process.pid])
            _wait_ready(parent, process, timeout)
        except BaseException:
            if process.pid is not None and process.is_alive():
                process.kill()
                process.join(5.0)
            parent.close()
            guard.close(kill=True)
            raise
        return cls(process, parent, mailbox, guard, name)

    # -- the Engine protocol ------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[GenerateResult] = loop.create_future()
        with self._lock:
            self._check_open()
            key = next(self._keys)
            self._requests[key] = (loop, future)
            self._outgoing.append((key, request))
            first = len(self._outgoing) == 1
            self._arrivals += 1
            arrival = self._arrivals
            self._in_flight.add(arrival)
        if first:  # the requests of this turn of the loop go together
            loop.call_soon(self._send_outgoing)
        try:
            result = await future
        except asyncio.CancelledError:
            with self._lock:
                gone = self._requests.pop(key, None) is not None
            if gone:
                self._send(("cancel", [key]))
            raise
        finally:
            with self._lock:
                self._in_flight.discard(arrival)
        return result

    async def abort(self, request_ids: list[str]) -> None:
        self._check_open()
        self._send(("abort", list(request_ids)))

    async def pause(self, mode: PauseMode | str = PauseMode.KEEP) -> None:
        mode = PauseMode(mode)
        self._check_open()
        self._send_outgoing()  # what was asked for before the pause goes first
        self._paused, self._cutoff = mode, self._arrivals
        await self._control("pause", mode.value)

    async def resume(self) -> None:
        self._check_open()
        self._paused = None
        await self._control("resume")

    async def update_weights(self, state: Mapping[str, Any], version: int) -> None:
        self._check_open()
        mailbox = self._mailbox
        mailbox.check(state)  # whole, before a byte is written
        if self._updating is None:
            self._updating = asyncio.Lock()
        async with self._updating:  # the child reads the mailbox until it answers
            mailbox.write(state)  # while the rollout is paused for the sync; one memcpy per tensor
            answer = await self._control("update", version)
        if answer != version:
            raise EngineError(f"the engine process is at weights version {answer} after loading {version}")
        self._version = version

    def statistics(self) -> EngineStatistics:
        with self._lock:
            in_flight = list(self._in_flight)
            counts = dict(self._counts)
            paused, cutoff = self._paused, self._cutoff
        running = count_running(in_flight, paused, cutoff)
        return EngineStatistics(
            version=self._version,
            paused=None if paused is None else paused.value,
            waiting=len(in_flight) - running,
            running=running,
            finished=counts["finished"],
            aborted=counts["aborted"],
            generated_tokens=counts["tokens"],
            decode_steps=counts["decode_steps"],
            extra={
                "mean_batch": self._mean_batch,
                "pid": self.pid,
                "died": None if self._death is None else str(self._death),
            },
        )

    def close(self, timeout: float | None = 5.0) -> None:
        """Stop the child and wait for it (killed after ``timeout``); waiting callers get
        :class:`~rlnb.ClosedError`. Idempotent; blocks; any thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._send(("close",), force=True)
        self._process.join(5.0 if timeout is None else timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5.0)
        self._reader.join(5.0)  # the child's end is closed: the reader has read its end
        self._conn.close()
        self._mailbox.release()
        self._fail_waiters(ClosedError("the engine closed"))
        self._guard.close(kill=False)
        with contextlib.suppress(ValueError):
            self._process.close()

    # -- the pipe -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the engine is closed")
        if self._death is not None:  # a fresh error each time, chained to the same cause
            raise EngineError(str(self._death)) from self._death.__cause__

    def _send(self, message: tuple[Any, ...], *, force: bool = False) -> None:
        with self._lock:
            if (self._closed and not force) or self._death is not None:
                return
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the child is gone: the reader says why
                pass

    def _send_outgoing(self) -> None:
        with self._lock:
            batch, self._outgoing = self._outgoing, []
            batch = [(key, request) for key, request in batch if key in self._requests]
        if batch:
            self._send(("generate", batch))

    async def _control(self, kind: str, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        with self._lock:
            self._check_open()
            ticket = next(self._keys)
            self._controls[ticket] = (loop, future)
        self._send((kind, ticket, *args))
        return await future

    def _read(self) -> None:
        """The reader thread: hand every answer to the loop that waits for it, until
        the pipe ends (the child exited or died)."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            except Exception as exc:  # an answer that does not unpickle: the engine is unusable
                self._die(EngineError(f"the engine process sent an unreadable answer: {exc!r}"))
                return
            kind = message[0]
            if kind == "results":
                self._settle_results(message[1], message[2])
            elif kind == "done":
                with self._lock:
                    waiter = self._controls.pop(message[1], None)
                    self._take_stats(message[3])
                if waiter is not None:
                    deliver(*waiter, message[2])
        if not self._closed:
            self._process.join(1.0)
            self._die(EngineError(f"the engine process (pid {self.pid}) died: {_exit(self._process)}"))

    def _settle_results(self, outcomes: list[tuple[int, Any]], stats: Mapping[str, Any]) -> None:
        settled = []
        with self._lock:
            self._take_stats(stats)
            for key, outcome in outcomes:
                waiter = self._requests.pop(key, None)
                if waiter is None:
                    continue
                if isinstance(outcome, GenerateResult):
                    self._counts["aborted" if outcome.finish_reason == "aborted" else "finished"] += 1
                    self._counts["tokens"] += len(outcome.token_ids)
                settled.append((waiter, outcome))
        for (loop, future), outcome in settled:
            deliver(loop, future, outcome)

    def _take_stats(self, stats: Mapping[str, Any]) -> None:
        self._counts["decode_steps"] = int(stats["decode_steps"])
        self._mean_batch = float(stats["mean_batch"])

    def _die(self, error: EngineError) -> None:
        with self._lock:
            self._death = error
        self._fail_waiters(error)

    def _fail_waiters(self, error: Exception) -> None:
        with self._lock:
            requests, self._requests = list(self._requests.values()), {}
            controls, self._controls = list(self._controls.values()), {}
        for loop, future in [*requests, *controls]:
            deliver(loop, future, error)


class Mailbox:
    """Where the weights travel: one shared-memory buffer per dtype (one file
    descriptor each, whatever the number of tensors), and a view of it per entry of
    the policy's state dict. The parent writes into the views; the child, given the
    buffers at its start, reads the same memory through views of its own."""

    def __init__(self, buffers: dict[Any, Any], layout: list[tuple[str, Any, int, tuple[int, ...]]]) -> None:
        self.buffers, self.layout = buffers, layout
        self.views = {
            key: buffers[dtype][offset : offset + _numel(shape)].view(shape) for key, dtype, offset, shape in layout
        }

    @classmethod
    def of(cls, state: Mapping[str, Any]) -> Mailbox:
        import torch

        sizes: dict[Any, int] = {}
        layout = []
        for key, tensor in state.items():
            layout.append((key, tensor.dtype, sizes.get(tensor.dtype, 0), tuple(tensor.shape)))
            sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + tensor.numel()
        buffers = {dtype: torch.empty(size, dtype=dtype).share_memory_() for dtype, size in sizes.items()}
        mailbox = cls(buffers, layout)
        mailbox.write(state)
        return mailbox

    def __getstate__(self) -> tuple[Any, Any]:
        return self.buffers, self.layout  # the views are made again on the other side

    def __setstate__(self, state: tuple[Any, Any]) -> None:
        self.__init__(*state)  # type: ignore[misc]

    def check(self, state: Mapping[str, Any]) -> None:
        missing = sorted(self.views.keys() - state.keys())
        unexpected = sorted(state.keys() - self.views.keys())
        shapes = [k for k, v in self.views.items() if k in state and tuple(state[k].shape) != tuple(v.shape)]
        if missing or unexpected or shapes:
            raise WeightSyncError(
                "update_weights: the state_dict does not fit the served policy "
                f"(missing keys {missing[:3]}, unexpected keys {unexpected[:3]}, other shapes {shapes[:3]})"
            )

    def write(self, state: Mapping[str, Any]) -> None:
        import torch

        with torch.no_grad():
            for key, view in self.views.items():
                view.copy_(state[key])

    def release(self) -> None:
        """Drop this side's views and buffers: the shared memory goes once neither side maps it."""
        self.views, self.buffers = {}, {}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _wait_ready(conn: Any, process: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not conn.poll(0.1):
        if not process.is_alive():
            raise EngineError(f"the engine process (pid {process.pid}) died as it started: {_exit(process)}")
        if time.monotonic() > deadline:
            raise EngineError(f"the engine process (pid {process.pid}) did not start within {timeout} s")
    try:
        message = conn.recv()
    except EOFError:
        process.join(1.0)
        raise EngineError(f"the engine process (pid {process.pid}) died as it started: {_exit(process)}") from None
    if message[0] != "ready":
        raise EngineError(f"the engine process said {message!r} instead of being ready")


def _exit(process: Any) -> str:
    code = process.exitcode
    if code is None:
        return "it is still running but closed its pipe"
    if code < 0:
        import signal

        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"

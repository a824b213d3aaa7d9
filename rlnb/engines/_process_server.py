"""The child side of :class:`~rlnb.engines.ProcessEngine`: a ``TinyEngine`` serving
requests that come down a pipe, in a process of its own.

The parent sends tuples; this process answers on the same pipe:

* ``("generate", [(key, request), ...])``: the requests of one dispatch; each
  result (or its error) comes back as ``("results", [(key, outcome), ...], stats)``,
  those that end in one turn of this process's loop together;
* ``("cancel", [key, ...])``: the parent stopped waiting for these;
* ``("abort", [request_id, ...])``, ``("pause", ticket, mode)``, ``("resume", ticket)``
  and ``("update", ticket, version)``: answered with ``("done", ticket, outcome,
  stats)``; an ``"abort"`` pause answers once the partial rollouts it returned have
  been sent; an update loads the weights the parent wrote into the shared
  ``mailbox`` (``_process.Mailbox``) before it sent the message, and the parent
  writes nothing there until the answer;
* ``("close",)``, or the pipe closing: stop the engine and exit.

SIGINT is ignored: a notebook's interrupt goes to the kernel's process group, and
the engine is closed by its owner, not by a Ctrl-C meant for a cell.
"""

from __future__ import annotations

import asyncio
import gc
import os
import pickle
import signal
import threading
from typing import Any

from rlnb._errors import InvalidValueError
from rlnb.runtime import block_on

__all__ = ["PROCESS_NAME", "serve"]

PROCESS_NAME = "rlnb::engine"


def serve(conn: Any, served: bytes, mailbox: Any, options: dict[str, Any]) -> None:
    """The child process's main: build the engine over the pickled policy ``served``
    and serve the pipe until told to close or the parent goes away; weight updates
    come through ``mailbox`` (a :class:`~rlnb.engines._process.Mailbox`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:  # what ps, top and psutil call this process (Linux)
        with open("/proc/self/comm", "w") as comm:
            comm.write(PROCESS_NAME)
    except OSError:
        pass
    import pickle

    import torch

    from rlnb.engines._tiny import TinyEngine

    torch.set_num_threads(options["config"].threads)
    policy = pickle.loads(served)
    engine = TinyEngine(
        policy, options["config"], eos_id=options["eos_id"], continuous=options["continuous"], name=options["name"]
    )
    # As vLLM's engine core does: what start-up made lives as long as the process, so
    # full garbage collections skip it (one of this heap took ~150 ms, and a pause or a
    # weight sync would wait for it).
    gc.collect()
    gc.freeze()
    try:
        conn.send(("ready", os.getpid()))
        del policy  # the engine serves a copy of its own
        block_on(_Server(conn, engine, mailbox).run())
    finally:
        engine.close()
        conn.close()
        mailbox.release()


class _Server:
    def __init__(self, conn: Any, engine: Any, mailbox: Any) -> None:
        self.conn, self.engine, self.mailbox = conn, engine, mailbox
        self.tasks: dict[int, asyncio.Task[Any]] = {}
        self.outbox: list[tuple[int, Any]] = []
        self.controls: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()

        def read() -> None:  # blocking reads on a thread of their own; the loop handles each
            while True:
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):  # the parent closed its end or died
                    message = ("close",)
                loop.call_soon_threadsafe(inbox.put_nowait, message)
                if message[0] == "close":
                    return

        reader = threading.Thread(target=read, name="rlnb-engine-server-reader", daemon=True)
        reader.start()
        while True:
            message = await inbox.get()
            kind = message[0]
            if kind == "close":
                break
            if kind == "generate":
                for key, request in message[1]:
                    task = asyncio.ensure_future(self.engine.generate(request))
                    self.tasks[key] = task
                    task.add_done_callback(lambda t, key=key: self._ended(key, t))
            elif kind == "cancel":
                for key in message[1]:
                    task = self.tasks.pop(key, None)
                    if task is not None:
                        task.cancel()
            elif kind == "abort":
                await self.engine.abort(message[1])
            else:  # a control with a ticket: run beside the requests, answered when done
                control = asyncio.ensure_future(self._control(*message))
                self.controls.add(control)
                control.add_done_callback(self.controls.discard)
        for task in [*self.tasks.values(), *self.controls]:
            task.cancel()

    def _ended(self, key: int, task: asyncio.Task[Any]) -> None:
        if task.cancelled() or self.tasks.pop(key, None) is not task:
            return
        self.outbox.append((key, _portable(task.exception()) or task.result()))
        if len(self.outbox) == 1:  # what ends in this turn of the loop goes together
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        if self.outbox:
            out, self.outbox = self.outbox, []
            self._send(("results", out, self._stats()))

    async def _control(self, kind: str, ticket: int, *args: Any) -> None:
        outcome: Any = None
        try:
            if kind == "pause":
                before = list(self.tasks.values())
                await self.engine.pause(args[0])
                if args[0] == "abort" and before:  # every request in flight came back: send them first
                    await asyncio.wait(before)
                    await asyncio.sleep(0)  # their done callbacks run, then the flush
                    self._flush()
            elif kind == "resume":
                await self.engine.resume()
            elif kind == "update":
                await self.engine.update_weights(self.mailbox.views, args[0])
                outcome = self.engine.statistics().version
            else:
                raise InvalidValueError(f"unknown control {kind!r}")
        except Exception as exc:
            outcome = _portable(exc)
        self._send(("done", ticket, outcome, self._stats()))

    def _stats(self) -> dict[str, Any]:
        stats = self.engine.statistics()
        return {"decode_steps": stats.decode_steps, "mean_batch": stats.extra.get("mean_batch", 0.0)}

    def _send(self, message: tuple[Any, ...]) -> None:
        try:
            self.conn.send(message)
        except (OSError, ValueError):  # the parent is gone: the reader sees it and we close
            pass


def _portable(exc: BaseException | None) -> BaseException | None:
    """``exc``, or a RuntimeError with its text where it does not survive pickling."""
    if exc is None:
        return None
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc

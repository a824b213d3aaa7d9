"""The stall explainer: when no step completes for too long, say where the session waits.

A step that runs longer than ``Config.stall_after`` seconds (None: ``max(30, 10 x the
median step time)``) is a stall. :class:`StallWatch` looks at what the step waits for
and at every part it could be waiting on, in the order a user can act on them: the
learner's update, a blocked event loop, a pause, a weight sync, a reward call that
does not return, an engine that produces no tokens, and background rollouts that are
stopped, halted or held by a full buffer. It runs once a second on the session's event loop while the
session is open (a loop callback: no thread of its own), prints one line per stall
to stdout, and ``Session.statistics().stall`` holds the explanation meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import statistics
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from rlnb._reprs import short_repr

if TYPE_CHECKING:
    from rlnb.buffer import ReplayBuffer
    from rlnb.config import Config
    from rlnb.engines import Engine
    from rlnb.learn import Trainer
    from rlnb.rollout import Rollouter

__all__ = ["Stacks", "Stall", "StallWatch", "stacks", "stall_limit"]

MIN_STALL_S = 30.0  # a stall is at least this long, with the default rule
STALL_STEPS = 10  # and at least this many median steps
# A reward call running longer than this (or than the stall limit, if shorter) is named
# as the cause; an engine with requests in flight and no new token for as long is stuck.
SLOW_REWARD_S = 5.0
NO_TOKENS_S = 5.0
LOOP_BLOCKED_S = 3.0  # a watch that has not run for this long means the loop is blocked
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STDLIB = sysconfig.get_paths()["stdlib"]


@dataclasses.dataclass(frozen=True)
class Stall:
    """No step has completed for ``seconds`` (more than ``limit``): where the session
    waits (``where``: "learner", "loop", "paused", "sync", "reward", "engine",
    "rollouts" or "unknown"), what was seen (``what``, with the numbers) and what to do (``fix``)."""

    seconds: float
    limit: float
    where: str
    what: str
    fix: str

    def __str__(self) -> str:
        head = f"rlnb: no step has completed for {self.seconds:.0f} s (a stall after {self.limit:.0f} s)"
        return f"{head}: {self.what}; {self.fix}"


def stall_limit(stall_after: float | None, step_seconds: Iterable[float]) -> float:
    """``stall_after`` if set, else ``max(30, 10 x the median of step_seconds)`` (30
    before any step has completed)."""
    if stall_after is not None:
        return float(stall_after)
    times = list(step_seconds)
    return max(MIN_STALL_S, STALL_STEPS * statistics.median(times)) if times else MIN_STALL_S


class StallWatch:
    """Watches one session's steps and parts for a stall (see the module docstring)."""

    def __init__(
        self,
        *,
        name: str,
        trainer: Trainer,
        rollouter: Rollouter,
        buffer: ReplayBuffer,
        engine: Engine,
        config: Callable[[], Config],
        loop_where: Callable[[], str] = lambda: "",
        say: Callable[[str], None] = lambda line: print(line, flush=True),
    ) -> None:
        self._name = name
        self._trainer, self._rollouter, self._buffer, self._engine = trainer, rollouter, buffer, engine
        self._config = config
        self._say = say
        self._loop_where = loop_where
        self._last_tick: float | None = None  # when the watch last ran on the loop
        self._tokens: tuple[int, float] | None = None  # (generated tokens, when that count was first seen)
        self._announced: str | None = None  # the cause of this stall that was printed
        self._task: asyncio.Task[None] | None = None

    # -- the rule --------------------------------------------------------------------

    def limit(self) -> float:
        """Seconds without a completed step that make a stall (:func:`stall_limit`)."""
        return stall_limit(self._config().stall_after, self._trainer.step_seconds)

    def stall(self) -> Stall | None:
        """The stall now, explained; None while steps complete in time (or none runs)."""
        running = self._trainer.step_running_for
        self._note_tokens()
        if running is None or running <= (limit := self.limit()):
            return None
        where, what, fix = self.explain()
        return Stall(running, limit, where, what, fix)

    # -- the causes ------------------------------------------------------------------

    def explain(self) -> tuple[str, str, str]:
        """Where the step in progress waits, what was seen and what to do."""
        phase = self._trainer.phase
        rollouts = self._rollouter.statistics()
        stacks = f"sess.stacks() shows where each thread of {self._name!r} is"
        if self._last_tick is not None and (blocked := time.monotonic() - self._last_tick) > LOOP_BLOCKED_S:
            return (
                "loop",
                f"the session's event loop has not run for {blocked:.0f} s: {self._loop_where()}",
                "something blocks it: a slow make_prompt with DataConfig.num_workers=0 runs there "
                "(use loader workers), or an engine call that does not return",
            )
        if phase is not None and phase[0] == "updating":
            return (
                "learner",
                f"the learner's update has run {phase[1]:.0f} s",
                f"a very large batch or a stuck device; {stacks}",
            )
        if rollouts.state in ("paused", "pausing"):
            return (
                "paused",
                f"rollouts are {rollouts.state} and the step waits for them "
                f"({rollouts.kept_partial} partial rollouts kept)",
                "call sess.rollouts.resume()",
            )
        if rollouts.state == "syncing":
            what = "a weight sync to the engine is in progress and has not ended"
            return "sync", what, f"the engine may be stuck; {stacks}"
        limit = self.limit()
        engine = self._engine.statistics()
        in_flight = engine.running + engine.waiting
        calls = self._rollouter.reward_calls()
        if calls and (not in_flight or calls[0].seconds >= min(SLOW_REWARD_S, limit)):
            return self._reward_cause(calls)  # nothing generates meanwhile, or a call runs long
        quiet = self._seconds_without_tokens()
        if in_flight and quiet is not None and quiet >= min(NO_TOKENS_S, limit):
            return (
                "engine",
                f"the engine has {in_flight} requests in flight and has produced no token for {quiet:.0f} s",
                f"it is stuck or dead (died: {engine.extra.get('died')}); {stacks}; "
                "close the session and make a new one",
            )
        if self._config().mode == "async" and phase is not None and phase[0] == "waiting for a batch":
            return "rollouts", f"the step waits for a batch: {self._rollouter.why_no_groups()}", stacks
        return (
            "unknown",
            f"the step has been {phase[0] if phase else 'running'} for {phase[1] if phase else 0:.0f} s; "
            f"{rollouts.in_flight} samples in flight, {engine.running} engine requests running",
            stacks,
        )

    def _reward_cause(self, calls: list[Any]) -> tuple[str, str, str]:
        oldest = calls[0]
        function = _user_function(oldest.ident) or "the reward function"
        item = oldest.args[1] if len(oldest.args) > 1 else None
        prompt = ""
        if item is not None:
            prompt = f" on prompt {getattr(item, 'prompt_id', '?')} ({short_repr(getattr(item, 'prompt', ''))})"
        more = f"; {len(calls) - 1} more reward calls are running" if len(calls) > 1 else ""
        timeout = self._config().rollout.reward_timeout
        limit = "no limit" if timeout is None else f"{timeout:g} s"
        return (
            "reward",
            f"{function} has run {oldest.seconds:.0f} s on thread {oldest.thread}{prompt}{more}",
            f"fix or speed it up; RolloutConfig.reward_timeout (now {limit}) fails a call that runs longer",
        )

    def _note_tokens(self) -> None:
        tokens, now = self._engine.statistics().generated_tokens, time.monotonic()
        if self._tokens is None or self._tokens[0] != tokens:
            self._tokens = (tokens, now)

    def _seconds_without_tokens(self) -> float | None:
        return None if self._tokens is None else time.monotonic() - self._tokens[1]

    # -- once a second on the loop ------------------------------------------------------

    def tick(self) -> Stall | None:
        """Look now; print one line when a stall starts (and once more if it was first
        explained as "unknown" and its cause shows later)."""
        found = self.stall()
        if found is None:
            self._announced = None
        elif self._announced != found.where and self._announced in (None, "unknown"):
            self._announced = found.where  # once per stall, and once more if its cause shows later
            self._say(str(found))
        return found

    @property
    def running(self) -> bool:
        """Whether the once-a-second watch runs."""
        return self._task is not None and not self._task.done()

    def ensure_running(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the once-a-second watch on ``loop`` (the session's bridge loop, which
        cancels it when it closes); call it on that loop. Idempotent."""
        if self._task is None or self._task.done():
            # The token count is seen now, before the step this call precedes begins: an
            # engine quiet from the start of the first step is then named as soon as the
            # step stalls, not "unknown" until the watch has seen the count for the limit.
            self._note_tokens()
            self._task = loop.create_task(self._watch(), name=f"rlnb-{self._name}-stall-watch")

    async def _watch(self) -> None:
        while True:
            self._last_tick = time.monotonic()
            await asyncio.sleep(1.0)
            self._last_tick = time.monotonic()
            try:
                self.tick()
            except Exception:  # a part closed under it: the watch is advice, never a failure
                continue


def _user_function(ident: int | None) -> str | None:
    """The user's function running on thread ``ident``, as "name (file:line)": the
    outermost frame that is neither rlnb's nor the standard library's."""
    frame = None if ident is None else sys._current_frames().get(ident)
    if frame is None:
        return None
    for summary in traceback.extract_stack(frame):
        path = os.path.abspath(summary.filename)
        if path.startswith(_PACKAGE) or path.startswith(_STDLIB) or summary.filename.startswith("<frozen"):
            continue
        where = "a notebook cell" if "ipykernel" in summary.filename else os.path.basename(summary.filename)
        return f"the reward function {summary.name!r} ({where}, line {summary.lineno})"
    return None


class Stacks(str):
    """Where each thread of a session is, and each task of its event loop: text that
    shows as text in a notebook (``Session.stacks()``)."""

    def __repr__(self) -> str:
        return str(self)


def stacks(name: str, loop: asyncio.AbstractEventLoop | None, reward_threads: set[str], *, depth: int = 12) -> Stacks:
    """The stacks of the threads of session ``name`` (its loop thread ``rlnb-<name>``,
    ``rlnb-<name>-*`` threads, ``reward_threads`` and the main thread, which runs a
    cell's blocking call) and of the tasks on ``loop``, the innermost ``depth`` frames
    of each."""
    frames = sys._current_frames()
    out = [f"session {name!r}: threads"]
    for thread in threading.enumerate():
        ours = thread.name == f"rlnb-{name}" or thread.name.startswith(f"rlnb-{name}-")
        if not (ours or thread.name in reward_threads or thread is threading.main_thread()):
            continue
        frame = frames.get(thread.ident or -1)
        out.append(f"\n--- thread {thread.name}")
        out += [line.rstrip() for line in traceback.format_stack(frame)[-depth:]] if frame else ["  (no frame)"]
    if loop is not None and not loop.is_closed():
        tasks = sorted(asyncio.all_tasks(loop), key=lambda t: t.get_name())
        out.append(f"\nsession {name!r}: {len(tasks)} tasks on its event loop")
        for task in tasks:
            out.append(f"\n--- task {task.get_name()}")
            for frame in task.get_stack(limit=depth):
                out.append(f'  File "{frame.f_code.co_filename}", line {frame.f_lineno}, in {frame.f_code.co_name}')
    return Stacks("\n".join(out))

"""The ``Trainer``: the step loop, and the transaction around update and weight sync.

It drives parts it is given (a learner, a rollouter, a buffer, the bridge their
coroutines run on and a tracker) and owns none of them but its background thread:
the session builds and closes them. Training happens here, from a cell (``step``,
``train``) or on the trainer's own thread (``start``/``stop``/``wait``).

A step has two phases. Before the update, nothing has changed: an exception, a
Ctrl-C or a background ``stop()`` there keeps the batch (in sync mode its prompts
go first next time, rolled out again with the same seeds; in async mode it goes
back to the buffer). From the update on, the optimizer step and the weight sync
are all-or-nothing: a Ctrl-C is held back and raised once both are done.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from rlnb._checks import is_int
from rlnb._errors import (
    EngineError,
    InvalidValueError,
    StateError,
    TrainingInterrupted,
    WaitTimeoutError,
    WeightSyncError,
)
from rlnb._samples import Group
from rlnb.algorithms import has_signal
from rlnb.buffer import ReplayBuffer
from rlnb.config import Change, Config
from rlnb.data import Task
from rlnb.learn._background import BackgroundRun
from rlnb.learn._foreground import Foreground, ForegroundCall, wait_with_progress
from rlnb.learn._learner import Learner
from rlnb.learn._progress import progress_bar
from rlnb.learn._warmup import Warmup
from rlnb.learn._whatif import KeptBatch
from rlnb.rewards import per_function
from rlnb.rollout import Rollouter, RolloutState
from rlnb.runtime import AsyncBridge, Deferred, defer_interrupts

__all__ = ["Callback", "Trainer", "TrainingStatistics"]


class _Tracker(Protocol):
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...


class Callback:
    """Hooks into every training step; override the ones you need (each does nothing).

    They run on the thread that runs the step (the trainer's own in the
    background), inside its phases: ``on_batch`` before the update, ``on_step_end``
    inside the all-or-nothing part, after the update and the weight sync. An
    exception raised in ``on_batch`` ends the step with nothing trained and the
    batch kept; one raised in ``on_step_end`` reaches the caller after the step is
    complete.
    """

    def on_batch(self, groups: Sequence[Group]) -> None:
        """The step has its batch (rolled out, or taken from the buffer) and has not updated."""

    def on_step_end(self, metrics: Mapping[str, float]) -> None:
        """The step is complete: updated, synced to the engine and logged."""


@dataclasses.dataclass(frozen=True)
class TrainingStatistics:
    """A snapshot of training: ``running`` in the background or not, the policy
    version (``step``), the steps/s of the foreground ``train`` in progress or else of
    the current or last background run, the last step's metrics, what a step is
    waiting for (None when it is not), a background failure not yet raised, the
    blocking call running in the foreground (``train``, ``step``, ``warmup``,
    ``evaluate``, ``save`` or ``wait``; None when none is) and the last one that
    ended (its ``ended`` says when; None before any)."""

    running: bool
    step: int
    steps_per_s: float | None
    last_metrics: Mapping[str, float]
    waiting: str | None
    error: str | None
    foreground: ForegroundCall | None = None
    last_foreground: ForegroundCall | None = None


class Trainer:
    """Runs training steps on the parts it is given; see the module docstring.

    ``config`` supplies the mode, the batch size (``rollout.groups_per_step``), the
    async step timeout and the warm-up settings; ``task`` the warm-up and held-out
    prompts. ``callbacks`` is a list you may change between steps. ``history``
    holds every completed step's metrics, interrupted calls' included. One
    foreground call at a time; while a background run goes, the calls that train
    raise an error that says to ``stop()`` it.
    """

    def __init__(
        self,
        *,
        learner: Learner,
        rollouter: Rollouter,
        buffer: ReplayBuffer,
        bridge: AsyncBridge,
        tracker: _Tracker,
        task: Task,
        config: Config,
        name: str = "rlnb",
        callbacks: Sequence[Callback] = (),
    ) -> None:
        self.learner = learner
        self.rollouter = rollouter
        self.buffer = buffer
        self.bridge = bridge
        self.tracker = tracker
        self.task = task
        self.config = config
        self.name = name
        self.callbacks: list[Callback] = list(callbacks)
        self.history: list[dict[str, float]] = []
        self.evaluations: list[tuple[int, float]] = []  # (policy version, held-out accuracy)
        self.changes: list[Change] = []  # live settings changed (Session.set), oldest first
        self.batches: collections.deque[KeptBatch] = collections.deque(maxlen=config.learn.keep_batches)
        # Held while the learner updates: a twin taken under it (what_if) never sees half a step.
        self.update_lock = threading.Lock()
        self.warmup_stage = Warmup(learner, task, config)
        self._phase: str | None = None  # what the current step waits for
        self._phase_since = time.monotonic()  # when it began to
        self._step_began: float | None = None  # when the step in progress began (None: none is)
        self.step_seconds: collections.deque[float] = collections.deque(maxlen=50)  # the last steps' durations
        self._unpublished: dict[str, float] | None = None  # a trained step whose weights did not reach the engine
        self._pending_lock = threading.Lock()  # a failed step is published once, by one thread
        self._run: BackgroundRun | None = None
        self.foreground = Foreground()  # the blocking call a cell (or a button) is making

    @property
    def version(self) -> int:
        """The learner's policy version: the number of RL steps taken."""
        return int(self.learner.version)

    # -- one step -----------------------------------------------------------------------

    def step(self, *, timeout: float | None = None) -> dict[str, float]:
        """One training step in the config's mode; returns its metrics. Blocks.

        ``timeout`` bounds the sync rollout, or the async wait for a batch
        (``Config.step_timeout`` when None). Ctrl-C raises
        :class:`~rlnb.TrainingInterrupted`, which says what was kept."""
        self.check_idle("step()")
        with self.foreground.call("step()"), self._explained_interrupts("step()"):
            return self._step(timeout, None)

    def _step(self, timeout: float | None, cancel: threading.Event | None) -> dict[str, float]:
        self.publish_pending()
        self._step_began = time.monotonic()
        try:
            if self.config.mode == "sync":
                return self._sync_step(timeout, cancel)
            return self._async_step(self.config.step_timeout if timeout is None else timeout, cancel)
        finally:
            self._phase, self._step_began = None, None

    def _set_phase(self, phase: str) -> None:
        self._phase, self._phase_since = phase, time.monotonic()

    @property
    def phase(self) -> tuple[str, float] | None:
        """What the step in progress waits for now ("rolling out", "waiting for a batch",
        "updating") and for how many seconds it has; None when no step runs."""
        phase, since = self._phase, self._phase_since
        return None if phase is None else (phase, time.monotonic() - since)

    @property
    def step_running_for(self) -> float | None:
        """Seconds since the step in progress began; None when no step runs."""
        began = self._step_began
        return None if began is None else time.monotonic() - began

    def _sync_step(self, timeout: float | None, cancel: threading.Event | None) -> dict[str, float]:
        rollouter, before = self.rollouter, self.learner.version
        groups: list[Group] = []
        self._set_phase("rolling out")  # statistics() says "paused" while rollouts are
        try:
            # The background waits out a pause (a stop cancels the wait); a cell gives up
            # on one after step_timeout, saying so (it cannot be resumed from a busy kernel).
            background = cancel is not None
            collect = rollouter.collect(
                self.config.rollout.groups_per_step,
                into=groups,
                wait=background,
                paused_timeout=None if background else self.config.step_timeout,
                call="step()",
            )
            self.bridge.run(collect, timeout=timeout, cancel=cancel)
            for _ in range(MAX_SAMPLING_ROUNDS if self._dynamic_sampling() else 0):
                missing = self.config.rollout.groups_per_step - _with_signal(groups)
                if missing <= 0:
                    break
                more: list[Group] = []
                self.bridge.run(
                    rollouter.collect(
                        missing,
                        into=more,
                        wait=background,
                        paused_timeout=None if background else self.config.step_timeout,
                        call="step()",
                    ),
                    timeout=timeout,
                    cancel=cancel,
                )
                groups += more
            self._call("on_batch", groups)
            with defer_interrupts():
                return self._update(groups)
        except BaseException:
            # The rollout finished but was not trained on (Ctrl-C landed just as it
            # returned, or the update failed): its prompts go first next time.
            if groups and self.learner.version == before:
                self.bridge.run(rollouter.give_back_collected())
            raise

    def _async_step(self, timeout: float | None, cancel: threading.Event | None) -> dict[str, float]:
        before = self.learner.version
        self.bridge.run(self.rollouter.start())
        with defer_interrupts() as deferred:
            groups = self._take_batch(deferred, timeout, cancel)
            for _ in range(MAX_SAMPLING_ROUNDS if self._dynamic_sampling() else 0):
                missing = self.config.rollout.groups_per_step - _with_signal(groups)
                if missing <= 0:
                    break
                # The groups just taken gave their places back without waking dispatch,
                # which may be waiting on a full lag budget: wake it, or nothing comes.
                self.bridge.run(self.rollouter.start())
                groups += self._take_batch(deferred, timeout, cancel, n=missing)
            self.rollouter.updating_on(len(groups))  # what dispatches now is for the next update
            try:
                self._call("on_batch", groups)
                return self._update(groups)
            except Exception:
                if self.learner.version == before:  # not trained: not lost either
                    self.buffer.put_back(groups)
                    self.rollouter.updating_on(0)
                raise

    def _dynamic_sampling(self) -> bool:
        return bool(self.learner.config.resolved_algorithm.dynamic_sampling)

    def _take_batch(
        self, deferred: Deferred, timeout: float | None, cancel: threading.Event | None, *, n: int | None = None
    ) -> list[Group]:
        """The async step's batch (``n`` groups; None: ``groups_per_step``), waited for
        with SIGINT held back: a Ctrl-C (or a background stop) while waiting raises at
        once with nothing taken; once taken, the step completes. The background waits
        without a deadline."""
        n = self.config.rollout.groups_per_step if n is None else n
        rollouter = self.rollouter
        deadline = None if cancel is not None or timeout is None else time.monotonic() + timeout
        self._set_phase("waiting for a batch")
        while True:
            if deferred.interrupted:
                raise KeyboardInterrupt("interrupted while waiting for a batch; nothing was taken")
            if cancel is not None and cancel.is_set():
                raise _cancelled()
            rollouter.raise_pending()
            remaining = 0.05 if deadline is None else deadline - time.monotonic()
            try:
                return self.buffer.get(n, timeout=max(0.0, min(0.05, remaining)))
            except TimeoutError as exc:
                if remaining <= 0.05 and deadline is not None:
                    raise self._batch_timeout(n, timeout) from exc

    def _batch_timeout(self, n: int, timeout: float | None) -> TimeoutError:
        return TimeoutError(
            f"step() waited {timeout} s for {n} groups and the buffer holds {self.buffer.size()}: "
            f"{self.rollouter.why_no_groups()} (Config.step_timeout sets the wait)"
        )

    def _update(self, groups: list[Group]) -> dict[str, float]:
        """Update on ``groups``, then publish the step (callers defer SIGINT)."""
        self._set_phase("updating")
        with self.update_lock:
            config = self.learner.config
            metrics = self.learner.step(groups, max_length=self.rollouter.sampling.max_new_tokens)
            # the advantages the update used (an advantage function is called once a step, by the learner)
            advantages = self.learner.last_advantages
        metrics.update(per_function(s for g in groups for s in g.samples))  # a task with several rewards
        if self.batches.maxlen:
            self.batches.append(KeptBatch.of(groups, metrics, config, advantages))
        self._publish(metrics)
        return metrics

    def publish_pending(self) -> None:
        """Publish a trained step whose weight sync failed (see ``_publish``). A step
        being published on another thread is its own: only a failed one is pending."""
        with self._pending_lock:
            metrics, self._unpublished = self._unpublished, None
        if metrics is not None:
            self._publish(metrics)

    def _publish(self, metrics: dict[str, float]) -> None:
        """Send the trained step's weights and version out (:meth:`sync_weights`), then
        record the step: history, tracker, ``on_step_end``. Update and sync are all-or-nothing
        for what anyone sees: if the sync fails, the step stays trained but unpublished,
        rollouts stay paused (on the old weights), and the next step, train or resume
        sends the weights again before anything else."""
        try:
            self.sync_weights()
        except BaseException as exc:
            with self._pending_lock:
                self._unpublished = metrics
            if not isinstance(exc, WeightSyncError) or isinstance(exc.__cause__, EngineError):
                raise  # no retry can help: it says to make a new session
            raise WeightSyncError(
                f"step {self.learner.version} was trained, but its weights did not reach the engine, so "
                "rollouts are paused on the old ones; the next step(), train() or resume() sends them again "
                "(the step is recorded once they arrive)"
            ) from exc
        self.history.append(metrics)
        if (began := self._step_began) is not None:
            self.step_seconds.append(time.monotonic() - began)
        self.tracker.log(metrics, step=self.learner.version)
        self._call("on_step_end", metrics)

    def sync_weights(self) -> None:
        """Publish the learner's weights and version in one all-or-nothing call: the
        engine, the rollouter and the buffer get them (``Rollouter.publish``)."""
        self.bridge.run(self.rollouter.publish(self.learner.export_weights(), self.learner.version))

    def _call(self, hook: str, arg: Any) -> None:
        for callback in list(self.callbacks):
            getattr(callback, hook)(arg)

    # -- in a cell ----------------------------------------------------------------------------

    def train(
        self, n_steps: int | None = None, *, until: int | None = None, progress: bool = True
    ) -> list[dict[str, float]]:
        """``n_steps`` more steps, or steps until the policy version is ``until``, with
        a progress bar; returns each step's metrics (all of them are in ``history``).
        Ctrl-C raises :class:`~rlnb.TrainingInterrupted`, which says how to go on."""
        self.check_idle("train()")
        target = _target(n_steps, until, self.version)
        call = f"train(until={target})"
        history: list[dict[str, float]] = []
        with (
            self.foreground.call(call, first=self.version, last=target),
            progress_bar(target - self.version, f"rlnb {self.name}", progress) as bar,
        ):
            with self._explained_interrupts(call, bar=bar, counted=lambda: len(history)):
                while self.version < target:
                    metrics = self._step(None, None)
                    history.append(metrics)
                    bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", acc=f"{metrics['accuracy']:.2f}")
                    bar.update(1)
        return history

    @contextlib.contextmanager
    def _explained_interrupts(
        self, call: str, *, bar: Any = None, counted: Callable[[], int] = lambda: 0
    ) -> Iterator[None]:
        """Turn Ctrl-C into a one-line :class:`TrainingInterrupted` that says whether
        the step in progress completed, and how to go on. ``counted()``: the steps
        the caller has already accounted for (and shown on ``bar``)."""
        before = self.version
        try:
            yield
        except KeyboardInterrupt:
            completed = self.version - before > counted()  # the update ran; the interrupt waited for it
            if completed and bar is not None:
                bar.update(1)
            done = (
                "the step in progress was completed (updated and synced)"
                if completed
                else "nothing of the step in progress was trained (its batch is kept)"
            )
            raise TrainingInterrupted(
                f"rlnb stopped at step {self.version}: {done}; call {call} again to go on"
            ) from None

    def warmup(self, n_steps: int | None = None, *, progress: bool = True) -> list[dict[str, float]]:
        """Supervised warm-up (see ``Session.warmup``); the weights go to the engine after."""
        self.check_idle("warmup()")
        with self.foreground.call("warmup()" if n_steps is None else f"warmup({n_steps})"):
            return self.warmup_stage.run(
                n_steps,
                sync=self.sync_weights,
                log=lambda metrics: self.tracker.log(metrics, step=self.learner.version),
                progress=progress,
                name=self.name,
            )

    def evaluate(self, n_prompts: int = 200, *, seed: int = 12345) -> float:
        """Greedy exact-match accuracy on ``n_prompts`` held-out prompts of the task. Blocks.

        Every prompt goes to the engine at once, so they share its batches like any
        rollouts; the record logged has ``eval_accuracy`` and what it cost, ``eval_seconds``."""
        if not is_int(n_prompts) or n_prompts < 1:
            raise InvalidValueError(f"evaluate(n_prompts={n_prompts!r}) is invalid: use an int >= 1")
        self.check_idle("evaluate()")
        with self.foreground.call("evaluate()"):
            return self._evaluate(n_prompts, seed)

    def _evaluate(self, n_prompts: int, seed: int) -> float:
        started = time.perf_counter()
        items = self.task.eval_set(n_prompts, seed=seed)
        max_new = self.config.rollout.max_new_tokens or self.task.max_new_tokens
        evaluate = self.rollouter.evaluate(items, max_new_tokens=max_new, paused_timeout=self.config.step_timeout)
        results = self.bridge.run(evaluate)
        accuracy = sum(reward >= 1.0 for _, reward in results) / len(results)
        self.evaluations.append((self.version, accuracy))
        seconds = round(time.perf_counter() - started, 4)
        self.tracker.log({"eval_accuracy": accuracy, "eval_seconds": seconds}, step=self.learner.version)
        return accuracy

    @contextlib.contextmanager
    def quiesced(self, call: str = "save()") -> Iterator[None]:
        """:meth:`_quiesced`, marked as the foreground ``call`` (``save()``, ``fork()``)."""
        with self.foreground.call(call), self._quiesced(call):
            yield

    @contextlib.contextmanager
    def _quiesced(self, call: str) -> Iterator[None]:
        """Nothing generating inside (``Rollouter.quiesce``): dispatch stopped and
        in-flight groups finished into the buffer; afterwards rollouts are as they were."""
        self.check_idle(call)
        quiescence = self.rollouter.quiesce(timeout=self.config.step_timeout)
        try:
            self.bridge.run(quiescence.enter())
            yield
        finally:
            # Also after a failed or cancelled enter(): a Ctrl-C ends the bridge call
            # before its own undo may have finished, and restore() waits for that.
            with defer_interrupts():
                self.bridge.run(quiescence.restore())

    # -- in the background ------------------------------------------------------------------

    @property
    def training(self) -> bool:
        """Whether a background run is going."""
        return self._run is not None and self._run.running

    def start(self, steps: int | None = None) -> None:
        """Train on the trainer's own thread until ``steps`` more steps are done (None:
        until :meth:`stop`); returns at once. Raises ``RuntimeError`` if a run is going."""
        if steps is not None and not (is_int(steps) and steps >= 1):
            raise InvalidValueError(f"start(steps={steps!r}): use a positive int, or None to train until stop()")
        self.check_idle("start()")
        self.raise_pending()
        self._run = BackgroundRun(lambda cancel: self._step(None, cancel), steps=steps, name=f"rlnb-{self.name}-train")
        self._run.start()

    def stop(self, timeout: float | None = None) -> None:
        """End the background run at a step boundary (a step that has started its update
        completes; one still waiting trains nothing) and wait for it. Idempotent.
        Raises ``TimeoutError`` if it has not ended after ``timeout`` s."""
        if self._run is not None and not self._run.stop(timeout) and not self._run.on_own_thread():
            raise WaitTimeoutError(f"the background run did not stop within {timeout} s; it stops after its step")

    def wait(self, timeout: float | None = None, *, progress: bool = True) -> None:
        """Block until the background run ends (its ``steps`` are done, or it was
        stopped), with a progress bar of its steps; raise its failure, if any.
        ``TimeoutError`` after ``timeout`` s."""
        run = self._run
        if run is not None and run.running:
            with self.foreground.call("wait()"):
                if not wait_with_progress(run, timeout, progress=progress, desc=f"rlnb {self.name} (background)"):
                    raise WaitTimeoutError(f"the background run is still training after {timeout} s")
        elif run is not None:
            run.wait_ended(timeout)  # ended: its thread is joined
        self.raise_pending()

    def raise_pending(self) -> None:
        """Raise a background failure not yet reported, once, as :class:`~rlnb.TrainingError`."""
        if self._run is not None:
            self._run.raise_error()

    def take_unreported(self) -> Exception | None:
        """The background failures no call has raised yet, of rollouts and of the
        background run, counted as raised now: one error, or an ExceptionGroup of both."""
        errors = [exc for check in (self.rollouter.raise_pending, self.raise_pending) if (exc := _raised(check))]
        if len(errors) > 1:
            return ExceptionGroup(f"session {self.name!r} had background failures no call raised", errors)
        return errors[0] if errors else None

    def close(self, timeout: float | None = None) -> None:
        """Stop a background run (waiting up to ``timeout`` s); idempotent."""
        if self._run is not None:
            self._run.stop(timeout)

    def check_idle(self, call: str) -> None:
        """Raise RuntimeError if ``call`` would train beside training already going
        on: a background run, or a blocking call made on another thread (two threads
        stepping one learner at once corrupt it)."""
        if self.training:
            raise StateError(
                f"{call} cannot run while training goes on in the background: call stop() first "
                "(or wait() for it to finish)"
            )
        other = self.foreground.current
        if other is not None and other.thread_id != threading.get_ident():
            raise StateError(
                f"{call} cannot run while {other.call} runs on another thread ({other.thread}): "
                "wait for it to return first"
            )

    def statistics(self) -> TrainingStatistics:
        """A frozen snapshot of training; does not block."""
        run, foreground, version = self._run, self.foreground.current, self.version
        busy = self.training or foreground is not None
        waiting = self._phase if busy and self._phase != "updating" else None
        if waiting is not None and self.rollouter.state is not RolloutState.RUNNING:
            waiting = "rollouts are paused: resume() them"
        rate = None if run is None else run.steps_per_s
        if foreground is not None and foreground.first is not None:
            rate = foreground.steps_per_s(version)
        return TrainingStatistics(
            running=self.training,
            step=version,
            steps_per_s=rate,
            last_metrics=dict(self.history[-1]) if self.history else {},
            waiting=waiting,
            error=None if run is None or run.error is None else repr(run.error),
            foreground=foreground,
            last_foreground=self.foreground.last,
        )


# Dynamic sampling (an Algorithm's ``dynamic_sampling``, DAPO's): groups whose rewards are
# all equal carry no signal, and the step rolls out (or takes) as many more as it lacks,
# at most this many times; then it trains on the groups with signal it has.
MAX_SAMPLING_ROUNDS = 8


def _with_signal(groups: list[Group]) -> int:
    return sum(has_signal([s.reward or 0.0 for s in g.samples]) for g in groups)


def _target(n_steps: int | None, until: int | None, version: int) -> int:
    if (n_steps is None) == (until is None):
        raise InvalidValueError(
            "train() takes n_steps (that many more steps) or until= (a policy version), one of them"
        )
    if n_steps is not None:
        if not (is_int(n_steps) and n_steps >= 1):
            raise InvalidValueError(f"train(n_steps={n_steps!r}): use a positive int")
        return version + n_steps
    if not (is_int(until) and until >= 0):
        raise InvalidValueError(f"train(until={until!r}): use a policy version, an int >= 0")
    return max(until, version)


def _cancelled() -> BaseException:
    return asyncio.CancelledError("stopped before the update; nothing was trained")


def _raised(call: Callable[[], object]) -> Exception | None:
    try:
        call()
    except Exception as exc:
        return exc
    return None

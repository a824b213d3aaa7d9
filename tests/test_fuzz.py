"""Ctrl-C fuzz: presses at random moments of ``step()``, ``train()``, ``rollout()``,
``pause()``, ``save()`` and ``close()``, each followed by the same call again.

A seeded RNG picks the call and a delay spread over that call's typical duration
(measured first, on calls nobody interrupts); a thread presses Ctrl-C then, if the
call is still running. After each press the call runs again, and the session must
still work, every count must add up (no batch lost or trained twice, every
dispatched sample in exactly one bucket) and no call may outlive its deadline: a
watchdog dumps every thread's stack and fails the test.

``RLNB_FUZZ_PRESSES`` (300 by default, half in sync and half in async mode, about
a minute on a busy 2-core machine) and ``RLNB_FUZZ_SEED`` change the run; ``pytest -s``
prints the figures. Past about 1,000 presses a mode outlives pytest's
``faulthandler_timeout``, which then dumps the stacks once (``-o faulthandler_timeout=0``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import faulthandler
import gc
import multiprocessing.connection
import multiprocessing.process
import multiprocessing.queues
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

import rlnb
import rlnb._files
from rlnb.probe import Snapshot, snapshot
from rlnb.rollout import RolloutStatistics
from rlnb.runtime import AsyncBridge
from tests.helpers import Recorder, assert_counts_add_up, press_ctrl_c, small_config, wait_until

PRESSES = int(os.environ.get("RLNB_FUZZ_PRESSES", "300"))
SEED = int(os.environ.get("RLNB_FUZZ_SEED", "0"))
DEADLINE = 60.0  # seconds any one call may take, pressed or not
LATE_WAIT = 2.0  # how long a press that landed as the call returned may take to arrive

CONFIG = small_config(
    learn=rlnb.LearnConfig(lr=1e-3),
    data=rlnb.DataConfig(),
    step_timeout=DEADLINE / 2,  # an async step that gets no batch says why before the watchdog fires
)
GPS = CONFIG.rollout.groups_per_step
KINDS = ("step", "train", "rollout", "pause", "save", "close")
WEIGHTS = (3, 3, 2, 2, 2, 1)  # close makes a new session each time: the costliest round
ROLLOUT_GROUPS = 2


# -- pressing Ctrl-C, and the watchdog ------------------------------------------------------


class CallHung(BaseException):
    """A call outlived its deadline (raised on the main thread by the watchdog, with
    every thread's stack); a BaseException so that no ``except Exception`` hides it."""


class _Alarm:
    """SIGUSR1 raises :class:`CallHung` on the main thread once a watchdog has fired."""

    def __init__(self) -> None:
        self.report: str | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.report is not None:
            report, self.report = self.report, None
            raise CallHung(report)


@contextlib.contextmanager
def hang_alarm() -> Iterator[_Alarm]:
    alarm = _Alarm()
    previous = signal.signal(signal.SIGUSR1, alarm)
    try:
        yield alarm
    finally:
        signal.signal(signal.SIGUSR1, previous)


@contextlib.contextmanager
def unraisable_exceptions() -> Iterator[list[tuple[type[BaseException], str]]]:
    """Collect what Python could not raise (an exception in a finalizer), for the fuzz
    to sort (:meth:`Fuzz.sort_unraisable`), instead of failing the test on the first."""
    seen: list[tuple[type[BaseException], str]] = []
    previous = sys.unraisablehook
    sys.unraisablehook = lambda u: seen.append((u.exc_type, repr(u.object)))
    try:
        yield seen
    finally:
        sys.unraisablehook = previous


@contextlib.contextmanager
def watchdog(alarm: _Alarm, what: str, deadline: float = DEADLINE) -> Iterator[None]:
    """Fail the block with every thread's stack if it runs past ``deadline`` s."""
    done = threading.Event()

    def watch() -> None:
        if done.wait(deadline):
            return
        with tempfile.TemporaryFile("w+") as f:
            faulthandler.dump_traceback(f, all_threads=True)
            f.seek(0)
            alarm.report = f"{what} did not return within {deadline} s; every thread's stack then:\n{f.read()}"
        while not done.wait(1.0):  # until the main thread leaves whatever it is stuck in
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGUSR1)

    thread = threading.Thread(target=watch, name="fuzz-watchdog")
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


class _Press:
    """Ctrl-C once, ``delay`` s after :meth:`go`, unless disarmed first (the call has returned)."""

    def __init__(self, delay: float) -> None:
        self.pressed = False
        self._armed = True
        self._lock = threading.Lock()
        self._go = threading.Event()
        self._disarmed = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(delay,), name="fuzz-press")
        self._thread.start()

    def go(self) -> None:
        self._go.set()

    def _run(self, delay: float) -> None:
        self._go.wait()
        if self._disarmed.wait(delay):
            return
        with self._lock:
            if self._armed:
                press_ctrl_c()
                self.pressed = True

    def disarm(self) -> None:
        """No press after this returns; a press that was on its way may raise here."""
        self._disarmed.set()
        self._go.set()
        with self._lock:
            self._armed = False
        self._thread.join()


@dataclasses.dataclass
class Outcome:
    """One call: what it returned or raised, and where the press landed."""

    what: str
    seconds: float = 0.0
    pressed: bool = False
    result: Any = None
    returned: bool = False
    interrupt: KeyboardInterrupt | None = None
    error: Exception | None = None
    late: bool = False  # the press landed just after the call had returned
    swallowed: bool = False  # pressed, yet no KeyboardInterrupt ever came


def _call_into(out: Outcome, fn: Callable[[], Any], press: _Press | None) -> None:
    start = time.perf_counter()
    try:
        if press is not None:
            press.go()
        out.result = fn()
        out.returned = True
    except KeyboardInterrupt as exc:
        out.interrupt = exc
    except Exception as exc:
        out.error = exc
    finally:
        out.seconds = time.perf_counter() - start


def call_pressed(out: Outcome, fn: Callable[[], Any], delay: float | None) -> None:
    """Call ``fn()`` with Ctrl-C pressed ``delay`` s in (None: never), and record in ``out``
    what it returned or raised and where the press landed. Returns once no press can
    come any more: a press that landed just as ``fn`` returned is waited for and caught."""
    press = None if delay is None else _Press(delay)
    try:
        _call_into(out, fn, press)
    except KeyboardInterrupt:  # it landed in the handler of another error
        out.late = True
    for _ in range(3):  # each retry after a press that landed in the one before
        try:
            if press is not None:
                press.disarm()
                if press.pressed and out.interrupt is None and not out.late:
                    _wait_for_late_press()
                    out.swallowed = True
            break
        except KeyboardInterrupt:
            out.late = True
    out.pressed = press is not None and press.pressed


def _wait_for_late_press() -> None:
    """Give a press that was sent as the call returned time to land (it raises here)."""
    deadline = time.monotonic() + LATE_WAIT
    while time.monotonic() < deadline:
        time.sleep(0.005)


def _nothing_new(baseline: Snapshot) -> bool:
    """Whether the process holds nothing ``baseline`` did not, once unreachable objects
    are gone (an interrupted call's frames hold what it had open, in a cycle with its error)."""
    if not snapshot().new_since(baseline):
        return True
    gc.collect()
    return not snapshot().new_since(baseline)


# -- the fuzz ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Figures:
    """Per kind of call: rounds with a press planned (``attempts``), presses that
    landed while the call ran, calls that raised KeyboardInterrupt, presses that
    landed just as the call returned, and ``step()``/``train()`` interrupts that were
    not :class:`~rlnb.TrainingInterrupted`. ``noted``: harmless things seen."""

    attempts: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    presses: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    interrupted: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    late: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    plain: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    noted: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    typical_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0

    def table(self, mode: str) -> str:
        lines = [f"Ctrl-C fuzz, {mode} mode: {sum(self.presses.values())} presses in {self.seconds:.1f} s"]
        lines.append("call      typical ms  attempts  presses  interrupted  landed-after-return  plain-KI")
        for kind in KINDS:
            lines.append(
                f"{kind:<9} {self.typical_ms.get(kind, 0.0):>10.1f}  {self.attempts[kind]:>8}  "
                f"{self.presses[kind]:>7}  {self.interrupted[kind]:>11}  {self.late[kind]:>19}  {self.plain[kind]:>8}"
            )
        lines += [f"seen {n} times: {name}" for name, n in self.noted.items()]
        return "\n".join(lines)


class Fuzz:
    """One session under fuzz, its ledger, and the rounds: a (pressed) call, the
    same call again, then every check."""

    def __init__(
        self, mode: str, tmp_path: Path, alarm: _Alarm, rng: random.Random, unraisable: list[tuple[type, str]]
    ) -> None:
        self.mode, self.config, self.alarm, self.rng = mode, CONFIG.replace(mode=mode), alarm, rng
        self.unraisable = unraisable
        self.name = f"fuzz-{mode}"
        self.ckpt = tmp_path / "ckpt"
        self.figures = Figures()
        self.saved_version: int | None = None
        self.baseline = snapshot()
        self._open()

    def _open(self) -> None:
        self.recorder = Recorder()
        self.rolled: list[int] = []  # prompt ids of groups rollout() returned
        self.lost_allowance = 0  # prompts an interrupted rollout() may have used up unseen
        self.stepped = False  # async: background rollouts start with the first step
        self.sess = self.call("Session()", lambda: rlnb.Session(self.config, name=self.name, callbacks=[self.recorder]))

    # -- calls ----------------------------------------------------------------------------

    def call(self, what: str, fn: Callable[[], Any]) -> Any:
        """An unpressed call, under the watchdog."""
        with watchdog(self.alarm, what):
            return fn()

    def pressed(self, kind: str, fn: Callable[[], Any], delay: float | None) -> Outcome:
        """``fn()`` with Ctrl-C pressed ``delay`` s in (None: not pressed), under the watchdog."""
        out = self.last
        with watchdog(self.alarm, out.what):
            call_pressed(out, fn, delay)
        if out.error is not None:
            raise AssertionError(f"{out.what} raised {out.error!r}") from out.error
        else:
            assert not out.swallowed, (
                f"{out.what}: Ctrl-C was pressed, and no KeyboardInterrupt ever came "
                f"(exceptions Python could not raise meanwhile: {self.unraisable})"
            )
        if delay is not None:
            f = self.figures
            f.attempts[kind] += 1
            f.presses[kind] += out.pressed
            f.interrupted[kind] += out.interrupt is not None
            f.late[kind] += out.late
            is_plain = out.interrupt is not None and not isinstance(out.interrupt, rlnb.TrainingInterrupted)
            f.plain[kind] += kind in ("step", "train") and is_plain
        return out

    def given_back(self) -> list[int]:
        """Prompts an interrupted rollout handed back: they go first next time."""
        return [p.prompt_id for p in self.sess._rollouter.returned_prompts]

    def expect_first(self, given: list[int], consumed: list[int], what: str) -> None:
        if self.mode == "sync" and given:  # async: the dispatcher may take them first
            k = min(len(given), len(consumed))
            assert consumed[:k] == given[:k], f"{what}: the prompts given back ({given}) go first; got {consumed}"

    def trained_since(self, n_batches: int) -> list[int]:
        return [pid for batch in self.recorder.batches[n_batches:] for pid in batch]

    # -- rounds -----------------------------------------------------------------------------

    def round(self, kind: str, delay: float | None) -> float:
        """One round; returns how long the first call took."""
        self.last = Outcome(f"{kind}() pressed {'never' if delay is None else f'{delay * 1e3:.2f} ms in'}")
        try:
            getattr(self, f"_round_{kind}")(delay)
            self.check()
            self.sort_unraisable(kind)
        except AssertionError as exc:
            exc.add_note(f"in the round of {self.last}")
            raise
        return self.last.seconds

    def _round_step(self, delay: float | None) -> None:
        before = self.sess.version
        out = self.pressed("step", self.sess.step, delay)
        mid, n = self.sess.version, len(self.recorder.batches)
        assert mid in (before, before + 1), out
        if isinstance(out.interrupt, rlnb.TrainingInterrupted):
            message = str(out.interrupt)
            assert "\n" not in message and "call step() again" in message, message
            assert ("was completed" in message) == (mid == before + 1), (message, before, mid)
        if out.returned:
            assert mid == before + 1
        given = self.given_back()
        self.call("step() again", self.sess.step)
        self.stepped = True
        assert self.sess.version == mid + 1
        self.expect_first(given, self.trained_since(n), "step() again")

    def _round_train(self, delay: float | None) -> None:
        before = self.sess.version
        target = before + 2
        out = self.pressed("train", lambda: self.sess.train(until=target, progress=False), delay)
        mid, n = self.sess.version, len(self.recorder.batches)
        assert before <= mid <= target, out
        if isinstance(out.interrupt, rlnb.TrainingInterrupted):
            message = str(out.interrupt)
            assert "\n" not in message and f"call train(until={target}) again" in message, message
            assert f"stopped at step {mid}:" in message, (message, mid)
        if out.returned:
            assert mid == target
        given = self.given_back()
        self.call("train() again", lambda: self.sess.train(until=target, progress=False))
        self.stepped = True
        assert self.sess.version == target
        self.expect_first(given, self.trained_since(n), "train() again")

    def _round_rollout(self, delay: float | None) -> None:
        out = self.pressed("rollout", lambda: self.sess.rollout(ROLLOUT_GROUPS), delay)
        if out.result is not None:
            self.rolled += [g.prompt_id for g in out.result]
        elif out.interrupt is not None:
            self.lost_allowance += ROLLOUT_GROUPS  # finished, then interrupted before it returned
        given = self.given_back()
        batch = self.call("rollout() again", lambda: self.sess.rollout(ROLLOUT_GROUPS))
        assert len(batch) == ROLLOUT_GROUPS
        assert all(len(g.samples) == self.config.rollout.group_size for g in batch)
        ids = [g.prompt_id for g in batch]
        self.rolled += ids
        self.expect_first(given, ids, "rollout() again")

    def _round_pause(self, delay: float | None) -> None:
        mode = self.rng.choice(("abort", "abort", "keep", "wait"))
        self.pressed("pause", lambda: self.sess.rollouts.pause(mode), delay)
        self.call(f"pause({mode!r}) again", lambda: self.sess.rollouts.pause(mode))
        if mode == "wait":
            self.call("wait_paused()", lambda: self.sess.rollouts.wait_paused(timeout=DEADLINE / 2))
        stats = self.sess.statistics()
        assert stats.rollout.state == "paused", stats.rollout
        assert_counts_add_up(stats.rollout)
        self.call("resume()", self.sess.rollouts.resume)

    def _round_save(self, delay: float | None) -> None:
        before = self.sess.statistics().rollout
        out = self.pressed("save", lambda: self.sess.save(self.ckpt), delay)
        self._check_after_save(before, out)
        if self.saved_version is not None or out.returned:
            # The previous checkpoint is still there, or the new one replaced it whole.
            loaded = self.call("Session.load()", lambda: rlnb.Session.load(self.ckpt, name=f"{self.name}-loaded"))
            try:
                assert loaded.version in (self.saved_version, self.sess.version), (loaded.version, self.saved_version)
            finally:
                self.call("close() of the loaded session", loaded.close)
        self.call("save() again", lambda: self.sess.save(self.ckpt))
        self.saved_version = self.sess.version
        manifest, _ = rlnb.checkpoint.read(self.ckpt)
        assert manifest["step"] == self.saved_version
        left = sorted(
            str(p.relative_to(self.ckpt.parent))
            for p in self.ckpt.parent.rglob("*")
            if self.ckpt not in (p, *p.parents)
        )
        assert not left, f"save() left {left} beside the checkpoint"

    def _check_after_save(self, before: RolloutStatistics, out: Outcome) -> None:
        """An interrupted save() leaves rollouts as they were, a whole checkpoint at the
        path if there was one, and nothing else: no staging directory, no FD."""
        after = self.sess.statistics().rollout
        assert (after.state, after.dispatching) == (before.state, before.dispatching), (out.what, before, after)
        if self.saved_version is not None:
            assert self.ckpt.is_dir(), f"{out.what} left no checkpoint at the path"
        beside = sorted(p.name for p in self.ckpt.parent.iterdir() if p != self.ckpt)
        assert not beside, f"{out.what} left {beside} beside the checkpoint"
        prefix = f"{self.ckpt.parent}/"
        left = [target for target in snapshot().fds.values() if target.startswith(prefix)]
        assert not left or not _open_after_collection(prefix), f"{out.what} left {left} open"

    def _round_close(self, delay: float | None) -> None:
        sess = self.sess
        out = self.pressed("close", sess.close, delay)
        assert sess.closed and sess not in rlnb.sessions(), out.what
        self.call("close() again", sess.close)  # a no-op
        self.assert_nothing_left(out.what)
        self._open()  # a new session of the same name

    def assert_nothing_left(self, what: str) -> None:
        try:
            wait_until(lambda: _nothing_new(self.baseline), "the session's resources to go", timeout=5.0)
        except AssertionError:
            raise AssertionError(f"after {what}: left behind {snapshot().new_since(self.baseline)}") from None

    # -- checks -----------------------------------------------------------------------------

    def check(self) -> None:
        sess = self.sess
        stats = sess.statistics()  # raises a background failure no call has raised
        assert_counts_add_up(stats.rollout)
        assert stats.training.error is None
        assert stats.rollout.state == "running", stats.rollout
        assert stats.engine.paused is None, f"the engine is paused under running rollouts: {stats.engine}"
        if self.mode == "async":
            assert stats.rollout.dispatching == self.stepped, stats.rollout
        trained = self.trained_since(0)
        assert len(self.recorder.batches) == sess.version, "one batch per step, each recorded once"
        assert len(trained) == len(set(trained)), f"a prompt was trained twice: {trained}"
        assert len(self.rolled) == len(set(self.rolled)), f"rollout() returned a prompt twice: {self.rolled}"
        assert not set(trained) & set(self.rolled), "a prompt that rollout() returned was trained"
        b = stats.buffer
        if self.mode == "async":
            # Every batch taken was trained: an interrupted step took nothing, or completed.
            assert b.taken == GPS * sess.version, (b, sess.version)
            assert b.put == b.taken + sum(b.sizes.values()) + b.evicted_stale, b
        else:
            assert b.put == b.taken == 0, b
            # Nothing lost: every prompt taken from the stream was trained, returned by
            # rollout() or given back, but for those of interrupted rollout() calls.
            seen = trained + self.rolled + self.given_back()
            assert len(seen) == len(set(seen)), seen
            missing = set(range(max(seen, default=-1) + 1)) - set(seen)
            assert len(missing) <= self.lost_allowance, (sorted(missing), self.lost_allowance)

    def sort_unraisable(self, kind: str) -> None:
        """Exceptions raised where Python could not raise them: a file a Ctrl-C between
        ``open()`` and its ``with`` left to the garbage collector (while save() writes or
        checksums: any Python code has that window). Anything else fails."""
        while self.unraisable:
            exc_type, obj = self.unraisable.pop(0)
            if exc_type is ResourceWarning and ("ckpt" in obj or "ScandirIterator" in obj):
                self.figures.noted["a file left to the garbage collector (a Ctrl-C before its with block)"] += 1
                continue
            raise AssertionError(f"Python could not raise {exc_type.__name__} in {obj}")

    def measure(self) -> None:
        """The typical duration of each call, from rounds nobody interrupts."""
        for kind in KINDS:
            times = [self.round(kind, None) for _ in range(2 if kind == "close" else 3)]
            self.figures.typical_ms[kind] = statistics.median(times) * 1e3

    def close(self) -> None:
        if self.sess is not None and not self.sess.closed:
            self.call("final close()", self.sess.close)


def _presses_for(mode: str) -> int:
    return PRESSES - PRESSES // 2 if mode == "sync" else PRESSES // 2


@pytest.mark.slow
@pytest.mark.timeout(max(300, PRESSES))  # a press takes about 0.2 s on a busy 2-core machine
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_ctrl_c_at_random_moments_leaves_the_session_usable_and_the_counts_whole(mode: str, tmp_path: Path) -> None:
    target = _presses_for(mode)
    rng = random.Random(f"{SEED}-{mode}")
    start = time.perf_counter()
    with hang_alarm() as alarm, unraisable_exceptions() as unraisable:
        fuzz = Fuzz(mode, tmp_path, alarm, rng, unraisable)
        figures = fuzz.figures
        try:
            fuzz.measure()
            while sum(figures.presses.values()) < target and sum(figures.attempts.values()) < 10 * target:
                kind = rng.choices(KINDS, WEIGHTS)[0]
                fuzz.round(kind, rng.uniform(0.0, figures.typical_ms[kind] / 1e3))
            fuzz.round("step", None)  # and a last step
        finally:
            fuzz.close()
        del fuzz.last  # the last interrupt's frames
        gc.collect()
        fuzz.sort_unraisable("close")
        fuzz.assert_nothing_left("the last close()")
    figures.seconds = time.perf_counter() - start
    print(figures.table(mode))
    assert sum(figures.presses.values()) >= target, figures.table(mode)


def test_the_watchdog_fails_a_call_that_hangs_with_every_threads_stack() -> None:
    with hang_alarm() as alarm, pytest.raises(CallHung) as raised, watchdog(alarm, "a stuck call", deadline=0.1):
        threading.Event().wait(DEADLINE)  # never set
    report = str(raised.value)
    assert report.startswith("a stuck call did not return within 0.1 s") and "most recent call first" in report
    assert "test_the_watchdog_fails_a_call_that_hangs" in report


# -- regression tests ----------------------------------------------------------------------------
#
# Each bug the fuzz has hit, in its smallest form: a Ctrl-C that lands at one moment.
# press_ctrl_c() on the main thread raises KeyboardInterrupt at once (the signal is
# delivered before pthread_kill returns).


def _open_after_collection(prefix: str) -> bool:
    """Whether FDs of paths under ``prefix`` stay open once unreachable objects are gone
    (an interrupted call's frames may hold an open file, in a cycle with its error)."""
    gc.collect()
    return any(target.startswith(prefix) for target in snapshot().fds.values())


def test_ctrl_c_in_close_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    before = snapshot()
    sess = rlnb.Session(CONFIG, name="fuzz-close")
    sess.step()
    join = multiprocessing.process.BaseProcess.join

    def join_pressed(self: multiprocessing.process.BaseProcess, timeout: float | None = None) -> None:
        press_ctrl_c()  # as the loader's close() waits for its worker
        join(self, timeout)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "join", join_pressed)
    with contextlib.suppress(KeyboardInterrupt):
        sess.close()
    monkeypatch.undo()
    assert sess.closed and rlnb.sessions() == []
    wait_until(lambda: _nothing_new(before), "the session's resources to go", timeout=3.0)


def test_ctrl_c_as_close_begins_still_closes_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    before = snapshot()
    sess = rlnb.Session(CONFIG, name="fuzz-close-begins")
    sess.step()
    take_unreported = sess._trainer.take_unreported

    def pressed() -> Exception | None:
        press_ctrl_c()  # close() has set closed=True, and has closed nothing yet
        return take_unreported()

    monkeypatch.setattr(sess._trainer, "take_unreported", pressed)
    with contextlib.suppress(KeyboardInterrupt):
        sess.close()
    assert sess.closed and rlnb.sessions() == []
    wait_until(lambda: _nothing_new(before), "the session's resources to go", timeout=3.0)


def test_ctrl_c_in_save_leaves_rollouts_as_they_were(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with rlnb.Session(CONFIG, name="fuzz-save") as sess:
        sess.step()
        rollouter = sess._rollouter

        async def pressed(timeout: float | None = None) -> None:
            press_ctrl_c()  # from the loop thread, to the main thread waiting in save()
            await asyncio.Event().wait()  # in-flight rollouts still finishing; Ctrl-C cancels this

        monkeypatch.setattr(rollouter, "wait_paused", pressed)
        with pytest.raises(KeyboardInterrupt):
            sess.save(tmp_path / "ckpt")
        monkeypatch.undo()
        assert sess.step()["version"] == 2


def test_ctrl_c_in_save_leaves_no_staging_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with rlnb.Session(CONFIG, name="fuzz-staging") as sess:
        mkdtemp = tempfile.mkdtemp

        def pressed(*args: Any, **kwargs: Any) -> str:
            path = mkdtemp(*args, **kwargs)
            press_ctrl_c()  # the directory exists; its name is not returned yet
            return path

        monkeypatch.setattr(tempfile, "mkdtemp", pressed)
        with pytest.raises(KeyboardInterrupt):
            sess.save(tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_ctrl_c_in_save_leaves_no_directory_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with rlnb.Session(CONFIG, name="fuzz-rmtree") as sess:
        sess.save(tmp_path / "ckpt")
        open_ = os.open
        pressed: list[int] = []

        def open_pressed(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
            fd = open_(path, flags, mode, dir_fd=dir_fd)
            if not pressed and os.path.basename(path).startswith(".ckpt."):  # rmtree opens the old checkpoint
                pressed.append(fd)
                press_ctrl_c()
            return fd

        monkeypatch.setattr(os, "open", open_pressed)
        with pytest.raises(KeyboardInterrupt):
            sess.save(tmp_path / "ckpt")
        monkeypatch.undo()
    assert pressed, "save() never cleared the old checkpoint away"
    left = {fd: target for fd, target in snapshot().fds.items() if target.startswith(f"{tmp_path}/")}
    assert not left, f"save() left {left} open"


def _rename_pressing_after(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Make save() swap checkpoints by renames (as where RENAME_EXCHANGE is missing)
    and press Ctrl-C just after the rename to ``name``."""
    monkeypatch.setattr(rlnb._files, "_exchange", lambda a, b: False)
    rename = Path.rename

    def pressed(self: Path, target: Any) -> Path:
        moved = rename(self, target)
        if Path(target).name == name:
            press_ctrl_c()
        return moved

    monkeypatch.setattr(Path, "rename", pressed)


def test_ctrl_c_as_save_renames_the_old_checkpoint_aside_keeps_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with rlnb.Session(CONFIG, name="fuzz-swap-aside") as sess:
        sess.save(tmp_path / "ckpt")
        sess.step()
        _rename_pressing_after(monkeypatch, ".ckpt.old")
        with pytest.raises(KeyboardInterrupt):
            sess.save(tmp_path / "ckpt")
        monkeypatch.undo()
    with rlnb.Session.load(tmp_path / "ckpt", name="fuzz-swap-aside") as loaded:
        assert loaded.version in (0, 1)


def test_ctrl_c_as_save_moves_the_new_checkpoint_in_is_a_keyboard_interrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with rlnb.Session(CONFIG, name="fuzz-swap-in") as sess:
        sess.save(tmp_path / "ckpt")
        sess.step()
        _rename_pressing_after(monkeypatch, "ckpt")
        with pytest.raises(KeyboardInterrupt):
            sess.save(tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_ctrl_c_while_the_bridge_starts_its_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    bridge = AsyncBridge(name="fuzz-bridge")
    start = threading.Thread.start

    def pressed(self: threading.Thread) -> None:
        start(self)
        if self.name == "fuzz-bridge":
            press_ctrl_c()  # the loop thread runs; start() has not returned

    monkeypatch.setattr(threading.Thread, "start", pressed)
    coro = asyncio.sleep(0)
    with pytest.raises(KeyboardInterrupt):
        bridge.run(coro)
    monkeypatch.undo()
    assert coro.cr_frame is None, "the call the Ctrl-C stopped was closed, not left unawaited"
    assert bridge.run(asyncio.sleep(0, result="served")) == "served"  # the thread started is the bridge's
    bridge.close()
    assert [t.name for t in threading.enumerate() if t.name == "fuzz-bridge"] == []


def test_ctrl_c_as_resume_yields_leaves_the_engine_running() -> None:
    with rlnb.Session(CONFIG, name="fuzz-resume") as sess:
        sess.rollout(1)
        sess.rollouts.pause()
        rollouter = sess._rollouter

        async def resume_cancelled_at_its_first_await() -> None:  # as bridge.run() cancels it on Ctrl-C
            task = asyncio.ensure_future(rollouter.resume())
            await asyncio.sleep(0)  # resume() runs up to its first await
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        sess.bridge.run(resume_cancelled_at_its_first_await())
        stats = sess.statistics()
        assert stats.rollout.state == "running"
        assert stats.engine.paused is None, "the engine is paused under a running rollouter"

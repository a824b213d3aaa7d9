"""Every pause mode against every state the rest of the session can be in.

The states and what each waits for are written down in ``docs/architecture.md``
("Waits"). Here each combination of pause mode x {single-turn samples, multi-turn
conversations with tool calls in flight} x {buffer full, empty} x {sync, async} x
{foreground, background training} x {during a weight sync, not} is run for real: the
pause must take effect, ``wait_paused()`` must return, ``resume()`` must
return, and training must go on afterwards. A deadlock shows up as a call that does
not return within its deadline; the deadlines are generous and only turn a hang
into a failure.
"""

from __future__ import annotations

import asyncio
import operator
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import rlnb
from rlnb.envs import Turn
from tests.helpers import HookedEngine, assert_counts_add_up, wait_until

CAPACITY = 4
HANG = 20.0  # seconds after which a call that has not returned is taken for a deadlock


class SlowTool:
    """A tool environment whose every call takes a while (so pauses land during tool
    calls too) and answers twice before the conversation ends: three policy turns."""

    def reset(self, row: dict[str, Any]) -> None:
        self.calls = 0

    def step(self, completion: str) -> Turn:
        time.sleep(TOOL_CALL)
        self.calls += 1
        return Turn("=1;", reward=0.5, done=self.calls >= 2)


TOOL_CALL = 0.02  # seconds a tool call takes
# The multi-turn column of the matrix: the addition task with a tool, as notebook 10's.
TOOLS = rlnb.data.Task(
    "matrix_tools",
    alphabet=rlnb.data.get_task("addition").alphabet + ";",
    make_prompt=rlnb.data.get_task("addition").make_prompt,
    reward=lambda completion, answer: float(completion.strip() == answer),
    max_new_tokens=4,
    env=SlowTool,
    max_turns=3,
)


def small_config(mode: str, turns: str = "single") -> rlnb.Config:
    if turns == "multi":
        rlnb.data.register_task(TOOLS, replace=True)
    return rlnb.Config(
        mode=mode,
        seed=0,
        task="matrix_tools" if turns == "multi" else "addition",
        model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2, max_len=48),
        data=rlnb.DataConfig(num_workers=0),
        rollout=rlnb.RolloutConfig(
            group_size=2, groups_per_step=2, max_inflight=8, max_new_tokens=4, max_policy_lag=None
        ),
        buffer=rlnb.BufferConfig(capacity=CAPACITY),
        step_timeout=HANG,
    )


def returns(fn: Callable[..., Any], *args: Any, what: str) -> Any:
    """``fn(*args)`` on a thread of its own; fail if it has not returned within HANG s."""
    out: dict[str, Any] = {}

    def call() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # handed to the test's thread
            out["error"] = exc

    thread = threading.Thread(target=call, name=f"matrix-{what}", daemon=True)
    thread.start()
    thread.join(HANG)
    assert not thread.is_alive(), f"{what} did not return within {HANG} s: a deadlock"
    if "error" in out:
        raise out["error"]
    return out.get("value")


class Foreground:
    """``sess.train(n)`` as a cell runs it (on a thread here, so the test can pause)."""

    def __init__(self, sess: rlnb.Session, n: int) -> None:
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(sess, n), name="matrix-cell", daemon=True)
        self.thread.start()

    def _run(self, sess: rlnb.Session, n: int) -> None:
        try:
            sess.train(n, progress=False)
        except BaseException as exc:
            self.error = exc

    def join(self) -> None:
        self.thread.join(HANG)
        assert not self.thread.is_alive(), f"a foreground train() did not return within {HANG} s: a deadlock"


@pytest.fixture
def syncs() -> Iterator[tuple[threading.Event, threading.Event]]:
    """(syncing, release): a weight sync sets ``syncing`` and holds until ``release``."""
    release = threading.Event()
    yield threading.Event(), release
    release.set()


@pytest.mark.parametrize("during_sync", [False, True], ids=["idle-sync", "during-sync"])
@pytest.mark.parametrize("where", ["foreground", "background"])
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("full", [False, True], ids=["empty", "full"])
@pytest.mark.parametrize("pause_mode", ["abort", "keep", "wait"])
@pytest.mark.parametrize("turns", ["single", "multi"])
def test_no_pause_can_deadlock(
    turns: str,
    pause_mode: str,
    full: bool,
    mode: str,
    where: str,
    during_sync: bool,
    syncs: tuple[threading.Event, threading.Event],
) -> None:
    syncing, release = syncs
    config = small_config(mode, turns)
    engine = HookedEngine(config)
    with rlnb.Session(config, engine=engine, name="matrix") as sess:
        if full:  # background rollouts fill the buffer, and finished groups wait for room
            sess.rollouts.start()
            wait_until(lambda: sess.buffer.size() == CAPACITY and sess.buffer.held() > 0, "a full buffer")

        async def hold(version: int) -> None:
            syncing.set()
            await asyncio.to_thread(release.wait, HANG)

        if during_sync:
            engine.before_update = hold
        cell = None
        if where == "background":
            sess.training.start()
        else:
            cell = Foreground(sess, 3)
        if during_sync:
            assert syncing.wait(HANG), "no step reached its weight sync"
        else:
            wait_until(lambda: sess.version >= 1, "a first step")

        pausing = threading.Thread(target=returns, args=(sess.rollouts.pause, pause_mode), kwargs={"what": "pause()"})
        pausing.start()
        if during_sync:  # the pause waits for the sync in progress, which now ends
            wait_until(lambda: sess.statistics().rollout.state == "syncing", "the sync to be seen")
            engine.before_update = None
            release.set()
        pausing.join(HANG + 1)
        assert not pausing.is_alive(), f"pause({pause_mode!r}) did not return: a deadlock"
        returns(sess.rollouts.wait_paused, what="wait_paused()")
        # (a background step may be syncing its weights into the paused engine)
        rollout = sess.statistics().rollout
        assert rollout.state in ("paused", "syncing")
        if pause_mode == "wait" and rollout.state == "paused":  # a WAIT pause leaves nothing half-done
            assert rollout.in_flight == rollout.kept_partial == 0, rollout

        returns(sess.rollouts.resume, what="resume()")
        assert sess.statistics().rollout.state in ("running", "syncing")
        version = sess.version
        if cell is not None:
            cell.join()
            # A cell's step that found rollouts paused says so at once; otherwise it finished.
            if cell.error is not None:
                assert isinstance(cell.error, rlnb.RolloutError), cell.error
                assert "call sess.rollouts.resume() first" in str(cell.error), cell.error
            returns(lambda: sess.train(2, progress=False), what="train() after resume()")
            assert sess.version >= version + 2
        else:
            wait_until(lambda: sess.version >= version + 2, "background training to go on after resume()", HANG)
            returns(sess.training.stop, 10.0, what="stop()")
        assert_counts_add_up(sess.statistics().rollout)


class CallsBack(rlnb.learn.Callback):
    """A callback that drives the session it belongs to from inside a step."""

    def __init__(self, sess: rlnb.Session, pause_mode: str) -> None:
        self.sess, self.pause_mode, self.rounds = sess, pause_mode, 0

    def on_batch(self, groups: Any) -> None:
        self.sess.statistics()

    def on_step_end(self, metrics: Any) -> None:
        self.sess.rollouts.pause(self.pause_mode)
        self.sess.rollouts.wait_paused()
        self.sess.rollouts.resume()
        self.rounds += 1


@pytest.mark.parametrize("where", ["foreground", "background"])
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("pause_mode", ["abort", "keep", "wait"])
def test_a_callback_that_pauses_and_resumes_its_own_session_does_not_deadlock(
    pause_mode: str, mode: str, where: str
) -> None:
    config = small_config(mode)
    with rlnb.Session(config, name="matrix") as sess:
        callback = CallsBack(sess, pause_mode)
        sess.callbacks.append(callback)
        if where == "background":
            sess.training.start(steps=3)
            returns(sess.training.wait, what="wait()")
        else:
            returns(lambda: sess.train(3, progress=False), what="train()")
        assert callback.rounds == 3 and sess.version == 3
        assert sess.statistics().rollout.state == "running"


class StopsEarly(rlnb.learn.Callback):
    """Early stopping: the run ends itself from inside a step."""

    def __init__(self, sess: rlnb.Session, at: int, call: str) -> None:
        self.sess, self.at, self.call = sess, at, call

    def on_step_end(self, metrics: Any) -> None:
        if self.sess.version >= self.at:
            getattr(self.sess.training, self.call)()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_callback_can_stop_the_background_run_it_is_part_of(mode: str) -> None:
    with rlnb.Session(small_config(mode), name="matrix") as sess:
        sess.callbacks.append(StopsEarly(sess, 3, "stop"))
        sess.training.start()  # no step limit: only the callback ends it
        wait_until(lambda: not sess.training.running, "the run to end after the callback's stop()", HANG)
        assert sess.version == 3
        sess.train(1, progress=False)  # and the session goes on as usual


def test_a_callback_that_waits_for_its_own_run_gets_an_error_not_a_hang() -> None:
    with rlnb.Session(small_config("sync"), name="matrix") as sess:
        sess.callbacks.append(StopsEarly(sess, 1, "wait"))
        sess.training.start(steps=5)
        wait_until(lambda: not sess.training.running, "the run to end", HANG)
        with pytest.raises(rlnb.TrainingError) as raised:
            sess.training.wait()
        assert "would wait for itself" in str(raised.value.__cause__)


@pytest.mark.parametrize("call", ["training.start", "step", "train", "evaluate", "save"])
def test_a_second_thread_cannot_train_beside_a_call_in_progress(call: str, tmp_path: Any) -> None:
    config = small_config("sync")
    engine = HookedEngine(config)
    with rlnb.Session(config, engine=engine, name="matrix") as sess:
        started = engine.slow_down(0.5)  # the cell's step is surely still rolling out
        cell = Foreground(sess, 1)
        assert started.wait(HANG)
        args = {"save": (tmp_path / "ckpt",)}.get(call, ())
        with pytest.raises(RuntimeError, match=r"cannot run while train\(until=1\) runs on another thread"):
            operator.attrgetter(call)(sess)(*args)
        engine.before_generate = None
        cell.join()
        assert cell.error is None and sess.version == 1

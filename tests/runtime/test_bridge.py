from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import gc
import logging
import os
import threading
from collections.abc import Iterator

import pytest

import rlnb
from rlnb.probe import snapshot
from rlnb.runtime._bridge import AsyncBridge, live_loops
from tests.helpers import ctrl_c_once, wait_until

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="unset")


@pytest.fixture(params=["uvloop", "asyncio"])
def bridge(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[AsyncBridge]:
    """Both loop backends must keep every contract."""
    if request.param == "asyncio":
        monkeypatch.setenv("RLNB_EVENT_LOOP", "asyncio")
    with AsyncBridge(name="test-bridge") as b:
        yield b


async def add(a: int, b: int) -> int:
    await asyncio.sleep(0)
    return a + b


def test_run_returns_result_and_raises_original_error(bridge: AsyncBridge) -> None:
    assert bridge.run(add(2, 3)) == 5

    async def boom() -> None:
        raise ValueError("from the coroutine")

    with pytest.raises(ValueError, match="from the coroutine"):
        bridge.run(boom())


def test_run_from_a_thread_whose_own_loop_is_running(bridge: AsyncBridge) -> None:
    # Every Jupyter cell runs like this: inside ipykernel's running loop.
    async def cell() -> int:
        assert asyncio.get_running_loop().is_running()
        return bridge.run(add(1, 1))

    assert asyncio.run(cell()) == 2


def test_run_on_the_bridge_thread_raises_instead_of_deadlocking(bridge: AsyncBridge) -> None:
    async def reenter() -> None:
        bridge.run(add(1, 1))

    with pytest.raises(rlnb.BridgeReentryError, match="await coro"):
        bridge.run(reenter())

    async def close_from_inside() -> None:
        bridge.close()

    with pytest.raises(rlnb.BridgeReentryError, match="another thread"):
        bridge.run(close_from_inside())
    assert bridge.run(add(1, 2)) == 3  # still usable


def test_keyboard_interrupt_cancels_the_coroutine(bridge: AsyncBridge) -> None:
    events: list[str] = []
    started = threading.Event()

    async def long_running() -> None:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            events.append("cancelled")
            raise
        finally:
            events.append("cleaned up")

    with ctrl_c_once(started):
        bridge.run(long_running())
    # The coroutine's cleanup ran before run() re-raised: nothing is orphaned.
    assert events == ["cancelled", "cleaned up"]
    assert bridge.run(add(1, 1)) == 2


def test_an_interrupt_that_cannot_wake_a_blocked_wait_still_cancels_within_a_moment(bridge: AsyncBridge) -> None:
    # A Ctrl-C whose handler runs only once the main thread stops blocking (a CPython
    # race when the signal lands just before run() blocks): run() must still notice it.
    events: list[str] = []
    started = threading.Event()

    async def long_running() -> None:
        started.set()
        try:
            await asyncio.sleep(30)
            events.append("slept")
        except asyncio.CancelledError:
            events.append("cancelled")
            raise

    with ctrl_c_once(started, trip_only=True):
        bridge.run(long_running())
    assert events == ["cancelled"]  # cut short: not the coroutine's 30 s of sleep


def test_timeout_cancels_the_coroutine(bridge: AsyncBridge) -> None:
    events: list[str] = []

    async def slow() -> None:
        try:
            await asyncio.sleep(30)
        finally:
            events.append("finally")

    with pytest.raises(TimeoutError, match="was cancelled"):
        bridge.run(slow(), timeout=0.05)
    assert events == ["finally"]


def test_a_cancel_event_set_from_another_thread_cancels_the_coroutine(bridge: AsyncBridge) -> None:
    started, cleaned, cancel = threading.Event(), threading.Event(), threading.Event()

    async def wait_forever() -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        finally:
            cleaned.set()

    stopper = threading.Thread(target=lambda: started.wait(10) and cancel.set())
    stopper.start()
    with pytest.raises(asyncio.CancelledError, match="cancelled by request"):
        bridge.run(wait_forever(), cancel=cancel)
    stopper.join()
    assert cleaned.is_set()  # the coroutine ran its cleanup before run() returned
    assert bridge.run(add(1, 1), cancel=threading.Event()) == 2  # an unset event changes nothing


def test_a_timeout_error_raised_by_the_coroutine_is_not_mistaken_for_ours(bridge: AsyncBridge) -> None:
    async def raises_timeout() -> None:
        raise TimeoutError("the coroutine's own")

    with pytest.raises(TimeoutError, match="the coroutine's own"):
        bridge.run(raises_timeout(), timeout=5)


def test_context_variables_propagate(bridge: AsyncBridge) -> None:
    async def read() -> str:
        return request_id.get()

    token = request_id.set("cell-7")
    try:
        assert bridge.run(read()) == "cell-7"
    finally:
        request_id.reset(token)


def test_submit_returns_a_future_and_rejects_non_coroutines(bridge: AsyncBridge) -> None:
    assert bridge.submit(add(4, 5)).result(timeout=5) == 9
    with pytest.raises(TypeError, match="coroutine object"):
        bridge.submit(add)  # type: ignore[arg-type]


def test_zero_fd_growth_over_1000_calls_with_gc_disabled(bridge: AsyncBridge) -> None:
    bridge.run(add(0, 0))  # start the loop thread first
    gc.collect()
    gc.disable()
    try:
        before = snapshot().num_fds
        for i in range(1000):
            bridge.run(add(i, 1))
        after = snapshot().num_fds
    finally:
        gc.enable()
    assert after == before


def test_forked_child_gets_a_fresh_bridge(bridge: AsyncBridge) -> None:
    async def where() -> tuple[int, int]:
        return os.getpid(), threading.get_native_id()

    parent_pid, parent_thread = bridge.run(where())
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running any pytest machinery
        code = 1
        try:
            os.close(read_fd)
            child_pid, child_thread = bridge.run(where(), timeout=10)
            bridge.close()
            os.write(write_fd, f"{child_pid} {child_thread}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd) as reader:
        reply = reader.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    child_pid, child_thread = map(int, reply.split())
    assert child_pid == pid != parent_pid
    assert child_thread != parent_thread  # a new loop thread, not the parent's dead one
    assert bridge.run(where()) == (parent_pid, parent_thread)


def test_close_while_eight_threads_call_never_hangs(bridge: AsyncBridge) -> None:
    outcomes: list[str] = []
    lock = threading.Lock()
    go = threading.Barrier(9)

    def caller() -> None:
        go.wait()
        while True:
            try:
                bridge.run(asyncio.sleep(0.001))
            except rlnb.ClosedError:
                with lock:
                    outcomes.append("closed")
                return

    threads = [threading.Thread(target=caller) for _ in range(8)]
    for t in threads:
        t.start()
    go.wait()
    threading.Event().wait(0.05)
    bridge.close()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
    assert outcomes == ["closed"] * 8


def test_close_is_idempotent_and_use_after_close_is_a_clear_error(bridge: AsyncBridge) -> None:
    bridge.run(add(1, 1))
    bridge.close()
    bridge.close()
    assert bridge.closed
    assert live_loops() == ()
    with pytest.raises(rlnb.ClosedError, match="is closed"):
        bridge.run(add(1, 1))


def test_an_unused_bridge_starts_no_thread() -> None:
    before = threading.active_count()
    bridge = AsyncBridge(name="never-used")
    assert not bridge.started
    assert threading.active_count() == before
    bridge.close()


def test_close_cancels_tasks_and_finalizes_async_generators(bridge: AsyncBridge) -> None:
    events: list[str] = []

    async def ticker() -> object:
        try:
            while True:
                yield 1
                await asyncio.sleep(0)
        finally:
            events.append("generator finalized")

    async def background() -> None:
        try:
            await asyncio.sleep(30)
        finally:
            events.append("task cancelled")

    async def start() -> None:
        agen = ticker()
        await agen.__anext__()  # left suspended: only shutdown_asyncgens finalizes it
        asyncio.get_running_loop().create_task(background())
        events.append(f"holding {type(agen).__name__}")

    bridge.run(start())
    bridge.close()
    assert sorted(events) == ["generator finalized", "holding async_generator", "task cancelled"]


def test_a_task_that_ignores_cancellation_is_abandoned_with_a_warning(bridge: AsyncBridge) -> None:
    release = threading.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                continue

    fut = bridge.submit(stubborn())
    bridge.run(asyncio.sleep(0.01))
    with pytest.warns(RuntimeWarning, match="did not stop within") as record:
        bridge.close(timeout=0.1)
    assert "Tasks not finished: 'test_a_task_that_ignores_cancellation" in str(record[0].message)
    with pytest.raises(rlnb.ClosedError):
        fut.result(timeout=1)  # the caller is told, not left hanging
    release.set()  # the abandoned thread then stops and closes its loop by itself
    assert bridge._thread is not None
    bridge._thread.join(timeout=5)
    assert live_loops() == ()


@contextlib.contextmanager
def loop_blocked(bridge: AsyncBridge) -> Iterator[concurrent.futures.Future[None]]:
    """Block the bridge loop as a reward function that sleeps or waits would, until
    the block ends; yields the blocking call's future."""
    blocking, release = threading.Event(), threading.Event()

    async def blocking_reward() -> None:
        blocking.set()
        release.wait()  # synchronous: nothing else on the loop runs meanwhile

    fut = bridge.submit(blocking_reward())
    try:
        assert blocking.wait(10)
        yield fut
    finally:
        release.set()


def test_a_call_queued_behind_a_blocked_loop_fails_on_close_and_never_starts_later(
    bridge: AsyncBridge, caplog: pytest.LogCaptureFixture
) -> None:
    # A reward function that blocks stops the whole loop; a call made meanwhile
    # (sess.rollouts.pause()) queues behind it, and then the session is closed.
    outcome: list[object] = []

    async def pause() -> str:
        outcome.append("pause() ran after close")
        return "paused"

    def call_pause() -> None:
        try:
            outcome.append(bridge.run(pause()))
        except rlnb.ClosedError as exc:
            outcome.append(exc)

    caller = threading.Thread(target=call_pause)
    with loop_blocked(bridge) as blocked:
        caller.start()
        wait_until(lambda: len(bridge._calls) == 2, "pause() to queue behind the blocked loop")
        with pytest.warns(RuntimeWarning, match="did not stop within"):
            bridge.close(timeout=0.2)  # returns while the loop is still blocked
        caller.join(timeout=10)
        assert len(outcome) == 1 and isinstance(outcome[0], rlnb.ClosedError)  # told, not left waiting
        with pytest.raises(rlnb.ClosedError):
            blocked.result(timeout=0)
    assert bridge._thread is not None
    bridge._thread.join(timeout=10)  # once free, the abandoned thread stops by itself
    assert not bridge._thread.is_alive()
    assert live_loops() == ()
    assert len(outcome) == 1  # pause() was never started afterwards
    gc.collect()  # a queued coroutine left unclosed would warn "never awaited" here
    # Nothing went wrong in a loop callback (such as "Future in unexpected state").
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_close_that_cannot_stop_a_blocked_loop_says_where_it_is_stuck(bridge: AsyncBridge) -> None:
    with loop_blocked(bridge), pytest.warns(RuntimeWarning, match="did not stop within") as record:
        bridge.close(timeout=0.1)
    message = str(record[0].message)
    assert "loop thread 'test-bridge'" in message
    assert "running task 'loop_blocked.<locals>.blocking_reward'" in message
    assert "in blocking_reward" in message and "release.wait()" in message  # the line that blocks
    assert "asyncio.to_thread" in message  # and how to avoid it
    assert bridge._thread is not None
    bridge._thread.join(timeout=10)


def test_a_timeout_behind_a_blocked_loop_says_where_it_is_stuck(bridge: AsyncBridge) -> None:
    with loop_blocked(bridge), pytest.raises(TimeoutError, match="before the call could start") as info:
        bridge.run(add(1, 1), timeout=0.1)
    assert "running task 'loop_blocked.<locals>.blocking_reward'" in str(info.value)
    assert "release.wait()" in str(info.value)
    assert bridge.run(add(1, 1)) == 2  # usable again once the loop is free

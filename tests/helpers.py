"""Small helpers shared by test modules."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

import pytest

from rlnb.rollout import RolloutStatistics


@contextlib.contextmanager
def ctrl_c_once(started: threading.Event, *, timeout: float = 10.0) -> Iterator[None]:
    """Press Ctrl-C (SIGINT to the main thread, as the notebook's stop button does)
    once ``started`` is set, and expect the block to raise KeyboardInterrupt."""

    def press() -> None:
        if started.wait(timeout):
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    presser = threading.Thread(target=press, name="press-ctrl-c")
    presser.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            yield
    finally:
        presser.join()


def cause_chain(error: BaseException) -> list[BaseException]:
    """``error``, its ``__cause__``, that one's cause, and so on."""
    chain = []
    current: BaseException | None = error
    while current is not None:
        chain.append(current)
        current = current.__cause__
    return chain


def assert_counts_add_up(s: RolloutStatistics) -> None:
    """Every dispatched sample is finished, kept partial, failed or in flight."""
    assert s.dispatched == s.finished + s.kept_partial + s.failed + s.in_flight, s
    assert min(s.finished, s.kept_partial, s.failed, s.in_flight) >= 0, s

"""Small helpers shared by test modules."""

from __future__ import annotations

import _thread
import contextlib
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from rlnb.rollout import RolloutStatistics


@contextlib.contextmanager
def ctrl_c_once(started: threading.Event, *, timeout: float = 10.0, trip_only: bool = False) -> Iterator[None]:
    """Press Ctrl-C (SIGINT to the main thread, as the notebook's stop button does)
    once ``started`` is set, and expect the block to raise KeyboardInterrupt.

    ``trip_only`` instead trips SIGINT's handler with ``_thread.interrupt_main()``
    a moment later, with no signal: nothing interrupts a blocking wait, as when a
    real Ctrl-C lands just before the main thread starts to block."""

    def press() -> None:
        if not started.wait(timeout):
            return
        if trip_only:
            time.sleep(0.05)  # let the main thread block first
            _thread.interrupt_main()
        else:
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


# Timing figures differ from run to run. The rest match up to float rounding: the
# engine batches requests as they arrive, and a matmul over another batch size may
# round its last bits differently (the sampled tokens are the same).
TIMING_METRICS = frozenset({"train_tokens_per_s"})


def assert_same_metrics(got: list[dict[str, float]], expected: list[dict[str, float]]) -> None:
    assert len(got) == len(expected), f"{len(got)} steps, expected {len(expected)}"
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        a = {k: v for k, v in a.items() if k not in TIMING_METRICS}
        b = {k: v for k, v in b.items() if k not in TIMING_METRICS}
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6), f"step {step} differs"

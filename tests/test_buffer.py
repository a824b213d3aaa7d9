"""ReplayBuffer: FIFO partitions, blocking, staleness, statistics, the feeder and close()."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest

import rlnb
from rlnb import BufferConfig, ReplayBuffer
from tests.helpers import wait_until

# Generous bounds for waits that should end within milliseconds; they only stop a
# broken buffer from hanging the suite.
WAIT = 5.0


def make_group(i: int, version: int | None = 0, n_samples: int = 1) -> rlnb.Group:
    versions = () if version is None else (version, version)
    sample = rlnb.Sample(prompt=f"p{i}", completion="x", token_ids=(1, 2), versions=versions)
    return rlnb.Group(prompt=f"p{i}", samples=(sample,) * n_samples, prompt_id=i)


def ids(groups: Iterable[rlnb.Group]) -> list[int]:
    return [g.prompt_id for g in groups]


def getter_waiting(buf: ReplayBuffer, n: int = 1) -> Callable[[], bool]:
    # waiting_getters is read under the buffer's lock, which a getter only releases
    # inside its wait: once it is counted, it is blocked.
    return lambda: buf.statistics().waiting_getters == n


def assert_counts_balance(buf: ReplayBuffer) -> None:
    s = buf.statistics()
    assert s.put == s.taken + s.evicted_stale + sum(s.sizes.values()), s


class Call(threading.Thread):
    """Runs ``fn`` on a thread and keeps its result or exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(name="test-call", daemon=True)
        self._fn = fn
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self.result = self._fn()
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()

    def outcome(self, timeout: float = WAIT) -> Any:
        """The call's result; re-raises its exception; fails if it is still running."""
        assert self.done.wait(timeout), "the call is still blocked"
        self.join()
        if self.error is not None:
            raise self.error
        return self.result


@pytest.fixture
def spawn() -> Iterator[Callable[[Callable[[], Any]], Call]]:
    """Start calls on threads; every one is joined before the leak check runs."""
    calls: list[Call] = []

    def start(fn: Callable[[], Any]) -> Call:
        call = Call(fn)
        call.start()
        calls.append(call)
        return call

    yield start
    for call in calls:
        call.join(WAIT)
    assert not [c for c in calls if c.is_alive()], "a test thread is still blocked"


# -- FIFO and partitions ---------------------------------------------------------


def test_get_returns_groups_in_put_order() -> None:
    with ReplayBuffer(BufferConfig(capacity=16)) as buf:
        for i in range(6):
            buf.put(make_group(i))
        assert ids(buf.get(2)) == [0, 1]
        assert ids(buf.get_nowait(3)) == [2, 3, 4]
        buf.put(make_group(6))
        assert ids(buf.get(2)) == [5, 6]
        assert len(buf) == 0


def test_partitions_are_independent_fifos() -> None:
    with ReplayBuffer(BufferConfig(capacity=16)) as buf:
        buf.put(make_group(0), partition="train")
        buf.put(make_group(100), partition="val")
        buf.put(make_group(1), partition="train")
        buf.put_nowait(make_group(101), partition="val")
        buf.put(make_group(102), partition="val")

        assert buf.statistics().sizes == {"train": 2, "val": 3}
        assert ids(buf.get(3, partition="val")) == [100, 101, 102]
        # Groups waiting in val must not satisfy a get on train.
        buf.put(make_group(103), partition="val")
        with pytest.raises(rlnb.BufferEmpty):
            buf.get_nowait(3, partition="train")
        assert ids(buf.get(2)) == [0, 1]
        assert buf.statistics().sizes == {"train": 0, "val": 1}


@pytest.mark.parametrize(
    "call",
    [
        lambda buf: buf.put(make_group(0), partition="test"),
        lambda buf: buf.put_nowait(make_group(0), partition="test"),
        lambda buf: buf.get(1, timeout=0, partition="test"),
        lambda buf: buf.get_nowait(1, partition="test"),
    ],
    ids=["put", "put_nowait", "get", "get_nowait"],
)
def test_unknown_partition_raises_key_error_naming_the_partitions(call: Callable[[ReplayBuffer], object]) -> None:
    with ReplayBuffer(BufferConfig(capacity=4)) as buf:
        with pytest.raises(KeyError) as exc_info:
            call(buf)
        message = exc_info.value.args[0]
        assert "'test'" in message
        assert "'train'" in message and "'val'" in message
        assert len(buf) == 0


def test_custom_partitions_replace_the_defaults() -> None:
    with ReplayBuffer(BufferConfig(capacity=4, partitions=("train", "b"))) as buf:
        buf.put(make_group(0), partition="b")
        assert buf.statistics().sizes == {"train": 0, "b": 1}
        with pytest.raises(KeyError, match="'val'"):
            buf.put(make_group(1), partition="val")


def test_get_takes_a_whole_batch_or_nothing() -> None:
    with ReplayBuffer(BufferConfig(capacity=8)) as buf:
        buf.put(make_group(0))
        buf.put(make_group(1))
        with pytest.raises(TimeoutError):
            buf.get(3, timeout=0.02)
        with pytest.raises(rlnb.BufferEmpty):
            buf.get_nowait(3)
        assert len(buf) == 2
        assert buf.statistics().taken == 0
        buf.put(make_group(2))
        assert ids(buf.get(3, timeout=0)) == [0, 1, 2]


def test_put_rejects_what_is_not_a_group() -> None:
    with ReplayBuffer(BufferConfig(capacity=4)) as buf:
        with pytest.raises(TypeError, match=r"rlnb\.Group"):
            buf.put(make_group(0).samples[0])  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"rlnb\.Group"):
            buf.put_nowait([make_group(0)])  # type: ignore[arg-type]
        assert buf.statistics().put == 0


# -- blocking get ----------------------------------------------------------------


def test_get_blocks_until_a_producer_thread_puts_enough_groups(spawn: Callable[[Callable[[], Any]], Call]) -> None:
    with ReplayBuffer(BufferConfig(capacity=8)) as buf:

        def produce() -> None:
            wait_until(getter_waiting(buf), "the getter to block")
            for i in range(3):
                time.sleep(0.01)  # the getter must keep waiting through partial arrivals
                buf.put(make_group(i))

        producer = spawn(produce)
        got = buf.get(3, timeout=WAIT)
        producer.outcome()
        assert ids(got) == [0, 1, 2]
        assert len(buf) == 0


def test_get_timeout_says_how_many_groups_were_ready_and_which_partition() -> None:
    with ReplayBuffer(BufferConfig(capacity=8)) as buf:
        buf.put(make_group(0), partition="val")
        with pytest.raises(TimeoutError) as exc_info:
            buf.get(3, timeout=0.02, partition="val")
        message = str(exc_info.value)
        assert "1 of 3 groups" in message
        assert "'val'" in message
        assert buf.statistics().sizes["val"] == 1
        assert buf.statistics().waiting_getters == 0


def test_get_nowait_raises_buffer_empty() -> None:
    with ReplayBuffer(BufferConfig(capacity=8)) as buf:
        with pytest.raises(rlnb.BufferEmpty, match="0 of the 1"):
            buf.get_nowait()
        buf.put(make_group(0))
        with pytest.raises(rlnb.BufferEmpty, match="1 of the 2"):
            buf.get_nowait(2)
        assert ids(buf.get_nowait()) == [0]


@pytest.mark.parametrize("n_groups", [0, -1, 9, True])
def test_get_rejects_n_groups_that_could_never_be_met(n_groups: int) -> None:
    with ReplayBuffer(BufferConfig(capacity=8)) as buf:
        for i in range(8):
            buf.put(make_group(i))
        with pytest.raises(ValueError, match="n_groups"):
            buf.get(n_groups, timeout=0)
        with pytest.raises(ValueError, match="n_groups"):
            buf.get_nowait(n_groups)
        assert len(buf) == 8


# -- blocking put ----------------------------------------------------------------


def test_put_blocks_while_full_until_a_consumer_takes(spawn: Callable[[Callable[[], Any]], Call]) -> None:
    with ReplayBuffer(BufferConfig(capacity=2)) as buf:
        buf.put(make_group(0))
        buf.put(make_group(1))
        putter = spawn(lambda: buf.put(make_group(2)))
        assert not putter.done.wait(0.05), "put returned although the partition was full"
        assert buf.statistics().sizes["train"] == 2

        assert ids(buf.get(1)) == [0]
        putter.outcome()
        assert ids(buf.get(2)) == [1, 2]


def test_put_timeout_raises_timeout_error_and_adds_nothing() -> None:
    with ReplayBuffer(BufferConfig(capacity=1)) as buf:
        buf.put(make_group(0))
        with pytest.raises(TimeoutError, match="full"):
            buf.put(make_group(1), timeout=0.02)
        s = buf.statistics()
        assert (s.put, s.sizes["train"]) == (1, 1)
        assert ids(buf.get(1)) == [0]


def test_put_nowait_raises_buffer_full() -> None:
    with ReplayBuffer(BufferConfig(capacity=2)) as buf:
        buf.put_nowait(make_group(0))
        buf.put_nowait(make_group(1))
        with pytest.raises(rlnb.BufferFull, match="'train'"):
            buf.put_nowait(make_group(2))
        assert ids(buf.get(2)) == [0, 1]


def test_capacity_is_per_partition() -> None:
    with ReplayBuffer(BufferConfig(capacity=1)) as buf:
        buf.put(make_group(0))
        buf.put_nowait(make_group(1), partition="val")
        with pytest.raises(rlnb.BufferFull):
            buf.put_nowait(make_group(2), partition="val")
        assert buf.statistics().sizes == {"train": 1, "val": 1}


def test_eviction_by_set_version_wakes_a_put_blocked_on_a_full_partition(
    spawn: Callable[[Callable[[], Any]], Call],
) -> None:
    with ReplayBuffer(BufferConfig(capacity=1, max_staleness=0)) as buf:
        buf.put(make_group(0, version=0))
        putter = spawn(lambda: buf.put(make_group(1, version=1)))
        # No counter exposes a blocked putter, so give it a moment to reach its wait.
        assert not putter.done.wait(0.05)
        buf.set_version(1)  # evicts group 0: the partition has room now
        assert putter.done.wait(WAIT), "put() stayed blocked after eviction freed room"
        assert ids(buf.get_nowait()) == [1]


# -- staleness -------------------------------------------------------------------


def test_set_version_evicts_groups_more_than_max_staleness_behind() -> None:
    with ReplayBuffer(BufferConfig(capacity=8, max_staleness=1)) as buf:
        for v in range(4):
            buf.put(make_group(v, version=v))
        buf.put(make_group(10, version=0), partition="val")

        buf.set_version(2)  # keeps versions 1 and 2 (at most 1 behind), evicts 0
        s = buf.statistics()
        assert s.evicted_stale == 2  # one from each partition
        assert s.sizes == {"train": 3, "val": 0}
        assert s.version == 2
        assert ids(buf.get(3)) == [1, 2, 3]
        assert_counts_balance(buf)


def test_a_group_is_as_stale_as_its_oldest_token() -> None:
    fresh = rlnb.Sample(prompt="p", token_ids=(1, 2), versions=(5, 5))
    mixed = rlnb.Sample(prompt="p", token_ids=(1, 2), versions=(3, 5))  # a resumed partial rollout
    unversioned = rlnb.Sample(prompt="p", token_ids=(1, 2))
    with ReplayBuffer(BufferConfig(capacity=8, max_staleness=1)) as buf:
        buf.put(rlnb.Group(prompt="p", samples=(fresh,), prompt_id=0))
        buf.put(rlnb.Group(prompt="p", samples=(fresh, mixed), prompt_id=1))
        buf.put(rlnb.Group(prompt="p", samples=(unversioned, mixed), prompt_id=2))
        buf.set_version(5)
        assert buf.statistics().evicted_stale == 2
        assert ids(buf.get_nowait(1)) == [0]


def test_unversioned_groups_are_never_evicted() -> None:
    with ReplayBuffer(BufferConfig(capacity=8, max_staleness=0)) as buf:
        buf.put(make_group(0, version=None))
        buf.put(make_group(1, version=0))
        buf.put(make_group(2, version=None), partition="val")
        buf.set_version(1_000_000)
        s = buf.statistics()
        assert s.evicted_stale == 1
        assert s.sizes == {"train": 1, "val": 1}
        assert ids(buf.get(1)) == [0]


def test_a_group_already_stale_when_put_is_evicted_and_counted() -> None:
    with ReplayBuffer(BufferConfig(capacity=8, max_staleness=1)) as buf:
        buf.set_version(5)
        buf.put(make_group(0, version=3))
        buf.put(make_group(1, version=4))
        s = buf.statistics()
        assert (s.put, s.evicted_stale, s.sizes["train"]) == (2, 1, 1)
        assert ids(buf.get_nowait()) == [1]


def test_without_max_staleness_nothing_is_evicted() -> None:
    with ReplayBuffer(BufferConfig(capacity=8)) as buf:
        buf.put(make_group(0, version=0))
        buf.set_version(1_000)
        assert buf.statistics().evicted_stale == 0
        assert ids(buf.get_nowait()) == [0]


def test_put_equals_taken_plus_evicted_plus_held_after_every_step() -> None:
    with ReplayBuffer(BufferConfig(capacity=4, max_staleness=1)) as buf:
        steps: list[Callable[[], object]] = [
            lambda: buf.put(make_group(0, version=0)),
            lambda: buf.put(make_group(1, version=1)),
            lambda: buf.put(make_group(2, version=None), partition="val"),
            lambda: buf.get(1),
            lambda: buf.put(make_group(3, version=2)),
            lambda: buf.set_version(3),  # evicts group 1
            lambda: buf.put(make_group(4, version=0)),  # stale on arrival
            lambda: buf.put_nowait(make_group(5, version=3), partition="val"),
            lambda: buf.get_nowait(2, partition="val"),
            lambda: buf.set_version(10),  # evicts group 3
        ]
        for step in steps:
            step()
            assert_counts_balance(buf)
        s = buf.statistics()
        assert (s.put, s.taken, s.evicted_stale, len(buf)) == (6, 3, 3, 0)


# -- statistics ------------------------------------------------------------------


def test_statistics_is_a_frozen_snapshot() -> None:
    with ReplayBuffer(BufferConfig(capacity=8, max_staleness=2)) as buf:
        buf.put(make_group(0, n_samples=4))
        buf.put(make_group(1, n_samples=2))
        buf.put(make_group(2, n_samples=3), partition="val")
        buf.get(1)
        buf.set_version(1)
        snap = buf.statistics()

        assert snap.sizes == {"train": 1, "val": 1}
        assert snap.samples == {"train": 2, "val": 3}
        assert (snap.capacity, snap.put, snap.taken, snap.evicted_stale) == (8, 3, 1, 0)
        assert (snap.version, snap.max_staleness, snap.waiting_getters) == (1, 2, 0)
        assert (snap.feeder_alive, snap.feeder_polls, snap.feeder_error, snap.closed) == (False, 0, None, False)

        with pytest.raises(dataclasses.FrozenInstanceError):
            snap.put = 99  # type: ignore[misc]
        buf.put(make_group(3))
        buf.close()
        later = buf.statistics()
        assert (later.put, later.sizes["train"], later.closed) == (4, 2, True)
        # The earlier snapshot did not follow the buffer.
        assert snap.sizes == {"train": 1, "val": 1}
        assert (snap.put, snap.closed) == (3, False)


# -- feeder ----------------------------------------------------------------------


def test_feeder_puts_groups_into_train_from_its_own_named_thread() -> None:
    threads: list[str] = []
    batches = [[make_group(0), make_group(1)], None, [make_group(2)]]

    def feeder() -> list[rlnb.Group] | None:
        threads.append(threading.current_thread().name)
        return batches.pop(0) if batches else []

    with ReplayBuffer(BufferConfig(capacity=8), feeder=feeder, poll_interval=0.001, name="fd") as buf:
        assert ids(buf.get(3, timeout=WAIT)) == [0, 1, 2]
        assert buf.statistics().sizes["val"] == 0
        assert buf.statistics().feeder_alive
    assert set(threads) == {"rlnb-fd-feeder"}


def test_close_stops_a_feeder_waiting_out_a_long_poll_interval() -> None:
    polled = threading.Event()
    threads: list[threading.Thread] = []

    def feeder() -> list[rlnb.Group]:
        threads.append(threading.current_thread())
        polled.set()
        return []

    with ReplayBuffer(BufferConfig(capacity=4), feeder=feeder, poll_interval=5.0, name="slow") as buf:
        assert polled.wait(WAIT)
        wait_until(lambda: buf.statistics().feeder_polls == 1, "the first poll to be counted")
        (thread,) = threads
        assert thread.name == "rlnb-slow-feeder"

        start = time.monotonic()
        buf.close()
        elapsed = time.monotonic() - start
        # Timing goals are for the benchmarks; here: close() did not leave the thread
        # behind and the feeder was still in its first interval, not polling again.
        assert not thread.is_alive(), f"feeder thread alive after close() returned ({elapsed:.3f} s)"
        s = buf.statistics()
        assert (s.feeder_polls, s.feeder_alive, s.closed) == (1, False, True)


def test_close_stops_a_feeder_blocked_on_a_full_buffer() -> None:
    fed = threading.Event()
    threads: list[threading.Thread] = []

    def feeder() -> list[rlnb.Group]:
        threads.append(threading.current_thread())
        fed.set()
        return [make_group(i) for i in range(3)]  # one more than fits

    with ReplayBuffer(BufferConfig(capacity=2), feeder=feeder, poll_interval=5.0) as buf:
        assert fed.wait(WAIT)
        wait_until(lambda: buf.statistics().sizes["train"] == 2, "the buffer to fill")
        buf.close()
        assert not threads[0].is_alive()
        assert buf.statistics().feeder_error is None  # being closed is not a failure


def test_feeder_exception_is_raised_as_feeder_error_with_the_original_as_cause() -> None:
    original = ZeroDivisionError("remote source went away")

    def feeder() -> list[rlnb.Group]:
        raise original

    with ReplayBuffer(BufferConfig(capacity=4), feeder=feeder, poll_interval=0.001) as buf:
        with pytest.raises(rlnb.FeederError, match="remote source went away") as exc_info:
            buf.get(1, timeout=WAIT)
        assert exc_info.value.__cause__ is original
        s = buf.statistics()
        assert not s.feeder_alive
        assert s.feeder_error is not None and "remote source went away" in s.feeder_error
        # Reported once: the caller has been told, the buffer itself still works.
        with pytest.raises(rlnb.BufferEmpty):
            buf.get_nowait()


def test_feeder_failure_wakes_a_getter_blocked_without_timeout(spawn: Callable[[Callable[[], Any]], Call]) -> None:
    fail = threading.Event()

    def feeder() -> list[rlnb.Group]:
        if fail.wait(WAIT):
            raise OSError("connection reset")
        return []

    with ReplayBuffer(BufferConfig(capacity=4), feeder=feeder, poll_interval=0.001) as buf:
        getter = spawn(lambda: buf.get(2))
        wait_until(getter_waiting(buf), "the getter to block")
        fail.set()
        with pytest.raises(rlnb.FeederError) as exc_info:
            getter.outcome()
        assert isinstance(exc_info.value.__cause__, OSError)


def test_groups_put_before_the_feeder_failed_are_returned_after_the_error() -> None:
    failed = threading.Event()
    threads: list[threading.Thread] = []
    calls = 0

    def feeder() -> list[rlnb.Group]:
        nonlocal calls
        calls += 1
        if calls == 1:
            return [make_group(0), make_group(1)]
        threads.append(threading.current_thread())
        failed.set()
        raise RuntimeError("second poll fails")

    with ReplayBuffer(BufferConfig(capacity=4), feeder=feeder, poll_interval=0.001) as buf:
        assert failed.wait(WAIT)
        threads[0].join(WAIT)
        assert buf.statistics().sizes["train"] == 2
        with pytest.raises(rlnb.FeederError, match="second poll fails"):
            buf.get(2, timeout=WAIT)
        assert ids(buf.get(2, timeout=WAIT)) == [0, 1]


# -- close -----------------------------------------------------------------------


def test_close_is_idempotent() -> None:
    buf = ReplayBuffer(BufferConfig(capacity=4))
    assert not buf.closed
    buf.close()
    buf.close()
    with buf:
        pass
    assert buf.closed
    assert buf.statistics().closed
    assert "closed" in repr(buf)


def test_close_wakes_a_blocked_getter_with_closed_error(spawn: Callable[[Callable[[], Any]], Call]) -> None:
    with ReplayBuffer(BufferConfig(capacity=4)) as buf:
        buf.put(make_group(0))
        getter = spawn(lambda: buf.get(2))
        wait_until(getter_waiting(buf), "the getter to block")
        buf.close()
        with pytest.raises(rlnb.ClosedError):
            getter.outcome()


def test_close_wakes_a_blocked_putter_with_closed_error(spawn: Callable[[Callable[[], Any]], Call]) -> None:
    with ReplayBuffer(BufferConfig(capacity=1)) as buf:
        buf.put(make_group(0))
        putter = spawn(lambda: buf.put(make_group(1)))
        assert not putter.done.wait(0.05)
        buf.close()
        with pytest.raises(rlnb.ClosedError):
            putter.outcome()
        assert buf.statistics().put == 1


@pytest.mark.parametrize(
    "call",
    [
        lambda buf: buf.put(make_group(9)),
        lambda buf: buf.put_nowait(make_group(9)),
        lambda buf: buf.get(1),
        lambda buf: buf.get(1, timeout=0),
        lambda buf: buf.get_nowait(1),
    ],
    ids=["put", "put_nowait", "get", "get_timeout", "get_nowait"],
)
def test_put_and_get_after_close_raise_closed_error(call: Callable[[ReplayBuffer], object]) -> None:
    with ReplayBuffer(BufferConfig(capacity=4)) as buf:
        buf.put(make_group(0))
    with pytest.raises(rlnb.ClosedError):
        call(buf)


# -- construction ----------------------------------------------------------------


def _feed_nothing() -> None:
    return None


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"capacity": 0}, "capacity"),
        ({"capacity": -3}, "capacity"),
        ({"capacity": 2.5}, "capacity"),
        ({"capacity": True}, "capacity"),
        ({"capacity": "8"}, "capacity"),
        ({"partitions": ()}, "partitions"),
        ({"partitions": ("train", "train")}, "partitions"),
        ({"partitions": ("train", "")}, "partitions"),
        ({"partitions": ("train", None)}, "partitions"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"max_staleness": 1.5}, "max_staleness"),
        ({"max_staleness": True}, "max_staleness"),
        ({"poll_interval": 0}, "poll_interval"),
        ({"poll_interval": -1.0}, "poll_interval"),
        ({"poll_interval": "1"}, "poll_interval"),
        ({"poll_interval": None}, "poll_interval"),
        ({"poll_interval": True}, "poll_interval"),
        ({"feeder": 42}, "feeder"),
        ({"feeder": "fetch_groups"}, "feeder"),
    ],
    ids=lambda v: repr(v) if not isinstance(v, str) else v,
)
def test_bad_arguments_raise_config_error_naming_the_argument_and_start_no_thread(
    kwargs: dict[str, object], argument: str
) -> None:
    # A valid feeder alongside the bad argument: it must not be started.
    kwargs = {"feeder": _feed_nothing, **kwargs}
    config = {k: kwargs.pop(k) for k in ("capacity", "partitions", "max_staleness") if k in kwargs}
    before = threading.active_count()
    with pytest.raises(rlnb.ConfigError, match=argument):
        ReplayBuffer(BufferConfig(**config), **kwargs)  # type: ignore[arg-type]
    assert threading.active_count() == before
    assert not [t for t in threading.enumerate() if t.name.endswith("-feeder")]


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        ReplayBuffer(BufferConfig(capacity=0))


def test_a_bare_string_for_partitions_raises_config_error() -> None:
    # tuple("train") would silently make one partition per letter and no "train".
    with pytest.raises(rlnb.ConfigError, match="partitions"):
        ReplayBuffer(BufferConfig(capacity=4, partitions="train"))  # type: ignore[arg-type]


def test_a_buffer_takes_its_config_whole_and_says_so_when_given_a_number() -> None:
    with ReplayBuffer() as buf:
        assert buf.statistics().capacity == BufferConfig().capacity  # the config's default, the only one
    with pytest.raises(rlnb.ConfigError, match=r"takes a rlnb.BufferConfig.*ReplayBuffer\(BufferConfig\(capacity="):
        ReplayBuffer(16)  # type: ignore[arg-type]


@pytest.mark.parametrize("poll_interval", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_poll_interval_raises_config_error(poll_interval: float) -> None:
    # NaN passes "<= 0" and makes the feeder poll in a busy loop; inf makes Event.wait
    # raise OverflowError on the feeder thread. No feeder here, so a wrongly accepted
    # value starts no thread.
    with pytest.raises(rlnb.ConfigError, match="poll_interval"):
        ReplayBuffer(BufferConfig(capacity=4), poll_interval=poll_interval)


# -- concurrency -----------------------------------------------------------------


def test_four_producers_and_two_consumers_move_every_group_exactly_once(
    spawn: Callable[[Callable[[], Any]], Call],
) -> None:
    producers, per_producer, consumers, batch = 4, 100, 2, 4
    total = producers * per_producer
    start = threading.Barrier(producers + consumers)
    received: list[list[int]] = [[] for _ in range(consumers)]

    with ReplayBuffer(BufferConfig(capacity=8)) as buf:

        def produce(p: int) -> None:
            start.wait(WAIT)
            for i in range(per_producer):
                buf.put(make_group(p * per_producer + i), timeout=WAIT)

        def consume(c: int) -> None:
            start.wait(WAIT)
            for _ in range(total // batch // consumers):
                got = buf.get(batch, timeout=WAIT)
                assert len(got) == batch
                received[c].extend(ids(got))

        calls = [spawn(lambda p=p: produce(p)) for p in range(producers)]
        calls += [spawn(lambda c=c: consume(c)) for c in range(consumers)]
        for call in calls:
            call.outcome()

        everything = received[0] + received[1]
        assert len(everything) == total
        assert sorted(everything) == list(range(total))
        # FIFO: each consumer sees any one producer's groups in the order they were put.
        for seen in received:
            for p in range(producers):
                mine = [i for i in seen if i // per_producer == p]
                assert mine == sorted(mine)
        s = buf.statistics()
        assert (s.put, s.taken, len(buf)) == (total, total, 0)


def test_wait_for_blocks_until_groups_arrive_and_takes_none() -> None:
    with ReplayBuffer(BufferConfig(capacity=8)) as buf:
        producer = threading.Timer(0.05, lambda: [buf.put(make_group(i)) for i in range(3)])
        producer.start()
        buf.wait_for(3, timeout=10)
        producer.join()
        assert len(buf) == 3 and buf.statistics().taken == 0
        with pytest.raises(TimeoutError, match="4"):
            buf.wait_for(4, timeout=0.01)

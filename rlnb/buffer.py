"""``ReplayBuffer``: groups of samples between the rollouter and the learner.

Each partition (``train``, ``val``) is a FIFO of groups. Groups older than
``max_staleness`` policy versions are evicted and counted, never dropped silently.
A producer that must not block (the rollouter, on its event loop) hands a group
to :meth:`ReplayBuffer.put_or_hold`: when the partition is full the group is
held, in order, and goes in as soon as the learner takes room. Nothing waits on a
thread for room, so no pause or weight sync can end up waiting on a full buffer.
An optional feeder thread pulls groups from a remote source; it waits on an
``Event`` between polls so ``close()`` returns at once whatever the interval, and
its failure is re-raised on the next ``get``/``put``.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rlnb._checks import check_number
from rlnb._errors import (
    BufferEmpty,
    BufferFull,
    ClosedError,
    ConfigError,
    FeederError,
    InvalidTypeError,
    InvalidValueError,
    UnknownNameError,
    WaitTimeoutError,
)
from rlnb._samples import Group
from rlnb.config import BufferConfig

__all__ = ["BufferStatistics", "ReplayBuffer"]

Feeder = Callable[[], Iterable[Group] | None]
_DEFAULT = BufferConfig()


@dataclasses.dataclass(frozen=True)
class BufferStatistics:
    """A snapshot of a :class:`ReplayBuffer`.

    ``sizes`` and ``samples`` count groups and samples per partition; ``held``
    counts groups handed to :meth:`ReplayBuffer.put_or_hold` that wait for room
    (they go in as groups are taken); ``put``, ``taken`` and ``evicted_stale`` are
    totals since creation; ``version`` is the learner's policy version the buffer
    measures staleness against.
    """

    sizes: Mapping[str, int]
    held: Mapping[str, int]
    samples: Mapping[str, int]
    capacity: int
    put: int
    taken: int
    evicted_stale: int
    version: int
    max_staleness: int | None
    waiting_getters: int
    feeder_alive: bool
    feeder_polls: int
    feeder_error: str | None
    closed: bool


class ReplayBuffer:
    """Thread-safe partitioned FIFO of :class:`~rlnb.Group` objects.

    ``config`` (:class:`~rlnb.BufferConfig`) names the partitions, bounds the groups
    held per partition (``put`` blocks when full) and sets the staleness that evicts
    them. ``feeder``, if given, is called every ``poll_interval`` seconds on a thread of
    the buffer's own and whatever groups it returns go into ``train``.
    """

    def __init__(
        self,
        config: BufferConfig = _DEFAULT,
        *,
        feeder: Feeder | None = None,
        poll_interval: float = 1.0,
        name: str = "buffer",
    ) -> None:
        if not isinstance(config, BufferConfig):
            raise ConfigError(
                f"ReplayBuffer(config={config!r}) takes a rlnb.BufferConfig, got {type(config).__name__}: "
                "e.g. ReplayBuffer(BufferConfig(capacity=256))"
            )
        _validate(feeder, poll_interval)
        parts = config.partitions
        self._name = name
        self._capacity = config.capacity
        self._max_staleness = config.max_staleness
        self._cond = threading.Condition()
        self._parts: dict[str, collections.deque[Group]] = {p: collections.deque() for p in parts}
        self._held: dict[str, collections.deque[Group]] = {p: collections.deque() for p in parts}
        self._admitted: Callable[[], None] | None = None  # see on_admit
        self._version = 0
        self._put = self._taken = self._evicted = self._waiting = 0
        self._closed = False
        self._error: BaseException | None = None  # feeder failure not yet reported
        self._error_text: str | None = None
        self._feeder = feeder
        self._poll_interval = poll_interval
        self._polls = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if feeder is not None:  # last: nothing after it can fail and leave it running
            self._thread = threading.Thread(target=self._feed, name=f"rlnb-{name}-feeder", daemon=True)
            self._thread.start()

    # -- producing ----------------------------------------------------------------

    def put(self, group: Group, *, partition: str = "train", timeout: float | None = None) -> None:
        """Append ``group``; blocks while the partition is full, up to ``timeout`` s.

        Raises :class:`TimeoutError` on timeout, :class:`~rlnb.ClosedError` after close
        and :class:`~rlnb.FeederError` if the feeder failed since the last call.
        """
        self._check_group(group, partition)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._raise_pending()
                if len(self._parts[partition]) < self._capacity:
                    break
                if not self._wait(deadline):
                    raise WaitTimeoutError(
                        f"ReplayBuffer.put(partition={partition!r}) timed out after {timeout} s: "
                        f"the partition is full ({self._capacity} groups) and nobody took from it"
                    )
            self._append(group, partition)

    def put_or_hold(self, group: Group, *, partition: str = "train") -> bool:
        """Append ``group`` if the partition has room, else hold it until it has; never
        blocks. Held groups go in, in order, as soon as groups are taken or evicted,
        before anything put later; :meth:`held` counts them. Returns whether the group
        went in at once. Raises :class:`~rlnb.ClosedError` after close."""
        self._check_group(group, partition)
        with self._cond:
            self._raise_pending()
            if self._held[partition] or len(self._parts[partition]) >= self._capacity:
                self._held[partition].append(group)
                return False
            self._append(group, partition)
            return True

    def on_admit(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback()`` whenever held groups go into a partition (None: stop).
        It is called with the buffer's lock held, on the thread that made room, so it
        must not block or call the buffer (e.g. ``loop.call_soon_threadsafe``)."""
        with self._cond:
            self._admitted = callback

    def held(self, partition: str = "train") -> int:
        """Groups handed to :meth:`put_or_hold` that wait for room in ``partition``."""
        self._check_partition(partition)
        with self._cond:
            return len(self._held[partition])

    def put_nowait(self, group: Group, *, partition: str = "train") -> None:
        """Append ``group`` or raise :class:`~rlnb.BufferFull` at once."""
        self._check_group(group, partition)
        with self._cond:
            self._raise_pending()
            if len(self._parts[partition]) >= self._capacity:
                raise BufferFull(f"partition {partition!r} holds {self._capacity} groups (its capacity)")
            self._append(group, partition)

    # -- consuming ----------------------------------------------------------------

    def get(self, n_groups: int, timeout: float | None = None, *, partition: str = "train") -> list[Group]:
        """Take the ``n_groups`` oldest groups at once; blocks until they are there.

        Raises :class:`TimeoutError` after ``timeout`` seconds saying what it waited
        for, :class:`~rlnb.ClosedError` if the buffer is or becomes closed and
        :class:`~rlnb.FeederError` if the feeder failed.
        """
        with self._cond:
            self._await(n_groups, timeout, partition)
            return self._take(n_groups, partition)

    def wait_for(self, n_groups: int, timeout: float | None = None, *, partition: str = "train") -> None:
        """Block until the partition holds at least ``n_groups`` groups, taking none
        (e.g. in a notebook: wait until background rollouts have made something to
        look at). Raises as :meth:`get` does."""
        with self._cond:
            self._await(n_groups, timeout, partition)

    def _await(self, n_groups: int, timeout: float | None, partition: str) -> None:
        self._check_request(n_groups, partition)
        deadline = None if timeout is None else time.monotonic() + timeout
        self._waiting += 1
        try:
            while True:
                self._raise_pending()
                if len(self._parts[partition]) >= n_groups:
                    return
                if not self._wait(deadline):
                    raise WaitTimeoutError(self._timeout_message(n_groups, partition, timeout))
        finally:
            self._waiting -= 1

    def put_back(self, groups: list[Group], *, partition: str = "train") -> None:
        """Return ``groups`` taken by a step that did not happen to the front, in
        order, so the next ``get`` takes them first. Ignores the capacity (they were
        in the buffer a moment ago)."""
        for group in groups:
            self._check_group(group, partition)
        with self._cond:
            self._parts[partition].extendleft(reversed(groups))
            self._taken -= len(groups)
            self._cond.notify_all()

    def get_nowait(self, n_groups: int = 1, *, partition: str = "train") -> list[Group]:
        """Take ``n_groups`` groups or raise :class:`~rlnb.BufferEmpty` at once."""
        self._check_request(n_groups, partition)
        with self._cond:
            self._raise_pending()
            have = len(self._parts[partition])
            if have < n_groups:
                raise BufferEmpty(f"partition {partition!r} holds {have} of the {n_groups} groups asked for")
            return self._take(n_groups, partition)

    # -- versions and figures -----------------------------------------------------

    def set_version(self, version: int) -> None:
        """Tell the buffer the learner's policy version; evicts groups now too stale."""
        with self._cond:
            self._version = version
            self._admit_held()

    def statistics(self) -> BufferStatistics:
        """A frozen snapshot of sizes and counters. Does not block on producers."""
        with self._cond:
            return BufferStatistics(
                sizes={p: len(q) for p, q in self._parts.items()},
                held={p: len(q) for p, q in self._held.items()},
                samples={p: sum(len(g) for g in q) for p, q in self._parts.items()},
                capacity=self._capacity,
                put=self._put,
                taken=self._taken,
                evicted_stale=self._evicted,
                version=self._version,
                max_staleness=self._max_staleness,
                waiting_getters=self._waiting,
                feeder_alive=self._thread is not None and self._thread.is_alive(),
                feeder_polls=self._polls,
                feeder_error=self._error_text,
                closed=self._closed,
            )

    def state_dict(self) -> dict[str, Any]:
        """The buffer's groups (held ones after the rest: a loaded buffer may hold
        more than its capacity until groups are taken), version and counters, as
        JSON-safe data."""
        with self._cond:
            return {
                "version": self._version,
                "counters": {
                    "put": self._put + sum(map(len, self._held.values())),
                    "taken": self._taken,
                    "evicted": self._evicted,
                },
                "partitions": {p: [g.to_dict() for g in (*q, *self._held[p])] for p, q in self._parts.items()},
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the contents with a :meth:`state_dict`; raises ``ValueError`` if its
        partitions are not this buffer's."""
        saved = set(state["partitions"])
        if saved != set(self._parts):
            raise InvalidValueError(f"the saved buffer has partitions {sorted(saved)}, this one {sorted(self._parts)}")
        parts = {p: collections.deque(Group.from_dict(g) for g in groups) for p, groups in state["partitions"].items()}
        with self._cond:
            self._parts.update(parts)
            for held in self._held.values():
                held.clear()
            self._version = int(state["version"])
            counters = state["counters"]
            self._put, self._taken, self._evicted = counters["put"], counters["taken"], counters["evicted"]
            self._cond.notify_all()

    def size(self, partition: str = "train") -> int:
        """The number of groups in ``partition`` now."""
        self._check_partition(partition)
        with self._cond:
            return len(self._parts[partition])

    def __len__(self) -> int:
        with self._cond:
            return sum(len(q) for q in self._parts.values())

    # -- lifecycle ----------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout: float | None = 1.0) -> None:
        """Stop the feeder and wake every waiter with :class:`~rlnb.ClosedError`.

        Idempotent. Returns within milliseconds unless the feeder callable itself is
        busy, in which case it waits up to ``timeout`` seconds for it, then warns.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                warnings.warn(
                    f"rlnb: the {self._name} feeder did not return within {timeout} s of close(); "
                    "its daemon thread is abandoned",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        sizes = ", ".join(f"{p}={len(q)}" for p, q in self._parts.items())
        return f"<ReplayBuffer {sizes}{' closed' if self._closed else ''}>"

    # -- internals (the _cond lock is held unless noted) ----------------------------

    def _check_group(self, group: Group, partition: str) -> None:
        if not isinstance(group, Group):
            raise InvalidTypeError(f"ReplayBuffer.put() takes a rlnb.Group, got {type(group).__name__}")
        self._check_partition(partition)

    def _check_request(self, n_groups: int, partition: str) -> None:
        if not isinstance(n_groups, int) or isinstance(n_groups, bool) or n_groups < 1:
            raise InvalidValueError(f"n_groups must be a positive int, got {n_groups!r}")
        if n_groups > self._capacity:
            raise InvalidValueError(
                f"n_groups={n_groups} exceeds the buffer's capacity ({self._capacity}) and could never be met"
            )
        self._check_partition(partition)

    def _check_partition(self, partition: str) -> None:
        if partition not in self._parts:
            raise UnknownNameError(f"unknown partition {partition!r}; this buffer has {sorted(self._parts)}")

    def _raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise FeederError(f"the {self._name} feeder failed: {error!r}") from error
        if self._closed:
            raise ClosedError(f"the {self._name} is closed")

    def _wait(self, deadline: float | None) -> bool:
        """Wait for a change; False once the deadline has passed."""
        if deadline is None:
            self._cond.wait()
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        self._cond.wait(remaining)
        return True

    def _append(self, group: Group, partition: str) -> None:
        self._parts[partition].append(group)
        self._put += 1
        self._admit_held()
        self._cond.notify_all()

    def _take(self, n_groups: int, partition: str) -> list[Group]:
        queue = self._parts[partition]
        taken = [queue.popleft() for _ in range(n_groups)]
        self._taken += n_groups
        self._admit_held()
        self._cond.notify_all()
        return taken

    def _admit_held(self) -> None:
        """Evict stale groups, then move held groups into their partitions while there
        is room, oldest first."""
        self._evict_stale()
        admitted = False
        for partition, held in self._held.items():
            queue = self._parts[partition]
            while held and len(queue) < self._capacity:
                queue.append(held.popleft())
                self._put += 1
                admitted = True
        if admitted and self._admitted is not None:
            self._admitted()

    def _evict_stale(self) -> None:
        if self._max_staleness is None:
            return
        oldest_ok = self._version - self._max_staleness
        evicted = 0
        for queues in (self._parts, self._held):
            for partition, queue in queues.items():
                keep = collections.deque(g for g in queue if (v := g.min_version) is None or v >= oldest_ok)
                evicted += len(queue) - len(keep)
                queues[partition] = keep
        if evicted:
            self._evicted += evicted
            self._cond.notify_all()  # room for a blocked put

    def _timeout_message(self, n_groups: int, partition: str, timeout: float | None) -> str:
        have = len(self._parts[partition])
        feeder = "no feeder"
        if self._thread is not None:
            feeder = "feeder alive" if self._thread.is_alive() else "feeder stopped"
        return (
            f"ReplayBuffer.get({n_groups}, partition={partition!r}) timed out after {timeout} s "
            f"with {have} of {n_groups} groups ready ({feeder}; {self._put} put so far, "
            f"{self._evicted} evicted as stale): is anything producing rollouts?"
        )

    def _feed(self) -> None:
        """The feeder thread (no lock held on entry)."""
        assert self._feeder is not None
        try:
            while not self._stop.is_set():
                for group in list(self._feeder() or ()):
                    self.put(group)
                with self._cond:
                    self._polls += 1
                self._stop.wait(self._poll_interval)
        except ClosedError:
            return
        except BaseException as exc:  # reported to the next caller, never swallowed
            with self._cond:
                self._error, self._error_text = exc, repr(exc)
                self._cond.notify_all()


def _validate(feeder: Feeder | None, poll_interval: float) -> None:
    if feeder is not None and not callable(feeder):
        raise ConfigError(f"ReplayBuffer feeder must be a callable returning groups, got {type(feeder).__name__}")
    check_number("ReplayBuffer.poll_interval", poll_interval, gt=0, fix="use a number of seconds > 0, e.g. 1.0")

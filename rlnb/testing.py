"""Test helpers: ``no_leaks()`` fails a block that leaves resources behind.

Use it as a context manager, or as the pytest fixture ``no_leaks`` (this module is
a pytest plugin, registered through the ``pytest11`` entry point)::

    with rlnb.testing.no_leaks():
        with rlnb.Session() as sess:
            ...
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Iterator

from rlnb._errors import LeakError
from rlnb.runtime import Snapshot, snapshot, warm_up_loop_backend

__all__ = ["no_leaks"]

# Threads, loops, FDs and runs are released synchronously by a correct close(); a
# child process may take a moment to be reaped after it was told to exit.
DEFAULT_GRACE = 0.5
DEFAULT_PROCESS_GRACE = 3.0


def _leaks(before: Snapshot, ignore_fds: frozenset[int]) -> dict[str, list[str]]:
    found = snapshot().new_since(before)
    if "fds" in found and ignore_fds:
        found["fds"] = [f for f in found["fds"] if int(f.split()[1]) not in ignore_fds]
        if not found["fds"]:
            del found["fds"]
    return found


@contextlib.contextmanager
def no_leaks(
    *,
    grace: float = DEFAULT_GRACE,
    process_grace: float = DEFAULT_PROCESS_GRACE,
    ignore_fds: frozenset[int] = frozenset(),
) -> Iterator[Snapshot]:
    """Raise :class:`~rlnb.LeakError` if the block leaves anything new behind.

    Compares a :func:`rlnb.probe.snapshot` taken on entry with one taken on exit:
    threads, open FDs, live child processes, open rlnb loops and open tracker runs.
    Allows ``grace`` seconds for things to wind down (``process_grace`` when a child
    process is still alive). Checks nothing if the block raised. Yields the entry
    snapshot.
    """
    warm_up_loop_backend()
    before = snapshot()
    yield before
    start = time.monotonic()
    while True:
        found = _leaks(before, ignore_fds)
        if not found:
            return
        allowed = max(grace, process_grace) if "children" in found else grace
        if time.monotonic() - start >= allowed:
            break
        gc.collect()  # an unreachable object's finalizer may still release an FD
        threading.Event().wait(0.02)
    lines = [f"  {kind}: " + "; ".join(items) for kind, items in found.items()]
    raise LeakError("resources left behind:\n" + "\n".join(lines))


try:
    import pytest
except ImportError:  # pragma: no cover - pytest is optional for users
    pass
else:

    @pytest.fixture(name="no_leaks")
    def _no_leaks_fixture() -> Iterator[Snapshot]:
        """Fail the test if it leaves threads, FDs, processes, loops or runs behind."""
        with no_leaks() as before:
            yield before

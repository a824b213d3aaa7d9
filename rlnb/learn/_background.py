"""``BackgroundRun``: training steps on a thread of their own, so the kernel stays free.

The thread calls ``step(cancel)`` until it has taken ``steps`` steps or :meth:`stop`
is called. ``cancel`` is an ``Event`` the step watches while it waits (for rollouts
to resume, for a rollout, for a batch): a stop then ends the step before its update,
with nothing trained and nothing lost. Once the update has started the step
finishes, so a run always ends at a step boundary. Python delivers SIGINT to the
main thread only, so the notebook's interrupt button never reaches this thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from rlnb._errors import StateError, TrainingError

__all__ = ["BackgroundRun"]


class BackgroundRun:
    """One background run of ``step``; see the module docstring.

    ``steps``: how many steps to take (None: until stopped). Start it with
    :meth:`start`; its failure is kept in :attr:`error` and raised by :meth:`wait`.
    """

    def __init__(
        self, step: Callable[[threading.Event], Any], *, steps: int | None, name: str = "rlnb-trainer"
    ) -> None:
        self._step = step
        self.steps = steps
        self.done = 0
        self.error: BaseException | None = None
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self._cancel = threading.Event()
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def running(self) -> bool:
        """True from :meth:`start` until the thread has taken its last step."""
        return self.started_at is not None and not self._ended.is_set()

    @property
    def steps_per_s(self) -> float | None:
        """Steps per second over the run so far (None before its first step)."""
        if self.started_at is None or not self.done:
            return None
        end = self.ended_at if self.ended_at is not None else time.monotonic()
        return self.done / max(end - self.started_at, 1e-9)

    def start(self) -> None:
        self.started_at = time.monotonic()
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._cancel.is_set() and (self.steps is None or self.done < self.steps):
                self._step(self._cancel)
                self.done += 1
        except asyncio.CancelledError:
            pass  # stopped while waiting, before an update: nothing to report
        except BaseException as exc:  # reported at the next call on the session
            self.error = exc
        finally:
            self.ended_at = time.monotonic()
            self._ended.set()

    def stop(self, timeout: float | None = None) -> bool:
        """Ask the run to end at the next step boundary and wait up to ``timeout`` s
        for it; returns whether it has ended. Idempotent. From the run's own thread
        (a callback stopping early) it only asks, and returns False: the run ends
        once the step in progress is done."""
        self._cancel.set()
        if self.on_own_thread():
            return False
        return self.wait_ended(timeout)

    def on_own_thread(self) -> bool:
        """Whether the caller is the run's own thread (a callback inside a step)."""
        return threading.current_thread() is self._thread

    def wait_ended(self, timeout: float | None = None) -> bool:
        """Block until the run has ended, up to ``timeout`` s; returns whether it has.
        Raises RuntimeError on the run's own thread, where it would wait for itself."""
        if self.started_at is None:
            return True
        if self.on_own_thread():
            raise StateError(
                "wait() was called from inside the background run (a callback), where it would wait for "
                "itself; call stop() there to end the run after this step"
            )
        ended = self._ended.wait(timeout)
        if ended:
            self._thread.join()
        return ended

    def raise_error(self) -> None:
        """Raise the run's failure, once, as a :class:`TrainingError` chained to it."""
        error, self.error = self.error, None
        if error is not None:
            raise TrainingError(f"background training failed after {self.done} step(s): {error!r}") from error

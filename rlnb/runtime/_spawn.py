"""Starting child processes without re-running the caller's ``__main__`` script."""

from __future__ import annotations

import contextlib
import multiprocessing.spawn
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["spawn_without_main"]

# Set in a thread while it starts workers: the processes it starts then leave out __main__.
_main_left_out = threading.local()
_wrap_lock = threading.Lock()
_wrapper: Callable[[str], dict[str, Any]] | None = None  # what we put in multiprocessing.spawn


def _leaving_out_main(original: Callable[[str], dict[str, Any]]) -> Callable[[str], dict[str, Any]]:
    def preparation_data(name: str) -> dict[str, Any]:
        data = original(name)
        if getattr(_main_left_out, "on", False):
            data.pop("init_main_from_path", None)  # python script.py
            data.pop("init_main_from_name", None)  # python -m module
        return data

    return preparation_data


@contextlib.contextmanager
def spawn_without_main() -> Iterator[None]:
    """Workers this thread starts meanwhile do not run the ``__main__`` script again.

    With ``forkserver`` and ``spawn``, multiprocessing sends each new process the
    main script's path (or module name), and the process runs it as ``__mp_main__``
    before its target: a script without an ``if __name__ == "__main__":`` guard builds
    another session there, and the process dies while it starts. rlnb's children
    (the prompt loader's workers, vLLM's EngineCore, ``ProcessEngine``'s server) run
    targets that live in packages (a loader never sends a task from ``__main__``), so
    they need no script. Only this thread's starts change. The wrapper stays in
    place: putting the original back could undo another thread's wrapper.
    """
    global _wrapper
    with _wrap_lock:
        if multiprocessing.spawn.get_preparation_data is not _wrapper:
            _wrapper = _leaving_out_main(multiprocessing.spawn.get_preparation_data)
            multiprocessing.spawn.get_preparation_data = _wrapper  # type: ignore[assignment]
    before = getattr(_main_left_out, "on", False)
    _main_left_out.on = True
    try:
        yield
    finally:
        _main_left_out.on = before

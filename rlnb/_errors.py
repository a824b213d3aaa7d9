"""Exceptions raised by rlnb, and the exit code a run ended by one reports. Every
public error derives from :class:`RlnbError`."""

from __future__ import annotations

import contextlib
import dis
import functools
import os
import sys
import threading
import traceback
import types
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

EXIT_OK, EXIT_FAILURE, EXIT_SIGINT, EXIT_SIGTERM = 0, 1, 130, 143


def exit_code_for(exc: BaseException | None) -> int:
    """The exit code a run ended by ``exc`` reports (None: success)."""
    if exc is None:
        return EXIT_OK
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_SIGINT
    if isinstance(exc, SystemExit):
        code = exc.code
        return code if isinstance(code, int) else (EXIT_OK if code is None else EXIT_FAILURE)
    return EXIT_FAILURE


class RlnbError(Exception):
    """Base class of every error rlnb raises on purpose."""


class ClosedError(RlnbError, RuntimeError):
    """The object was closed (or was closed while the call was waiting)."""


class BridgeReentryError(RlnbError, RuntimeError):
    """``AsyncBridge.run`` was called from the bridge's own loop thread (it would deadlock)."""


class ConfigError(RlnbError, ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


class BufferEmpty(RlnbError):
    """``ReplayBuffer.get_nowait`` found fewer groups than asked for."""


class BufferFull(RlnbError):
    """``ReplayBuffer.put_nowait`` found the partition at capacity."""


class FeederError(RlnbError, RuntimeError):
    """The replay buffer's feeder failed; the original error is chained as ``__cause__``."""


class LeakError(AssertionError):
    """``rlnb.testing.no_leaks`` found threads, FDs, processes, loops or runs left behind."""


class RolloutError(RlnbError, RuntimeError):
    """A rollout (generation or reward) failed after its retries; the cause is chained."""


class PromptError(RlnbError, ValueError):
    """The task's ``make_prompt`` raised for one prompt: the message names the prompt's
    id and the exception. The prompt stream goes on with the next prompt
    (``DataConfig.on_bad_prompt="skip"`` skips such prompts instead, counting them)."""

    def __init__(self, message: str, *, prompt_id: int) -> None:
        super().__init__(message)
        self.prompt_id = prompt_id


class EngineError(RlnbError, RuntimeError):
    """A generation engine failed as a whole (its thread or process died); every
    request it held fails with it, chained to the cause. Make a new session."""


class WeightSyncError(RolloutError):
    """A weight sync failed; the rollouter stays paused and nothing is half-synced."""


class CheckpointError(RlnbError):
    """A checkpoint is missing, damaged, of another format, or does not fit the session."""


class TrainingError(RlnbError, RuntimeError):
    """Training failed: background training (``Session.start()``), the cause chained; or
    a step whose advantages, loss or gradient were not finite, which changed nothing."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped a session call safely; the message says what was kept and how
    to go on. A notebook shows that one line instead of a traceback (IPython calls
    ``_render_traceback_``); it is still a KeyboardInterrupt everywhere else."""

    def _render_traceback_(self) -> list[str]:
        return [f"KeyboardInterrupt: {self}"]


class TrainingInterrupted(Interrupted):
    """Ctrl-C stopped a training call safely (see :class:`Interrupted`)."""


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep

_F = TypeVar("_F", bound=Callable[..., Any])


_inside = threading.local()  # the user code this thread runs for rlnb, if any


@contextlib.contextmanager
def running_user_code(what: str) -> Iterator[None]:
    """Mark this thread as running ``what`` (e.g. "a reward function") for rlnb."""
    previous = getattr(_inside, "what", None)
    _inside.what = what
    try:
        yield
    finally:
        _inside.what = previous


def public_call(after_interrupt: str, *, waits_for_rollouts: bool = False) -> Callable[[_F], _F]:
    """Make a method a call users make from a cell: an error rlnb raises on purpose
    (a ``raise`` in rlnb's code) shows as the call's own line and the message, without
    the bridge's and futures' frames under it, nor this wrapper's in IPython (causes
    keep theirs: a failing reward function's traceback still shows); an error Python
    raised inside rlnb, a bug, keeps every frame. Ctrl-C becomes one line,
    :class:`Interrupted`, ending with ``after_interrupt`` (what was kept, how to go on).
    ``waits_for_rollouts``: the call is refused at once (RuntimeError) from inside a
    reward function, where it would wait for that very reward."""

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if waits_for_rollouts and (inside := getattr(_inside, "what", None)) is not None:
                raise RuntimeError(
                    f"{fn.__name__}() was called from inside {inside}: it waits for rollouts, which wait for "
                    f"{inside} to return, so it would hang; compute what {inside} needs without the session"
                )
            try:
                return fn(*args, **kwargs)
            except Interrupted:
                raise
            except KeyboardInterrupt:
                raise Interrupted(f"{fn.__name__}() was interrupted; {after_interrupt}") from None
            except Exception as exc:
                if not _raised_on_purpose(exc):
                    raise
                # IPython shows a traceback's last frame whatever hides it, and this one
                # would be it: the error renders itself without it (_render_short).
                exc._render_traceback_ = functools.partial(_render_short, exc)  # type: ignore[attr-defined]
                raise exc.with_traceback(None)  # noqa: B904 (the same error, its traceback from here on)

        _WRAPPERS.add(call.__code__)  # type: ignore[attr-defined]  # (functools.wraps hides it from mypy)
        return cast(_F, call)

    return decorate


_WRAPPERS: set[types.CodeType] = set()  # public_call's wrapper: one code object for every call
_RAISE = dis.opmap["RAISE_VARARGS"]


def _raised_on_purpose(exc: BaseException) -> bool:
    """``exc`` came from a ``raise`` statement in rlnb's code: an error rlnb means to
    give. An error Python raised inside rlnb (an AttributeError, a failed assert) is a
    bug, which keeps every frame."""
    if type(exc) is AssertionError:
        return False
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    if not code.co_filename.startswith(_PACKAGE):
        return False
    return code in _WRAPPERS or code.co_code[tb.tb_lasti] == _RAISE


def _render_short(exc: BaseException) -> list[str]:
    """What IPython shows for an error ``public_call`` gave: its traceback (the
    user's lines) less the wrapper's frame at its end; causes keep all of theirs."""
    frames: list[types.TracebackType] = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    while frames and frames[-1].tb_frame.f_code in _WRAPPERS:
        frames.pop()
    short: types.TracebackType | None = None
    for entry in reversed(frames):
        short = types.TracebackType(short, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    shell = _ipython()
    if shell is None:
        return "".join(traceback.format_exception(type(exc), exc, short)).splitlines()
    return cast(list[str], shell.InteractiveTB.structured_traceback(type(exc), exc, short))


def _ipython() -> Any:
    module = sys.modules.get("IPython")  # only where IPython already runs: never imported here
    return module.get_ipython() if module is not None else None

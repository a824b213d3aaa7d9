"""Exceptions raised by rlnb, and the exit code a run ended by one reports. Every
error rlnb raises on purpose derives from :class:`RlnbError` and, where it stands for
one, from the builtin (``except ValueError`` catches an :class:`InvalidValueError`).
Only these are shown short in a notebook (:func:`public_call`): anything else is a
bug, which keeps every frame, and ``RLNB_FULL_TRACEBACKS=1`` keeps every frame of all."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import sysconfig
import threading
import traceback
import types
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

from rlnb._sigint import import_safe_interrupts

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


class InvalidValueError(RlnbError, ValueError):
    """A value given to a call is invalid: out of range, of the wrong shape, not one of
    the choices, or a file that is not what its path should hold. The message names the
    argument (or file), the value and the fix. A config's field gets a :class:`ConfigError`."""


class InvalidTypeError(RlnbError, TypeError):
    """An argument is of the wrong type (a string where a function goes); the message
    names the argument, what it got and what to pass."""


class BatchIndexError(RlnbError, IndexError):
    """An index into the kept batches (``sess.batches``) is out of range; the message
    gives the range (``LearnConfig.keep_batches`` sets how many are kept)."""


class UnknownNameError(RlnbError, KeyError):
    """A name looked up is not known (a buffer partition, a tracker backend); the
    message lists the known ones. Shown as its message, without ``KeyError``'s quotes."""

    def __str__(self) -> str:
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class StateError(RlnbError, RuntimeError):
    """The call cannot run now: training goes on in the background, another thread's
    call is in progress, nothing was trained yet, or it was made from inside a reward
    function it would wait for. The message says what to do first. (A closed object
    gives a :class:`ClosedError`.)"""


class WaitTimeoutError(RlnbError, TimeoutError):
    """A call that waits ran out of its time (its ``timeout`` argument, or
    ``Config.step_timeout``); the message says what it waited for and what was kept."""


class BackgroundError(RlnbError, RuntimeError):
    """Work rlnb ran on another thread or process failed, or could not start: a
    comparison's ticker, a benchmark's kernel or child process. The cause is chained,
    or the process's last output quoted."""


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
    """Training failed: background training (``sess.training.start()``), the cause chained; or
    a step whose advantages, loss or gradient were not finite, which changed nothing."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped a session call safely; the message says what was kept and how
    to go on. A notebook shows that one line instead of a traceback (IPython calls
    ``_render_traceback_``); it is still a KeyboardInterrupt everywhere else."""

    def _render_traceback_(self) -> list[str]:
        if full_tracebacks():
            return _render(self, self.__traceback__)
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


def full_tracebacks() -> bool:
    """``RLNB_FULL_TRACEBACKS`` is set (to anything but ``0``): no error is shortened,
    and a Ctrl-C shows where it landed (for debugging rlnb itself)."""
    return os.environ.get("RLNB_FULL_TRACEBACKS", "0") not in ("", "0")


def public_call(after_interrupt: str, *, waits_for_rollouts: bool = False) -> Callable[[_F], _F]:
    """Make a method a call users make from a cell: an :class:`RlnbError` (an error
    rlnb gives on purpose) shows as the user's own lines (a callback of theirs under the
    call's included) and the message, without the frames of rlnb, the bridge and
    futures under them (in IPython no rlnb frame at all; causes keep theirs: a failing
    reward function's traceback still shows). Any other error is a bug and keeps every
    frame; so does everything under ``RLNB_FULL_TRACEBACKS=1``.
    Ctrl-C becomes one line, :class:`Interrupted`, ending with ``after_interrupt``
    (what was kept, how to go on); one landing inside Python's import machinery is
    pressed again once out of it (:func:`rlnb._sigint.import_safe_interrupts`).
    ``waits_for_rollouts``: the call is refused at once (:class:`StateError`) from
    inside a reward function, where it would wait for that very reward."""

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                if waits_for_rollouts and (inside := getattr(_inside, "what", None)) is not None:
                    raise StateError(
                        f"{fn.__name__}() was called from inside {inside}: it waits for rollouts, which wait for "
                        f"{inside} to return, so it would hang; compute what {inside} needs without the session"
                    )
                # The session's threads import lazily: a Ctrl-C inside an import here must not
                # leave them the import lock held for good (rlnb._sigint).
                with import_safe_interrupts():
                    return fn(*args, **kwargs)
            except Interrupted:
                raise
            except KeyboardInterrupt as exc:
                interrupted = Interrupted(f"{fn.__name__}() was interrupted; {after_interrupt}")
                raise interrupted from (exc if full_tracebacks() else None)
            except RlnbError as exc:
                if full_tracebacks():
                    raise
                # IPython shows a traceback's last frame whatever hides it, and this
                # wrapper's would be it: the error renders itself without rlnb's frames.
                exc._render_traceback_ = functools.partial(_render_short, exc)  # type: ignore[attr-defined]
                below = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
                raise exc.with_traceback(_down_to_user_code(below))  # noqa: B904 (the same error, shortened)

        return cast(_F, call)

    return decorate


def _entries(tb: types.TracebackType | None) -> list[types.TracebackType]:
    entries = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    return entries


def _chain(entries: list[types.TracebackType]) -> types.TracebackType | None:
    """A new traceback of ``entries``' frames, in order (the old one is left as it was)."""
    chain: types.TracebackType | None = None
    for entry in reversed(entries):
        chain = types.TracebackType(chain, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return chain


def _users(entry: types.TracebackType) -> bool:
    """The frame runs the user's code: neither rlnb's, nor Python's, nor a library's."""
    filename = entry.tb_frame.f_code.co_filename
    return not filename.startswith((_PACKAGE, *_LIBRARIES)) and not filename.startswith("<frozen ")


_LIBRARIES = tuple(
    {os.path.join(sysconfig.get_paths()[key], "") for key in ("stdlib", "platstdlib", "purelib", "platlib")}
)


def _down_to_user_code(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The part of ``tb`` (the frames under a public call) down to the last frame of the
    user's code in it (a callback of theirs that called rlnb), or nothing: the frames
    under the user's last line are rlnb's own, which a deliberate error does not show."""
    entries = _entries(tb)
    users = [i for i, entry in enumerate(entries) if _users(entry)]
    return _chain(entries[: users[-1] + 1]) if users else None


def _render_short(exc: BaseException) -> list[str]:
    """What IPython shows for an error ``public_call`` shortened: its traceback less
    every rlnb frame (the wrapper's, and rlnb code between the user's lines, such as the
    trainer that ran their callback); causes keep all of theirs."""
    entries = [e for e in _entries(exc.__traceback__) if not e.tb_frame.f_code.co_filename.startswith(_PACKAGE)]
    return _render(exc, _chain(entries))


def _render(exc: BaseException, tb: types.TracebackType | None) -> list[str]:
    """``exc`` with traceback ``tb`` as IPython shows it (as Python does, outside IPython)."""
    shell = _ipython()
    if shell is None:
        return "".join(traceback.format_exception(type(exc), exc, tb)).splitlines()
    return cast(list[str], shell.InteractiveTB.structured_traceback(type(exc), exc, tb))


def _ipython() -> Any:
    module = sys.modules.get("IPython")  # only where IPython already runs: never imported here
    return module.get_ipython() if module is not None else None

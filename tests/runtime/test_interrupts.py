from __future__ import annotations

import signal
import sys
import threading
import time
import traceback
import weakref

import pytest

from rlnb.runtime._interrupts import defer_interrupts, redeliver_lost_interrupts


def test_a_sigint_inside_the_block_is_raised_after_it() -> None:
    done: list[str] = []
    with pytest.raises(KeyboardInterrupt, match="held back until the step was complete"), defer_interrupts():
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
        done.append("the rest of the block ran")
    assert done == ["the rest of the block ran"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_no_sigint_means_no_interrupt_and_other_threads_are_untouched() -> None:
    with defer_interrupts():
        pass
    seen: list[object] = []

    def worker() -> None:
        with defer_interrupts():
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [signal.default_int_handler]


def test_a_sigint_held_back_while_the_block_fails_is_reported_with_the_error() -> None:
    # The step fails (a weight sync, say) after the user pressed the stop button: the
    # error stops the cell, and its traceback says the Ctrl-C arrived too.
    with pytest.raises(ValueError, match="sync failed") as info, defer_interrupts():
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
        raise ValueError("sync failed")
    shown = "".join(traceback.format_exception(info.value))
    assert "ValueError: sync failed" in shown
    assert "KeyboardInterrupt: a Ctrl-C arrived during the step" in shown
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_a_keyboard_interrupt_the_block_raises_itself_is_left_as_it_is() -> None:
    # A block that gives up waiting on a held-back Ctrl-C raises KeyboardInterrupt itself.
    with pytest.raises(KeyboardInterrupt, match="nothing was taken") as info, defer_interrupts() as deferred:
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
        assert deferred.interrupted
        raise KeyboardInterrupt("interrupted while waiting; nothing was taken")
    assert not getattr(info.value, "__notes__", None)


def test_an_error_without_a_sigint_gets_no_note() -> None:
    with pytest.raises(ValueError) as info, defer_interrupts():
        raise ValueError("sync failed")
    assert not getattr(info.value, "__notes__", None)


# -- a Ctrl-C that lands where Python cannot raise it --------------------------------------


class _Watched:
    """An object watched through a weak reference, as threading and asyncio watch theirs."""


def _lose_a_ctrl_c_in_a_weakref_callback() -> None:
    """What a Ctrl-C does when it lands while the garbage collector runs a weakref
    callback: SIGINT's handler raises KeyboardInterrupt inside the callback."""
    watched = _Watched()

    def callback(ref: object) -> None:
        raise KeyboardInterrupt

    ref = weakref.ref(watched, callback)
    del watched
    assert ref() is None


def _pause(seconds: float = 10.0) -> None:
    """Run Python steps for ``seconds``: a Ctrl-C pressed again is raised at one of them."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.001)


def test_without_the_hook_python_loses_such_a_ctrl_c(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[type[BaseException]] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_type))
    _lose_a_ctrl_c_in_a_weakref_callback()
    _pause(0.5)  # nothing is raised
    assert seen == [KeyboardInterrupt]


def test_a_ctrl_c_python_could_not_raise_is_pressed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[type[BaseException]] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_type))
    redeliver_lost_interrupts()
    redeliver_lost_interrupts()  # idempotent: one wrapper
    with pytest.raises(KeyboardInterrupt):
        _lose_a_ctrl_c_in_a_weakref_callback()
        _pause()
    assert seen == []  # not printed either: "Exception ignored" would be a red box in a notebook


def test_other_unraisable_exceptions_go_to_the_hook_that_was_there(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[type[BaseException]] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_type))
    redeliver_lost_interrupts()
    watched = _Watched()

    def callback(ref: object) -> None:
        raise ValueError("a bug in a callback")

    ref = weakref.ref(watched, callback)
    del watched
    assert ref() is None
    assert seen == [ValueError]


def test_a_session_installs_the_hook_over_one_set_after_an_earlier_session(monkeypatch: pytest.MonkeyPatch) -> None:
    import rlnb

    seen: list[type[BaseException]] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_type))  # replaces an earlier one
    config = rlnb.Config(model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2), data=rlnb.DataConfig(num_workers=0))
    with rlnb.Session(config, name="hook"):
        with pytest.raises(KeyboardInterrupt):
            _lose_a_ctrl_c_in_a_weakref_callback()
            _pause()
    assert seen == []

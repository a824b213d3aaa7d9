from __future__ import annotations

import signal
import threading
import traceback

import pytest

from rlnb.runtime._interrupts import defer_interrupts


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

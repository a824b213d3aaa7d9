from __future__ import annotations

import signal
import threading

import pytest

from rlnb.runtime._interrupts import defer_interrupts


def test_a_sigint_inside_the_block_is_raised_after_it() -> None:
    done: list[str] = []
    with pytest.raises(KeyboardInterrupt, match="completed first"), defer_interrupts():
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

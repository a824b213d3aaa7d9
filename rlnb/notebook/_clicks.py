"""Clicks from the page: how they reach the kernel, and when one must not run.

While a blocking call (``train()``, ``step()``, ``wait()``, ...) holds the kernel's
main thread, a click reaches the kernel at once only through a kernel subshell:
JupyterLab 4 sends widget messages with its subshell's id, and ipykernel 7 routes a
widget's next click to the subshell named by the message that caused its last
update. Updates sent from a thread of ours are otherwise taken as caused by whatever
cell ran last, which routes the next clicks to the busy main thread; the dashboard's
ticker therefore sends its updates as caused by the page's last click
(:func:`send_as_caused_by`). A click that did wait arrives once the call has
returned, and is refused rather than run late (:func:`refusal`).
"""

from __future__ import annotations

import contextvars
import datetime
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlnb.session.reports import SessionStatistics

__all__ = ["CLICK_GRACE", "made_at", "page_message", "refusal", "send_as_caused_by", "through_a_subshell"]

CLICK_GRACE = 0.25
"""Seconds. A click from the page handled sooner than this after a blocking call
returned, on the thread the call ran on, may have been made while it ran: the kernel
hands over the clicks it held back within milliseconds. It is refused, not run late,
if the page made it before the call returned (its message's date, the browser's
clock, says when); a click made after it, however soon, runs. A message with no date
is taken as made while the call ran."""


def _kernel() -> Any:
    from IPython import get_ipython

    return getattr(get_ipython(), "kernel", None)


def page_message(widget: Any) -> dict[str, Any] | None:
    """The message from the page for ``widget`` that the kernel is handling now (a
    click), or None: code called ``click()``."""
    kernel = _kernel()
    try:
        parent = kernel.get_parent() if kernel is not None else None
    except Exception:  # another kernel, or none
        return None
    if not isinstance(parent, dict):
        return None
    header, content = parent.get("header") or {}, parent.get("content") or {}
    if header.get("msg_type") == "comm_msg" and content.get("comm_id") == getattr(widget, "model_id", None):
        return parent
    return None


def through_a_subshell(message: dict[str, Any]) -> bool:
    """Whether the page sent ``message`` through a kernel subshell."""
    return bool((message.get("header") or {}).get("subshell_id"))


def send_as_caused_by(message: dict[str, Any]) -> None:
    """Send this thread's widget updates as caused by ``message`` (ipykernel's shell
    parent, a context variable: this thread's only), so that the kernel routes the
    next clicks on those widgets to the subshell ``message`` came through."""
    parent = getattr(_kernel(), "_shell_parent", None)
    if isinstance(parent, contextvars.ContextVar):
        parent.set(message)


def made_at(message: dict[str, Any]) -> float | None:
    """When the page made ``message``, as a ``time.monotonic()`` reading, from the date
    in its header (the page's clock); None where it has none."""
    date = (message.get("header") or {}).get("date")
    if isinstance(date, str):
        try:
            date = datetime.datetime.fromisoformat(date)
        except ValueError:
            return None
    if not isinstance(date, datetime.datetime):
        return None
    if date.tzinfo is None:  # Jupyter's dates are UTC
        date = date.replace(tzinfo=datetime.UTC)
    return time.monotonic() - (time.time() - date.timestamp())


def refusal(method: str, stats: SessionStatistics, *, off: bool, why_off: str, made: float | None = None) -> str | None:
    """Why a click from the page on ``method`` must not run now, or None. ``off``:
    its button is off now (the ticker turned it off after the click was made), for
    the reason ``why_off``. ``made``: when the page made the click (:func:`made_at`)."""
    from rlnb.notebook import _panels

    call, last = stats.training.foreground, stats.training.last_foreground
    if call is not None and method not in _panels.beside(call.call):  # delivered at once, beside the call
        return f"{method}: not run. {call.call} is running in the foreground: one training call at a time."
    ended = None if call is not None or last is None or last.thread_id != threading.get_ident() else last.ended
    held = ended is not None and time.monotonic() - ended < CLICK_GRACE and (made is None or made < ended)
    if held and last is not None:
        return (
            f"{method}: not run. It was clicked while {last.call} held the kernel, which delivered the click "
            "only once the call returned; a click is never run late. Click again if you still want it."
        )
    if off:
        return (
            f"{method}: not run. It was clicked before the dashboard turned it off: {why_off or 'it cannot run now'}."
        )
    return None

"""Render a snapshot's figures as an aligned text block and as a small HTML table.

A snapshot builds its rows once, as ``(label, lines)``, and both its ``__repr__``
and its ``_repr_html_`` draw them, so the two never disagree. Stdlib only.
"""

from __future__ import annotations

import html
import reprlib
from collections.abc import Iterable, Sequence

__all__ = [
    "Rows",
    "clip",
    "html_table",
    "mebibytes",
    "name_list",
    "number",
    "pairs",
    "setting",
    "short_repr",
    "text_block",
]

# (label, lines): one section of a snapshot, its first line next to the label.
Rows = Sequence[tuple[str, Sequence[str]]]

# Every text line stays under this, so a repr never wraps in a notebook or terminal.
WIDTH = 99
_INDENT = "  "


_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 80


def mebibytes(n: int) -> str:
    """``n`` bytes as MiB, or GiB from 1 GiB on (3 significant digits)."""
    return f"{n / 2**20:.3g} MiB" if n < 2**30 else f"{n / 2**30:.3g} GiB"


def short_repr(value: object) -> str:
    """``repr(value)``, cut to about 80 characters (for a value in an error message)."""
    return _repr.repr(value)


def clip(text: str, width: int) -> str:
    """The first line of ``text``, cut to ``width`` characters with a trailing "…"."""
    lines = text.strip().splitlines() or [""]
    first = lines[0] + (" …" if len(lines) > 1 else "")
    return first if len(first) <= width else first[: max(width - 1, 0)] + "…"


def number(value: float | None) -> str:
    """A count as is, a float in four significant digits, ``None`` as "-"."""
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"


def setting(value: object, *, digits: int = 4, sep: str = ", ") -> str:
    """A setting's value, short: a float in ``digits`` significant digits, a tuple or
    list as ``(a, b)`` (its items joined by ``sep``), anything else as ``repr``."""
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    if isinstance(value, tuple | list):
        return "(" + sep.join(setting(v, digits=digits, sep=sep) for v in value) + ")"
    return repr(value)


def pairs(*items: tuple[str, object]) -> str:
    """``("in flight", 3), ("failed", 0)`` as "in flight 3, failed 0"."""
    return ", ".join(f"{name} {value}" for name, value in items)


def name_list(names: Iterable[str], *, limit: int = 8, width: int = 80, each: int = 32) -> str:
    """Up to ``limit`` names, each cut to ``each`` characters, that fit in ``width``;
    the rest as "… and N more"."""
    names = list(names)
    shown: list[str] = []
    for i, name in enumerate(names):
        rest = len(names) - i - 1
        tail = f", … and {rest} more" if rest else ""
        candidate = ", ".join([*shown, clip(name, each)])
        if len(shown) == limit or (shown and len(candidate + tail) > width):
            break
        shown.append(clip(name, each))
    more = len(names) - len(shown)
    return ", ".join(shown) + (f", … and {more} more" if more else "")


def text_block(title: str, rows: Rows) -> str:
    """``title`` over the rows, labels in one column and values aligned after them;
    every line is cut to stay under 100 characters."""
    label_width = max((len(label) for label, _ in rows), default=0)
    value_width = WIDTH - len(_INDENT) - label_width - 2
    out = [clip(title, WIDTH)]
    for label, lines in rows:
        for i, line in enumerate(lines or [""]):
            head = label if i == 0 else ""
            out.append(f"{_INDENT}{head:<{label_width}}  {clip(line, value_width)}".rstrip())
    return "\n".join(out)


def html_table(title: str, rows: Rows) -> str:
    """The rows as a ``<table>`` with ``title`` as its caption, every value escaped."""
    left = ' style="text-align:left"'
    body = "".join(
        f"<tr><th{left}>{html.escape(label)}</th><td{left}>{'<br>'.join(map(html.escape, lines))}</td></tr>"
        for label, lines in rows
    )
    return f"<table><caption{left}>{html.escape(title)}</caption><tbody>{body}</tbody></table>"

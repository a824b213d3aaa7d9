"""``%load_ext rlnb``: the ``%rlnb`` line magic and the kernel-shutdown hook.

- ``%rlnb`` lists the live sessions and what this process holds (FDs, threads,
  child processes, event loops, tracker runs);
- ``%rlnb close`` closes every session;
- ``%rlnb dashboard [name]`` shows a session's dashboard (the newest by default).

Loading installs rlnb's exit hooks at once (a kernel restart then closes sessions
before ipykernel tears the process down). Loading and unloading are idempotent.
"""

from __future__ import annotations

from typing import Any

from rlnb import _reprs
from rlnb._errors import InvalidValueError
from rlnb.runtime import close_all, install_hooks, sessions, snapshot

__all__ = ["SessionList", "load_ipython_extension", "rlnb_magic", "unload_ipython_extension"]

USAGE = "usage: %rlnb [close | dashboard [NAME]]"


class SessionList:
    """What ``%rlnb`` shows: the live sessions and this process's resource counts."""

    def __init__(self) -> None:
        self.sessions = sessions()
        self.snapshot = snapshot()

    def _rows(self) -> list[tuple[str, list[str]]]:
        rows: list[tuple[str, list[str]]] = [(repr(s.name), [_describe(s)]) for s in self.sessions]
        if not rows:
            rows.append(("sessions", ["none live"]))
        snap = self.snapshot
        rows.append(
            (
                "process",
                [
                    _reprs.pairs(
                        ("fds", snap.num_fds),
                        ("threads", snap.num_threads),
                        ("children", snap.num_children),
                        ("loops", len(snap.loops)),
                        ("runs", len(snap.runs)),
                    )
                ],
            )
        )
        return rows

    def __repr__(self) -> str:
        return _reprs.text_block("rlnb sessions", self._rows())

    def _repr_html_(self) -> str:
        return _reprs.html_table("rlnb sessions", self._rows())


def _describe(session: Any) -> str:
    stats = session.statistics(raise_errors=False)  # a failure is left for the user's next call
    training = "training in the background" if stats.training.running else "idle"
    failed = "; a background failure is pending" if stats.training.error else ""
    return (
        f"step {stats.training.step}, {session.config.mode} mode, {training}{failed}; "
        f"rollouts {stats.rollout.state}, {stats.buffer.sizes.get('train', 0)} groups in the buffer"
    )


def rlnb_magic(line: str) -> Any:
    """``%rlnb``, ``%rlnb close``, ``%rlnb dashboard [NAME]``; see the module docstring."""
    words = line.split()
    if not words:
        return SessionList()
    if words == ["close"]:
        names = [s.name for s in sessions()]
        close_all()
        print(f"rlnb: closed {len(names)} session(s) {names}")
        return None
    if words[0] == "dashboard" and len(words) <= 2:
        live = sessions()
        chosen = [s for s in live if len(words) == 1 or s.name == words[1]]
        if not chosen:
            known = [s.name for s in live]
            raise InvalidValueError(f"%rlnb dashboard: no live session {' '.join(words[1:])!r}; live: {known}")
        return chosen[-1].dashboard()
    raise InvalidValueError(f"%rlnb {line!r}: unknown; {USAGE}")


def load_ipython_extension(ipython: Any) -> None:
    """Register ``%rlnb`` and install the exit hooks; idempotent."""
    ipython.register_magic_function(rlnb_magic, magic_kind="line", magic_name="rlnb")
    install_hooks()


def unload_ipython_extension(ipython: Any) -> None:
    """Remove ``%rlnb``; idempotent (the exit hooks stay: sessions still need them)."""
    ipython.magics_manager.magics["line"].pop("rlnb", None)

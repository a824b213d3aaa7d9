"""The session's diagnostics: ``Session.diagnose``."""

from __future__ import annotations

__all__ = ["DiagnoseCells"]


class DiagnoseCells:
    """``diagnose`` of :class:`~rlnb.Session`."""

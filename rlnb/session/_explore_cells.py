"""The session's explorer cell: ``Session.explore`` (the view is :mod:`rlnb.notebook`'s)."""

from __future__ import annotations

__all__ = ["ExploreCells"]


class ExploreCells:
    """``explore`` of :class:`~rlnb.Session`."""

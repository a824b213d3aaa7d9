"""Notebook display and widgets. Nothing here holds a strong reference to a session."""

from rlnb.notebook._display import RolloutBatch

__all__ = ["RolloutBatch"]

"""Lifecycle runtime: the sync→async bridge, the resource probe and the session registry.

This layer never imports torch, wandb, ray or ipywidgets.
"""

from rlnb.runtime._bridge import AsyncBridge
from rlnb.runtime._probe import Snapshot, snapshot
from rlnb.runtime._registry import close_all, sessions

__all__ = ["AsyncBridge", "Snapshot", "close_all", "sessions", "snapshot"]

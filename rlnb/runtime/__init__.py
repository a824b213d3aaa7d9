"""Lifecycle runtime: the sync→async bridge and ``block_on``, the resource probe, the
session registry and the Ctrl-C guard.

This layer never imports torch, wandb, ray or ipywidgets.
"""

from rlnb.runtime._bridge import AsyncBridge, warm_up_loop_backend
from rlnb.runtime._coroutines import block_on
from rlnb.runtime._interrupts import Deferred, defer_interrupts
from rlnb.runtime._ipython import notebook_cell, release_output_pipes
from rlnb.runtime._probe import (
    ChildInfo,
    Snapshot,
    keep_zmq_gc,
    note_process_long,
    open_runs,
    register_run,
    snapshot,
    unregister_run,
    warm_up_kernel_messages,
)
from rlnb.runtime._registry import (
    close_all,
    install_hooks,
    lookup_session,
    register_session,
    replace_session,
    sessions,
    take_back_sigterm,
    unregister_session,
)
from rlnb.runtime._spawn import spawn_without_main

__all__ = [
    "spawn_without_main",
    "AsyncBridge",
    "ChildInfo",
    "Deferred",
    "Snapshot",
    "block_on",
    "close_all",
    "defer_interrupts",
    "install_hooks",
    "lookup_session",
    "keep_zmq_gc",
    "note_process_long",
    "notebook_cell",
    "open_runs",
    "register_run",
    "register_session",
    "release_output_pipes",
    "replace_session",
    "sessions",
    "snapshot",
    "take_back_sigterm",
    "unregister_run",
    "unregister_session",
    "warm_up_kernel_messages",
    "warm_up_loop_backend",
]

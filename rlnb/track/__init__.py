"""Tracking: ``Tracker`` with console, jsonl, wandb and live-plot backends."""

from rlnb.track._tracker import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_SIGINT,
    EXIT_SIGTERM,
    Backend,
    Tracker,
    TrackerError,
    exit_code_for,
)
from rlnb.track._wandb import wandb_mode_from_env
from rlnb.track._wandb_file import WandbRunFile, read_records, read_run

__all__ = [
    "EXIT_FAILURE",
    "EXIT_OK",
    "EXIT_SIGINT",
    "EXIT_SIGTERM",
    "Backend",
    "Tracker",
    "TrackerError",
    "WandbRunFile",
    "exit_code_for",
    "read_records",
    "read_run",
    "wandb_mode_from_env",
]

"""rlnb: notebook-first reinforcement-learning post-training of language models.

``import rlnb`` stays light: torch, ray, wandb and ipywidgets are imported where
they are used.
"""

import os as _os
import sys as _sys

# The engine, the learner and the event loop run on threads of their own, each
# calling into torch. OpenMP's default makes idle worker threads spin for a while
# after each parallel region, which steals the cores the other threads need
# (measured: async training 1.28x -> 1.37x faster than sync on 2 cores, and sync
# itself no slower). It is read when torch loads its OpenMP runtime, so it only
# applies if torch is not imported yet; an explicit OMP_WAIT_POLICY wins.
if "torch" not in _sys.modules:
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from rlnb import algorithms, probe
from rlnb._errors import (
    BackgroundError,
    BatchIndexError,
    BridgeReentryError,
    BufferEmpty,
    BufferFull,
    CheckpointError,
    ClosedError,
    ConfigError,
    EngineError,
    FeederError,
    Interrupted,
    InvalidTypeError,
    InvalidValueError,
    LeakError,
    PromptError,
    RlnbError,
    RolloutError,
    StateError,
    TrainingError,
    TrainingInterrupted,
    UnknownNameError,
    WaitTimeoutError,
    WeightSyncError,
)
from rlnb._samples import Group, PromptItem, RolloutBatch, Sample
from rlnb.algorithms import Algorithm
from rlnb.buffer import BufferStatistics, ReplayBuffer
from rlnb.config import (
    BufferConfig,
    Config,
    DataConfig,
    EngineConfig,
    LearnConfig,
    LoraConfig,
    ModelConfig,
    RayConfig,
    RolloutConfig,
    TrackConfig,
    WarmupConfig,
)
from rlnb.engines import PauseMode
from rlnb.runtime import AsyncBridge, close_all, sessions
from rlnb.session import Session, SessionStatistics
from rlnb.track import Tracker, TrackerError

__version__ = "0.1.0"

# Subpackages the documentation names as ``rlnb.<name>`` that pull in torch: imported
# at their first use, so ``import rlnb`` stays light and ``rlnb.learn.Callback`` works.
_LAZY_SUBMODULES = frozenset({"bench", "learn", "models", "testing"})
# Functions exported from a module that is imported at their first use: name -> module.
# The notebook layer's (``%load_ext rlnb`` asks for the hooks) wait for it: its widgets
# need ipywidgets, and a script or a test that shows none never loads them.
_LAZY_ATTRIBUTES = {
    "compare": "rlnb.notebook",
    "load_ipython_extension": "rlnb.notebook",
    "unload_ipython_extension": "rlnb.notebook",
}


def __getattr__(name: str) -> object:
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f"rlnb.{name}")
    if name in _LAZY_ATTRIBUTES:
        import importlib

        return getattr(importlib.import_module(_LAZY_ATTRIBUTES[name]), name)
    raise AttributeError(f"module 'rlnb' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_ATTRIBUTES})


__all__ = [
    "Algorithm",
    "AsyncBridge",
    "BackgroundError",
    "BatchIndexError",
    "BridgeReentryError",
    "BufferConfig",
    "BufferEmpty",
    "BufferFull",
    "BufferStatistics",
    "CheckpointError",
    "ClosedError",
    "Config",
    "ConfigError",
    "DataConfig",
    "EngineConfig",
    "EngineError",
    "FeederError",
    "Group",
    "Interrupted",
    "InvalidTypeError",
    "InvalidValueError",
    "LeakError",
    "LearnConfig",
    "LoraConfig",
    "ModelConfig",
    "PauseMode",
    "PromptError",
    "PromptItem",
    "RayConfig",
    "ReplayBuffer",
    "RlnbError",
    "RolloutBatch",
    "RolloutConfig",
    "RolloutError",
    "Sample",
    "Session",
    "SessionStatistics",
    "StateError",
    "TrackConfig",
    "Tracker",
    "TrackerError",
    "TrainingError",
    "TrainingInterrupted",
    "UnknownNameError",
    "WaitTimeoutError",
    "WarmupConfig",
    "WeightSyncError",
    "algorithms",
    "close_all",
    "compare",
    "load_ipython_extension",
    "probe",
    "sessions",
    "unload_ipython_extension",
]

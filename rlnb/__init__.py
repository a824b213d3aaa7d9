"""rlnb: notebook-first reinforcement-learning post-training of language models.

``import rlnb`` stays light: torch, ray, wandb and ipywidgets are imported where
they are used.
"""

from rlnb import probe
from rlnb._errors import (
    BridgeReentryError,
    BufferEmpty,
    BufferFull,
    CheckpointError,
    ClosedError,
    ConfigError,
    FeederError,
    LeakError,
    RlnbError,
    RolloutError,
    WeightSyncError,
)
from rlnb._samples import Group, PromptItem, Sample
from rlnb.buffer import BufferStatistics, ReplayBuffer
from rlnb.config import (
    BufferConfig,
    Config,
    DataConfig,
    EngineConfig,
    LearnConfig,
    ModelConfig,
    RolloutConfig,
    TrackConfig,
    WarmupConfig,
)
from rlnb.rollout import PauseMode
from rlnb.runtime import AsyncBridge, close_all, sessions
from rlnb.session import Session, SessionStatistics
from rlnb.track import Tracker, TrackerError

__version__ = "0.1.0"

__all__ = [
    "AsyncBridge",
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
    "FeederError",
    "Group",
    "LeakError",
    "LearnConfig",
    "ModelConfig",
    "PauseMode",
    "PromptItem",
    "ReplayBuffer",
    "RlnbError",
    "RolloutConfig",
    "RolloutError",
    "Sample",
    "Session",
    "SessionStatistics",
    "TrackConfig",
    "Tracker",
    "TrackerError",
    "WarmupConfig",
    "WeightSyncError",
    "close_all",
    "probe",
    "sessions",
]

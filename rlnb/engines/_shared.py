"""What the engine backends share and nothing else: the default :class:`~rlnb.EngineConfig`
and the check of the configs they take, handing a result from an engine's own thread
(or process reader) back to the asyncio loop that awaits it, and counting the requests
running under a pause for engines that see requests, not decode steps."""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import Any

from rlnb._errors import ConfigError
from rlnb.config import EngineConfig, ModelConfig
from rlnb.engines._protocol import PauseMode

DEFAULT_ENGINE = EngineConfig()  # what an engine built by hand gets; its defaults are EngineConfig's


def check_engine_config(config: object, owner: str) -> None:
    """ConfigError unless ``config`` is an :class:`~rlnb.EngineConfig`; ``owner`` names the call."""
    if not isinstance(config, EngineConfig):
        raise ConfigError(
            f"{owner}(config={config!r}) takes a rlnb.EngineConfig, got {type(config).__name__}: "
            "e.g. config=rlnb.EngineConfig(max_batch=8)"
        )


def check_model_config(model: object, owner: str) -> str:
    """``model.path``; ConfigError unless ``model`` is a :class:`~rlnb.ModelConfig` with a path."""
    if not isinstance(model, ModelConfig) or model.path is None:
        raise ConfigError(
            f"{owner}(model={model!r}) takes a rlnb.ModelConfig with the model's directory as its path, "
            f"e.g. {owner}(rlnb.ModelConfig(path='path/to/model', max_len=64), ...)"
        )
    return model.path


def deliver(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], result: Any) -> None:
    """Resolve ``future`` on ``loop`` from any thread: with ``result``, or with it as the
    exception when it is one. A no-op if the future is done or its loop has closed."""

    def settle() -> None:
        if future.done():
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop closed: nobody is waiting any more
        pass


def running(in_flight: Collection[int], paused: PauseMode | None, cutoff: int) -> int:
    """How many of the requests in flight (their arrival numbers) are running: all of
    them unpaused; none after an "abort" pause (every one came back); under "keep"
    (frozen in place) or "wait" (finishing), those that arrived by the pause's ``cutoff``."""
    if paused is None:
        return len(in_flight)
    if paused is PauseMode.ABORT:
        return 0
    return sum(a <= cutoff for a in in_flight)

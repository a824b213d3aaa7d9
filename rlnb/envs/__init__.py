"""Environments for multi-turn rollouts: conversations and tool calls.

A task with ``env=`` (:class:`rlnb.data.Task`) rolls out conversations instead of
single completions: the policy speaks, the environment answers (:class:`Turn`), up
to ``max_turns`` times. Each sample holds the whole conversation's tokens with a
loss mask (``Sample.mask``: 1 for the policy's tokens, 0 for the environment's), so
the learner trains only on what the policy said.
"""

from typing import Any as _Any

from rlnb.envs._episode import EnvError, Episode, check_factory
from rlnb.envs._gym import GymEnv
from rlnb.envs._openenv import OpenEnv
from rlnb.envs._openenv_server import OpenEnvServer, OpenEnvServerError
from rlnb.envs._protocol import Demonstration, Environment, Message, Observation, Turn
from rlnb.envs._tool_schema import tool_schema
from rlnb.envs._tools import ToolEnv, tool_calls

__all__ = [
    "Demonstration",
    "EnvError",
    "Environment",
    "Episode",
    "GymEnv",
    "Message",
    "Observation",
    "OpenEnv",
    "OpenEnvServer",
    "OpenEnvServerError",
    "ToolEnv",
    "Turn",
    "check_factory",
    "env_reward",
    "tool_calls",
    "tool_schema",
]


def env_reward(completion: str, answer: _Any, *, env_reward: float | None = None) -> float | None:
    """The environment's reward for the conversation (the sum of its turns'), as a
    reward function: list it in a task's ``reward`` to weigh it with others, e.g.
    ``reward=[env_reward, format_ok], reward_weights=[1.0, 0.2]``. None (it does not
    apply) for a sample whose environment gave no reward."""
    return env_reward

"""Rollouts: the asynchronous ``Rollouter`` that drives an engine.

It turns prompts into scored groups in the replay buffer, pauses and resumes
generation (keeping partial rollouts), and waits out weight syncs. It speaks to an
engine only through the ``Engine`` protocol of :mod:`rlnb.engines`, whose names
(the protocol's and the engines') are imported from there.
"""

from rlnb._samples import PromptItem
from rlnb.rollout._accounting import RolloutStatistics
from rlnb.rollout._agents import Agents, agent_name
from rlnb.rollout._conversation import Conversations
from rlnb.rollout._rollouter import Rollouter
from rlnb.rollout._served import Served, ServedCall, ServedChoice, ServedRequest, ServedStatistics, Serving
from rlnb.rollout._state import RolloutState

__all__ = [
    "Agents",
    "Conversations",
    "PromptItem",
    "RolloutState",
    "RolloutStatistics",
    "Rollouter",
    "Served",
    "ServedCall",
    "ServedChoice",
    "ServedRequest",
    "ServedStatistics",
    "Serving",
    "agent_name",
]

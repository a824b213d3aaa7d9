"""The environment protocol: what a multi-turn rollout talks to.

A conversation is a prompt, then turns: the policy speaks (one generation, ended by
end-of-sequence or the turn's token budget), the environment answers with a
:class:`Turn` (an observation, a reward, whether it is done), and the policy speaks
again, up to the task's ``max_turns``. Each sample of a group has an environment of
its own, made by the task's factory; the rollout closes it when the sample ends.

Every method is user code: it runs on a reward worker thread, never on the event
loop, and a method written ``async def`` is awaited there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from rlnb._errors import InvalidValueError

__all__ = ["Demonstration", "Environment", "Message", "Observation", "Turn"]

# A chat message, {"role": ..., "content": ...}; a tool's result has role "tool".
Message = Mapping[str, Any]
# What an environment says: text, chat messages, or nothing.
Observation = str | Sequence[Message] | None


@dataclasses.dataclass(frozen=True)
class Turn:
    """The environment's answer to one policy turn.

    observation: what the policy reads before its next turn (text, or chat messages
        such as ``{"role": "tool", "content": ...}``, which a Hugging Face model's chat
        template formats); None: nothing, the policy speaks again at once.
    reward: this turn's reward, or None; a conversation's environment reward is the
        sum of its turns' (``env_reward`` of the task's reward functions).
    done: the conversation ends here (it also ends at the task's ``max_turns``).
    """

    observation: Observation = None
    reward: float | None = None
    done: bool = False


@runtime_checkable
class Environment(Protocol):
    """One conversation's environment (a task's ``env`` factory makes one per sample).

    ``reset(row)`` starts the conversation: ``row`` is the prompt's record (a task made
    from records) or ``{"prompt", "answer", "prompt_id"}`` (a generated task); it
    returns the prompt (text or chat messages), or None to keep the task's prompt.
    The samples of a group share a row, and must get the same prompt.
    ``step(completion)`` answers a policy turn (its text) with a :class:`Turn`.
    ``close()``, if it has one, is called once the sample ends, however it ends.
    Either may be ``async def``. An environment that offers tools to a Hugging Face
    chat template sets ``tools`` to their JSON schemas (:class:`~rlnb.envs.ToolEnv` does).
    """

    def reset(self, row: Mapping[str, Any]) -> Observation: ...

    def step(self, completion: str) -> Turn: ...


@dataclasses.dataclass(frozen=True)
class Demonstration:
    """A conversation for a supervised warm-up to imitate: ``turns`` alternate, the
    policy's first, then the environment's reply, and so on. The warm-up trains on
    the policy's turns (each ending with end-of-sequence, as a generated turn does)
    and only reads the replies, as the learner later does with ``Sample.mask``.
    A warm-up teacher task gives one as a prompt's answer."""

    turns: tuple[str, ...]

    def __init__(self, *turns: str) -> None:
        if not turns or not all(isinstance(t, str) for t in turns):
            raise InvalidValueError(f"Demonstration{turns!r}: give the turns as strings, the policy's first")
        object.__setattr__(self, "turns", tuple(turns))

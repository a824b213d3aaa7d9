"""Reward functions: ready ones, and how a task combines several.

A task's ``reward`` is one function or a list (``Task(reward=[...], reward_weights=[...])``).
Each is called as ``fn(completion, answer)``, and with ``prompt=`` and ``row=`` (the
task's record) when its signature takes them; it returns a number, or None when it
does not apply to a sample. The sample's reward is the weighted sum of the values
that are not None, and each function's mean and standard deviation per step go into
the session's history as ``reward/<name>`` and ``reward/<name>/std``. A function
marked :func:`batched` is called once per group, with lists (reward models, judges).
A function marked :func:`isolated` runs in a worker process that its timeout
(``RolloutConfig.reward_timeout``) kills, even when it holds the GIL or never returns.

Ready functions: :func:`exact_match`, :func:`math_answer` (needs ``rlnb[math]``),
:func:`regex_format` and :func:`length_penalty`; the two that parse model output,
``math_answer`` and ``regex_format``, are isolated.

A function written for TRL's ``GRPOTrainer`` (``fn(prompts=, completions=,
completion_ids=, **columns)``, keywords only) is used as it is: one that takes
``**kwargs`` and names ``prompts``, ``completions`` or ``completion_ids`` is recognised
by its signature, and :func:`from_trl` wraps any other (:mod:`rlnb.rewards._trl`).
"""

from rlnb.rewards._combine import BadValue, Rewards, Scored, batched, per_function, raised_by, reward_value
from rlnb.rewards._isolation import (
    Cancelled,
    IsolatedError,
    Scope,
    Workers,
    cancellable,
    current_scope,
    isolated,
    run_coroutine,
    scope_of,
)
from rlnb.rewards._ready import exact_match, length_penalty, math_answer, regex_format
from rlnb.rewards._trl import TrlReward, from_trl, is_trl_reward

__all__ = [
    "BadValue",
    "Cancelled",
    "IsolatedError",
    "Rewards",
    "Scope",
    "Scored",
    "TrlReward",
    "Workers",
    "batched",
    "cancellable",
    "current_scope",
    "exact_match",
    "from_trl",
    "is_trl_reward",
    "isolated",
    "length_penalty",
    "math_answer",
    "per_function",
    "raised_by",
    "regex_format",
    "reward_value",
    "run_coroutine",
    "scope_of",
]

"""verifiers environments as tasks (:meth:`rlnb.data.Task.from_verifiers`).

A verifiers environment (the Environments Hub's format: ``SingleTurnEnv``,
``MultiTurnEnv``, ``ToolEnv``, ... with a ``Rubric``) runs its own rollouts against
an OpenAI-compatible client. Here it becomes a task with an agent
(``Task(agent=...)``): its data set's rows are the task's records, and each sample
is an episode in which ``env.rollout`` talks to the policy through the session's
endpoint (the episode's client, wrapped in verifiers' own client), then the
environment's rubric scores it. The endpoint records every call, so the sample's
tokens are what was served (prompt and environment turns masked); verifiers' own
copy of them (``state["trajectory"]``) is not needed.

verifiers 0.3 (``>=0.3.1,<0.4``: the classic API; 0.4 keeps only ``verifiers.v1``)
is imported on first use, never by ``import rlnb`` (it takes seconds);
``scripts/setup-agents.sh`` installs it.
"""

from __future__ import annotations

import functools
import json
import logging
import signal
import threading
from collections.abc import Mapping
from typing import Any

from rlnb._errors import ConfigError, RolloutError
from rlnb.runtime import take_back_sigterm

__all__ = ["VerifiersAgent", "import_verifiers", "load"]

# What verifiers must ask of the endpoint for every call: without them it reads no
# token ids back (a trajectory step's tokens are then None), which rlnb does not need
# but the cross-check does; max_tokens and temperature are left to the rollouts'.
SAMPLING_ARGS: dict[str, Any] = {"logprobs": True, "extra_body": {"return_token_ids": True}}
# The columns of an environment's data set that a rollout's input takes.
COLUMNS = ("prompt", "answer", "info", "task", "example_id")


def import_verifiers() -> Any:
    """The ``verifiers`` module, with its classic API. ConfigError naming the fix when
    it is missing or a release without the classic environments."""
    try:
        import verifiers
    except ImportError as exc:
        raise ConfigError(
            f"Task.from_verifiers needs the verifiers package ({exc}): install it with "
            "scripts/setup-agents.sh (verifiers>=0.3.1,<0.4)"
        ) from None
    if not hasattr(verifiers, "SingleTurnEnv"):
        raise ConfigError(
            f"Task.from_verifiers needs verifiers' classic environments (SingleTurnEnv, Rubric, ...), which "
            f"verifiers {getattr(verifiers, '__version__', '?')} does not have: install verifiers>=0.3.1,<0.4 "
            "(scripts/setup-agents.sh)"
        )
    _keep_signal_handlers(verifiers)
    return verifiers


def _keep_signal_handlers(vf: Any) -> None:
    """Make verifiers' environments leave the process's SIGINT and SIGTERM handlers
    alone when they are made (each ``Environment.__post_init__`` puts in its own, to tear
    the environment down: Ctrl-C then ran that teardown in a notebook's every interrupt,
    and SIGTERM no longer closed rlnb's sessions). Its teardown still runs at exit."""
    cls = getattr(vf, "Environment", None)
    post_init = getattr(cls, "__post_init__", None)
    if post_init is None or getattr(post_init, "_rlnb_keeps_signals", False):
        return

    @functools.wraps(post_init)
    def kept(self: Any, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return post_init(self, *args, **kwargs)
        saved = [(sig, signal.getsignal(sig)) for sig in (signal.SIGINT, signal.SIGTERM)]
        try:
            return post_init(self, *args, **kwargs)
        finally:
            for sig, handler in saved:
                if handler is not None:
                    signal.signal(sig, handler)

    kept._rlnb_keeps_signals = True  # type: ignore[attr-defined]
    cls.__post_init__ = kept  # type: ignore[union-attr]


def _take_back_signal_handlers() -> None:
    """Undo what an environment made before rlnb imported verifiers did to the
    process's signal handlers (see :func:`_keep_signal_handlers`): Python's Ctrl-C
    again, and rlnb's SIGTERM, which closes the sessions."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(sig)
        if getattr(handler, "__qualname__", "").startswith("Environment.__post_init__"):
            if sig == signal.SIGINT:
                signal.signal(sig, signal.default_int_handler)
            else:
                take_back_sigterm()


def _message(message: Any) -> dict[str, Any]:
    """A chat message as plain JSON: a data set's rows may carry a key of another
    message as None (Arrow gives every row of a column the same fields)."""
    return {k: v for k, v in dict(message).items() if v is not None}


def _record(row: Mapping[str, Any], index: int) -> dict[str, Any]:
    prompt = row.get("prompt")
    if isinstance(prompt, list | tuple):
        prompt = [_message(m) for m in prompt]
    record = {"prompt": prompt, "answer": row.get("answer") or "", "example_id": row.get("example_id", index)}
    for key in ("info", "task"):
        if row.get(key) is not None:
            record[key] = row[key]
    return record


def _group_reward_funcs(rubric: Any) -> list[Any]:
    """The reward functions of ``rubric`` that score a whole group (a RubricGroup's too)."""
    found = list(getattr(rubric, "_get_group_reward_funcs", list)())
    for inner in getattr(rubric, "rubrics", None) or ():
        found += _group_reward_funcs(inner)
    return found


class _Handled(logging.Filter):
    """Drops verifiers' "Aborted rollout due to ..." line: rlnb handles every such
    rollout itself (an empty reply is a counted 0.0, anything else a RolloutError
    naming it), and an untrained policy's empty replies printed one a sample to stderr."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Aborted rollout due to")


class VerifiersAgent:
    """The agent of a task made by :meth:`Task.from_verifiers`: one ``env.rollout``
    per episode through the episode's client, scored by ``env.rubric``; returns the
    reward. An episode that verifiers ended on an error not of the policy's making
    (the endpoint refused a call, the conversation grew past the context, an
    environment's sandbox failed) raises RolloutError naming it: its 0.0 would train as
    if the policy had answered wrong. An empty or unreadable reply is the policy's own
    (reward 0.0, trained); a tool call that failed is scored by the rubric as it went."""

    def __init__(self, env: Any, *, name: str, sampling_args: Mapping[str, Any]) -> None:
        logger = getattr(env, "logger", None)
        if isinstance(logger, logging.Logger) and not any(isinstance(f, _Handled) for f in logger.filters):
            logger.addFilter(_Handled())
        self.env = env
        self.name = name
        self.sampling_args = dict(sampling_args)
        self.__qualname__ = f"verifiers:{name}"  # how a failure names the agent
        self.about = f"verifiers {type(env).__name__} {name!r}"

    async def __call__(self, client: Any, row: Mapping[str, Any]) -> float:
        vf = import_verifiers()
        rollout_input: dict[str, Any] = {
            "prompt": row["prompt"],
            "answer": row.get("answer", ""),
            "example_id": row.get("example_id", row.get("prompt_id", 0)),
        }
        for key in ("info", "task"):
            if row.get(key) is not None:
                rollout_input[key] = row[key]
        env, rubric = self.env, self.env.rubric
        state = await env.rollout(rollout_input, vf.OpenAIChatCompletionsClient(client), self.name, self.sampling_args)
        try:
            error = state.get("error")
            if isinstance(error, vf.InvalidModelResponseError):
                # The policy's own reply was empty or unreadable: the endpoint served it and
                # it is the sample, a wrong answer; the rubric would only fail on no reply.
                return 0.0
            if (error is not None and not isinstance(error, vf.ToolError)) or state.get("prompt_too_long"):
                why = repr(error) if error is not None else "the conversation grew past the model's context"
                cause = getattr(error, "__cause__", None)
                raise RolloutError(
                    f"the verifiers environment {self.name!r} ended its rollout on an error: {why}"
                    f"{f' (caused by {cause!r})' if cause is not None else ''}; its reward would be a silent 0.0, "
                    "so the sample is not trained on (the endpoint's calls: sess.serve().log())"
                )
            await rubric.score_rollout(state)  # a tool's error was the policy's call: scored as it went
        finally:
            await rubric.cleanup(state)
        return float(state["reward"])


def load(
    env: Any, *, name: str | None, env_args: Mapping[str, Any] | None, sampling_args: Mapping[str, Any] | None
) -> tuple[str, list[dict[str, Any]], VerifiersAgent]:
    """What :meth:`Task.from_verifiers` (which documents it) makes a task of: the task's
    name, the environment's rows as records, and the agent that rolls them out."""
    vf = import_verifiers()
    _take_back_signal_handlers()  # an environment made before verifiers came through rlnb
    if isinstance(env, str):
        env_id = env
        try:
            env = vf.load_environment(env_id, **dict(env_args or {}))
        except (ImportError, ValueError) as exc:  # verifiers wraps a missing module in a ValueError
            raise ConfigError(
                f"Task.from_verifiers({env_id!r}) is invalid: verifiers could not load it ({exc}); install the "
                "environment's package (its module is the id with '-' as '_') or pass the environment itself"
            ) from None
        name = name or env_id.split("/")[-1]
    elif env_args:
        raise ConfigError(
            "Task.from_verifiers(env_args=...) is for a Hub id (a string): an environment object is already made"
        )
    if not isinstance(env, vf.Environment):
        raise ConfigError(
            f"Task.from_verifiers(env={env!r}) is invalid: pass a verifiers Environment (vf.SingleTurnEnv(...), "
            "vf.ToolEnv(...), ...) or the id of an installed Hub environment, e.g. 'vf-reverse-text'"
        )
    group = [getattr(f, "__name__", repr(f)) for f in _group_reward_funcs(env.rubric)]
    if group:
        raise ConfigError(
            f"Task.from_verifiers: the rubric's reward functions {group} score a whole group (they take "
            "'completions', 'states', ...), but each rlnb sample is scored on its own: write them per rollout"
        )
    name = name or getattr(env, "env_id", None) or type(env).__name__
    dataset = env.get_dataset()
    if dataset is None or len(dataset) == 0:
        raise ConfigError(f"Task.from_verifiers: the environment {name!r} has no rows to train on (env.get_dataset())")
    records = [_record(row, i) for i, row in enumerate(dataset)]
    for record in records:  # the records are copied as JSON: info may be a JSON string or a dict
        if isinstance(record.get("info"), str):
            try:
                record["info"] = json.loads(record["info"])
            except ValueError:
                pass
    agent = VerifiersAgent(env, name=name, sampling_args={**SAMPLING_ARGS, **dict(sampling_args or {})})
    return name, records, agent

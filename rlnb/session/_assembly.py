"""How each part of a session is made from a :class:`~rlnb.Config`.

The session decides the order, owns what these return and registers each close;
these functions only translate config fields into constructor arguments, so the
composition root reads as a list of stages.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from rlnb._errors import CheckpointError, ConfigError
from rlnb._files import check_run_dir_free
from rlnb._samples import PromptItem, Sample
from rlnb.buffer import ReplayBuffer
from rlnb.config import Config, LearnConfig, ModelConfig, engine_kind
from rlnb.data import Task
from rlnb.engines import Engine, SamplingParams
from rlnb.rewards import Rewards, Scored
from rlnb.rollout import Agents, Conversations, Rollouter, Serving

if TYPE_CHECKING:
    from rlnb.data import PromptLoader
    from rlnb.learn import Callback, Learner, Trainer
    from rlnb.models import CharTokenizer, HFTokenizer

    Tokenizer: TypeAlias = CharTokenizer | HFTokenizer
    from rlnb.runtime import AsyncBridge
    from rlnb.track import Tracker

__all__ = [
    "check_session_args",
    "load_checkpoint",
    "make_buffer",
    "make_engine",
    "make_learner",
    "make_loader",
    "make_rollouter",
    "make_tracker",
    "make_trainer",
    "reward_functions",
    "sampling_params",
]


def check_session_args(config: Config | None, name: Any, engine: Any, callbacks: Any = ()) -> Config:
    """``Session``'s own arguments, checked before anything is built or replaced."""
    if config is None:
        config = Config()
    if not isinstance(config, Config):
        raise ConfigError(
            f"Session(config=...) takes a rlnb.Config, got {type(config).__name__}: build one with rlnb.Config(...)"
        )
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"Session(name={name!r}) is invalid: use a non-empty string, e.g. name='demo'")
    check_run_dir_free(config.track.run_dir, name)  # before the live session called `name` is replaced
    if config.model.path is not None:  # a config is checked without torch: the device is checked here
        from rlnb.models import check_device

        check_device(config.model.device)
    if engine is not None and not isinstance(engine, Engine):
        raise ConfigError(
            f"Session(engine={type(engine).__name__}) is invalid: pass an object with the rlnb.engines.Engine "
            "methods (generate, abort, pause, resume, update_weights, statistics, close), or None"
        )
    if isinstance(callbacks, (str, bytes)) or not isinstance(callbacks, Sequence):
        raise ConfigError(f"Session(callbacks={callbacks!r}) is invalid: use a list of rlnb.learn.Callback objects")
    for callback in callbacks:
        if not all(callable(getattr(callback, hook, None)) for hook in ("on_batch", "on_step_end")):
            raise ConfigError(
                f"Session(callbacks=[..., {callback!r}, ...]) is invalid: each callback needs on_batch(groups) "
                "and on_step_end(metrics) methods; subclass rlnb.learn.Callback and override the ones you need"
            )
    return config


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    reward: Any,
    model_path: str | os.PathLike[str] | None,
    device: str | None,
    algorithm: Any = None,
    ranks: int | None = None,
) -> tuple[Config, tuple[dict[str, Any], dict[str, Any], Path]]:
    """``Session.load``'s checkpoint: its config, with ``model_path``, ``device``,
    ``algorithm`` and ``ranks`` in place of the saved ones, and what the session
    restores; all checked first."""
    from rlnb import checkpoint

    changes: dict[str, Any] = {"path": None if model_path is None else os.fspath(model_path), "device": device}
    changes = {field: value for field, value in changes.items() if value is not None}
    for field, value in changes.items():  # each value alone, before anything is read
        try:
            ModelConfig(path="DIR").replace(**{field: value})
        except ConfigError as exc:
            raise ConfigError(f"Session.load({'model_path' if field == 'path' else field}={value!r}): {exc}") from None
    if reward is not None and not callable(reward):
        raise CheckpointError(
            f"Session.load(reward={reward!r}): pass the reward function, (completion, answer) -> float"
        )
    learn = None
    if algorithm is not None:
        try:
            LearnConfig(algorithm=algorithm)
        except ConfigError as exc:
            raise ConfigError(f"Session.load(algorithm={algorithm!r}): {exc}") from None
        learn = {"algorithm": algorithm}
    if ranks is not None:
        try:
            LearnConfig(ranks=ranks)
        except ConfigError as exc:
            raise ConfigError(f"Session.load(ranks={ranks!r}): {exc}") from None
        learn = {**(learn or {}), "ranks": ranks}
    manifest, tensors = checkpoint.read(path, model=changes, learn=learn)
    saved = manifest.get("reward")
    if saved is not None and reward is None:
        raise CheckpointError(
            f"{path} was saved with a custom reward function ({saved}, from set_reward()); a checkpoint "
            f"holds no code: pass it again, rlnb.Session.load({str(path)!r}, reward={saved.split('.')[-1]})"
        )
    config = checkpoint.saved_config(manifest, path)
    if config.model.path is not None and device is None:
        from rlnb.models import check_device

        try:
            check_device(config.model.device)
        except ConfigError as exc:
            hint = f"to load it on this machine's CPU: rlnb.Session.load({str(path)!r}, device='cpu')"
            raise ConfigError(f"{path}: {exc}; {hint}") from None
    return config, (manifest, tensors, Path(path))


def make_loader(config: Config, task: Task, state: dict[str, Any] | None) -> PromptLoader:
    from rlnb.data import PromptLoader

    return PromptLoader(task, config.data, seed=config.seed, state=state)


def make_tracker(config: Config, *, name: str, run_id: str | None) -> Tracker:
    from rlnb import checkpoint
    from rlnb.track import Tracker

    track = dataclasses.replace(config.track, run_id=run_id)  # a loaded checkpoint's, or the config's
    return Tracker(track, name=name, run_config=checkpoint.config_to_dict(config))


def make_buffer(config: Config) -> ReplayBuffer:
    return ReplayBuffer(config.buffer)


def make_learner(config: Config, model: ModelConfig, tokenizer: Tokenizer, *, name: str = "rlnb") -> Learner:
    """The learner: in this process, or with ``LearnConfig.ranks`` > 1 a
    ``RankedLearner`` whose ranks have started (Ray actors; close it to end them)."""
    from rlnb.learn import Learner
    from rlnb.models import TinyPolicy, load_hf_model

    policy = TinyPolicy(model, seed=config.seed) if model.path is None else load_hf_model(model, seed=config.seed)
    kwargs: dict[str, Any] = {
        "encode": functools.partial(tokenizer.encode, bos=True),
        "encode_target": tokenizer.encode,
        "encode_observation": tokenizer.encode_observation,
        "pad_id": tokenizer.PAD,
        "eos_id": tokenizer.EOS,
        "config": dataclasses.replace(config.learn, threads=learner_threads(config)),
    }
    if config.learn.ranks == 1:
        return Learner(policy, **kwargs)
    from rlnb.learn import RankedLearner

    return RankedLearner.start(
        policy,
        ranks=config.learn.ranks,
        ray=config.ray,
        name=name,
        log_dir=ray_log_dir(config),
        threads=config.learn.threads or 1,
        **kwargs,
    )


def ray_log_dir(config: Config) -> str | None:
    """Where a local Ray cluster of the session keeps its logs: ``RayConfig.log_dir``,
    else ``<run_dir>/ray`` with a run dir, else Ray's default (None)."""
    if config.ray.log_dir is None and config.track.run_dir is not None:
        return str(Path(config.track.run_dir) / "ray")
    return config.ray.log_dir


def learner_threads(config: Config) -> int | None:
    """``LearnConfig.threads``, or what None means (see its documentation): in async
    mode with the engine on this machine's CPU, torch's threads less the engine's."""
    import torch

    if config.learn.threads is not None:
        return config.learn.threads
    ray = config.ray
    local_engine = engine_kind(config) != "vllm" and (not ray.engine_replicas or ray.address is None)
    if config.mode != "async" or not local_engine or config.model.device != "cpu" or ray.num_gpus > 0:
        return None
    engine_threads = config.engine.threads * max(1, ray.engine_replicas)
    return max(1, torch.get_num_threads() - engine_threads)


def make_engine(config: Config, learner: Learner, tokenizer: Tokenizer, *, name: str, bridge: AsyncBridge) -> Engine:
    """The engine ``config`` asks for. vLLM starts on the session's bridge loop, which
    drives it from then on (its processes are checked and refused before any starts)."""
    from rlnb.engines import TinyEngine

    e, replicas = config.engine, config.ray.engine_replicas
    vllm: dict[str, Any] | None = None  # VLLMEngine.start's arguments, here or in each Ray replica
    if engine_kind(config) == "vllm":
        vllm = {
            "model": config.model,
            "config": e,
            "eos_id": tokenizer.EOS,
            "seed": config.seed,
            "name": f"{name}-replica" if replicas else name,
        }
    if vllm is not None and not replicas:
        from rlnb.engines import VLLMEngine

        engine: Engine = bridge.run(VLLMEngine.start(**vllm), timeout=_VLLM_START_TIMEOUT)
        return engine
    if replicas:
        from rlnb.engines import RayEngine

        return RayEngine.start(
            learner.serving_policy(),
            config.ray,
            engine=e,
            eos_id=tokenizer.EOS,
            name=name,
            log_dir=ray_log_dir(config),
            vllm=vllm,
        )
    # The engine copies the policy as it serves it (with LoRA: merged, without adapters).
    if e.process:
        from rlnb.engines import ProcessEngine

        return ProcessEngine.start(learner.serving_policy(), e, eos_id=tokenizer.EOS, name=name)
    return TinyEngine(learner.serving_policy(), e, eos_id=tokenizer.EOS, name=name)


_VLLM_START_TIMEOUT = 600.0  # seconds: about 15 on an idle CPU, a minute on a busy one


def reward_functions(
    rewards: Rewards,
) -> tuple[Callable[[PromptItem, str], Scored], Callable[[PromptItem, list[Sample]], list[Scored]] | None]:
    """The rollouter's reward functions for ``rewards`` (a task's, with the config's
    weights): one that scores each sample, and one that scores each group with the
    batched functions once its samples are done (None without batched ones)."""

    def score(item: PromptItem, completion: str, env_reward: float | None = None) -> Scored:
        return rewards.score(completion, item.answer, prompt=item.prompt, row=item.row, env_reward=env_reward)

    def score_group(item: PromptItem, samples: list[Sample]) -> list[Scored]:
        return rewards.score_group(
            [s.rewards for s in samples],
            [s.completion for s in samples],
            [item.answer] * len(samples),
            [item.prompt] * len(samples),
            [item.row] * len(samples),
            [s.env_reward for s in samples],
            completion_ids=[s.token_ids for s in samples],
            prompt_messages=[item.messages] * len(samples),
        )

    return score, score_group if rewards.has_batched else None


def make_rollouter(
    config: Config,
    task: Task,
    tokenizer: Tokenizer,
    *,
    engine: Engine,
    prompts: PromptLoader,
    buffer: ReplayBuffer,
    agent_client: Callable[[bool], tuple[Any, Callable[[], Any]]],
    agent_address: Callable[[str], tuple[str, str]],
) -> Rollouter:
    """The rollouter; ``agent_client(sync)`` and ``agent_address(episode)`` give a task's
    agent its episodes' clients of the session's endpoint (:class:`~rlnb.rollout.Agents`)."""
    r = config.rollout
    reward_fn, group_reward_fn = reward_functions(task.rewards.with_weights(r.reward_weights))
    return Rollouter(
        engine,
        r,
        sampling=sampling_params(config, task),
        prompts=prompts,
        encode=lambda text: tokenizer.encode(text, bos=True),
        decode=tokenizer.decode,
        reward_fn=reward_fn,
        group_reward_fn=group_reward_fn,
        buffer=buffer,
        seed=config.seed,
        data=config.data,
        max_context=config.model.max_len,
        conversations=conversations(task, tokenizer),
        serving=Serving(
            encode_prompt=_prompt_encoder(tokenizer),
            encode_observation=tokenizer.encode_observation,
            syntax="json" if getattr(tokenizer, "chat", False) else "call",
        ),
        agents=None if task.agent is None else Agents(task.agent, agent_client, agent_address, task.agent_timeout),
    )


def _prompt_encoder(tokenizer: Tokenizer) -> Callable[[Any, list[dict[str, Any]] | None], list[int]]:
    """A prompt's ids, with the tools' schemas where a chat template describes them."""

    def encode_prompt(prompt: Any, tools: list[dict[str, Any]] | None) -> list[int]:
        if tools and getattr(tokenizer, "chat", False):
            encode: Any = tokenizer.encode
            return list(encode(prompt, bos=True, tools=tools))
        return tokenizer.encode(prompt, bos=True)

    return encode_prompt


def conversations(task: Task, tokenizer: Tokenizer) -> Conversations | None:
    """How the rollouter turns samples into conversations with ``task.env``; None without one."""
    if task.env is None:
        return None
    return Conversations(
        env=task.env,
        max_turns=task.max_turns,
        encode_prompt=_prompt_encoder(tokenizer),
        encode_observation=tokenizer.encode_observation,
    )


def sampling_params(config: Config, task: Task) -> SamplingParams:
    """How rollouts sample, from ``config.rollout`` (``max_new_tokens`` None: the task's)."""
    r = config.rollout
    return SamplingParams(
        temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens or task.max_new_tokens
    )


def make_trainer(
    config: Config,
    task: Task,
    learner: Learner,
    rollouter: Rollouter,
    buffer: ReplayBuffer,
    bridge: AsyncBridge,
    tracker: Tracker,
    *,
    name: str,
    callbacks: Sequence[Callback],
    restore: tuple[dict[str, Any], dict[str, Any], Path] | None,
    sync: bool,
) -> Trainer:
    """The trainer over the built parts; a checkpoint being loaded (``restore``) is
    applied to them, and with ``sync`` a caller's engine gets the policy's weights."""
    from rlnb import checkpoint
    from rlnb.learn import Trainer

    trainer = Trainer(
        learner=learner,
        rollouter=rollouter,
        buffer=buffer,
        bridge=bridge,
        tracker=tracker,
        task=task,
        config=config,
        name=name,
        callbacks=callbacks,
    )
    if restore is not None:
        checkpoint.restore(trainer, *restore)
    elif sync:
        trainer.sync_weights()
    return trainer

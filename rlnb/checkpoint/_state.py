"""What of a session goes into a checkpoint (:func:`capture`), how it is saved with
rollouts quiesced (:func:`save`), read back and checked (:func:`read`), and applied to
a freshly built session (:func:`restore`)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlnb._errors import CheckpointError
from rlnb._files import as_path
from rlnb.checkpoint._format import (
    flatten_optimizer,
    read_files,
    target_dir,
    unflatten_optimizer,
    with_prompt_ids,
    write,
)
from rlnb.checkpoint._validate import check, python_rng, vocabulary
from rlnb.config import Change, config_to_dict

if TYPE_CHECKING:
    from rlnb.data import PromptLoader
    from rlnb.learn import Trainer


def read(
    path: str | os.PathLike[str], *, model: dict[str, Any] | None = None, learn: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The manifest and tensors of the checkpoint at ``path``, every file verified and
    everything :func:`restore` applies checked against the saved config (:func:`check`),
    its ``ModelConfig`` fields replaced by ``model``'s first (``Session.load``'s
    ``model_path`` and ``device``) and its ``LearnConfig`` fields by ``learn``'s (its
    ``algorithm``). Never unpickles: tensors are read with safetensors only."""
    manifest, tensors = read_files(path, model=model, learn=learn)
    check(manifest, tensors, as_path(path, call="Session.load", argument="path"))
    return manifest, tensors


def capture(
    trainer: Trainer, *, prompts: PromptLoader, name: str, run_id: str | None, reward: str | None = None
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The manifest and tensors of a checkpoint of the session ``trainer`` trains.

    Call it with rollouts quiesced (``trainer.quiesced()``): the buffer then holds
    only whole groups and nothing changes underneath. ``prompts`` is the session's
    prompt loader (only the bridge loop's thread touches it). Raises
    :class:`CheckpointError` when a prompt's answer or a sample is not JSON data.
    """
    import torch

    from rlnb import __version__
    from rlnb.models import model_shape

    learner, rollouter = trainer.learner, trainer.rollouter

    async def loader_state() -> dict[str, Any]:
        return prompts.state_dict()

    manifest: dict[str, Any] = {
        "rlnb": __version__,
        "name": name,
        "config": config_to_dict(trainer.config),
        "step": learner.version,
        "warmup_steps": trainer.warmup_stage.steps,
        "loader": trainer.bridge.run(loader_state()),
        "returned_prompts": [[i.prompt_id, i.prompt, i.answer] for i in rollouter.returned_prompts],
        "buffer": trainer.buffer.state_dict(),
        "python_rng": random.getstate(),  # JSON makes its tuples lists
        "tracker": {"run_id": run_id},
        "reward": reward,  # the name of a custom reward in force (its code is not saved)
        "changes": [change.as_dict() for change in trainer.changes],  # live settings changed (Session.set)
        "vocabulary": vocabulary(model_shape(trainer.config, trainer.task)[0]),  # what each token id means
        "data": trainer.task.fingerprint(),  # what it trained on: for records, their count and hash
    }
    tensors: dict[str, dict[str, Any]] = {
        "model": learner.model_state(),  # with LoRA, the adapter only: the model's own weights never change
        "rng": {"torch": torch.get_rng_state()},
    }
    tensors["optimizer"], manifest["optimizer"] = flatten_optimizer(learner.optimizer.state_dict())
    if trainer.warmup_stage.optimizer is not None:
        tensors["warmup_optimizer"], manifest["warmup_optimizer"] = flatten_optimizer(
            trainer.warmup_stage.optimizer.state_dict()
        )
    if learner.reference is not None:
        tensors["reference"] = learner.reference.state_dict()
    if learner.critic is not None:  # advantage="gae"'s value model, its head and its optimiser
        critic = learner.critic.state()
        tensors["critic"] = {
            **{f"model.{k}": v for k, v in critic["model"].items()},
            **{f"head.{k}": v for k, v in critic["head"].items()},
        }
        tensors["critic_optimizer"], manifest["critic_optimizer"] = flatten_optimizer(critic["optimizer"])
        manifest["critic"] = learner.critic.kind
    try:
        json.dumps(manifest)
    except TypeError as exc:
        raise CheckpointError(
            f"cannot save: a prompt's answer or a sample is not JSON-serialisable ({exc}); "
            "make the task's answers JSON data (str, int, list, dict)"
        ) from exc
    return manifest, tensors


def save(
    trainer: Trainer,
    path: str | os.PathLike[str],
    *,
    prompts: PromptLoader,
    name: str,
    run_id: str | None,
    reward: str | None = None,
) -> Path:
    """Write a checkpoint of the session ``trainer`` trains to ``path``: rollouts are
    quiesced (in-flight generations finish into the buffer), captured, written, and
    left as they were. Returns the path. A path it cannot save to is refused first."""
    target_dir(path)
    with trainer.quiesced():
        manifest, tensors = capture(trainer, prompts=prompts, name=name, run_id=run_id, reward=reward)
        return write(path, manifest, tensors)


def restore(trainer: Trainer, manifest: dict[str, Any], tensors: dict[str, Any], root: Path) -> None:
    """Apply a checkpoint read from ``root`` to the freshly built session ``trainer``
    trains (its prompt loader and tracker were built from the manifest already).

    Raises :class:`CheckpointError` naming the part that does not fit.
    """
    import torch

    from rlnb._samples import PromptItem

    learner, rollouter = trainer.learner, trainer.rollouter
    try:  # check() found that it fits: this is for what it cannot foresee
        learner.load_model_state(tensors["model"])
        learner.optimizer.load_state_dict(unflatten_optimizer(tensors["optimizer"], manifest["optimizer"]))
        warmup_state = None
        if "warmup_optimizer" in tensors:
            warmup_state = unflatten_optimizer(tensors["warmup_optimizer"], manifest["warmup_optimizer"])
        trainer.warmup_stage.restore(int(manifest["warmup_steps"]), warmup_state)
        if learner.reference is not None:
            learner.reference.load_state_dict(tensors["reference"])
        _restore_critic(learner, manifest, tensors)
        buffer = manifest["buffer"]
        if manifest["format_version"] == 1:  # groups saved without their prompts' token ids
            buffer = with_prompt_ids(buffer, learner.encode)
        trainer.buffer.load_state_dict(buffer)
        learner.version = int(manifest["step"])
        rollouter.give_back([PromptItem(*item) for item in manifest["returned_prompts"]])
        trainer.changes[:] = [Change.from_dict(c) for c in manifest.get("changes") or ()]
    except (RuntimeError, KeyError, ValueError, TypeError, AttributeError, IndexError) as exc:
        raise CheckpointError(f"{root}: the saved state does not fit this session ({exc})") from exc
    trainer.sync_weights()
    torch.set_rng_state(tensors["rng"]["torch"])
    random.setstate(python_rng(manifest["python_rng"]))


def _restore_critic(learner: Any, manifest: dict[str, Any], tensors: dict[str, Any]) -> None:
    """The saved critic, or, for a checkpoint without one loaded with an algorithm that
    needs one, a new critic made from the loaded policy (not the initial one)."""
    if "critic" not in tensors:
        if learner.critic is not None:
            learner.critic = None
            learner.ensure_critic()
        return
    saved = tensors["critic"]
    critic = learner.ensure_critic(manifest.get("critic", "model"))
    critic.load_state(
        {
            "model": {k.removeprefix("model."): v for k, v in saved.items() if k.startswith("model.")},
            "head": {k.removeprefix("head."): v for k, v in saved.items() if k.startswith("head.")},
            "optimizer": unflatten_optimizer(tensors["critic_optimizer"], manifest["critic_optimizer"]),
        }
    )

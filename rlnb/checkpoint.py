"""Checkpoints: a directory of safetensors files and one JSON file; nothing is pickled.

Layout of ``sess.save(path)``::

    path/checkpoint.json           format, config, step, prompt-loader state, buffer
                                   (groups with their tokens and log-probs), prompts
                                   given back by an interrupted rollout, Python RNG
                                   state, tracker run id, SHA-256 of every file below
    path/model.safetensors         the policy
    path/optimizer.safetensors     AdamW's moments (its hyper-parameters are in the JSON)
    path/warmup_optimizer.safetensors, path/reference.safetensors   when they exist
    path/rng.safetensors           torch's CPU generator state

Loading checks the format and every checksum before building anything, so a
damaged or mismatched checkpoint gets a :class:`CheckpointError` naming the file
and what is wrong with it, not a shape error from deep inside torch.

:func:`capture` says what of a session goes into a checkpoint and :func:`restore`
how it is applied to a freshly built one; :func:`write` and :func:`read` put it on
disk and take it back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlnb._errors import CheckpointError, ConfigError
from rlnb.config import PARTS, RENAMED, Config

if TYPE_CHECKING:
    from rlnb.data import PromptLoader
    from rlnb.learn import Trainer

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "capture",
    "check_reward",
    "config_from_dict",
    "config_to_dict",
    "read",
    "restore",
    "save",
    "saved_config",
    "write",
]

FORMAT = "rlnb-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "checkpoint.json"


def config_to_dict(config: Config) -> dict[str, Any]:
    """``config`` as JSON-safe data (tuples become lists)."""
    return dataclasses.asdict(config)


def config_from_dict(data: dict[str, Any]) -> Config:
    """The :class:`Config` of :func:`config_to_dict`; ConfigError for unknown fields.
    Fields renamed since the config was saved are read under their new names."""
    data = dict(data)
    parts = {}
    for field, cls in PARTS.items():
        values = dict(data.pop(field, {}))
        for old, new in RENAMED.get(cls.__name__, {}).items():
            if old in values and new not in values:
                values[new] = values.pop(old)
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(values) - set(known)
        if unknown:
            raise ConfigError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
        for name, value in values.items():
            if isinstance(value, list):  # JSON has no tuples
                values[name] = tuple(value)
        parts[field] = cls(**values)
    unknown = set(data) - {f.name for f in dataclasses.fields(Config)}
    if unknown:
        raise ConfigError(f"Config has no field(s) {sorted(unknown)}")
    return Config(**data, **parts)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def flatten_optimizer(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """AdamW's state_dict as (tensors for safetensors, the rest for JSON)."""
    import torch

    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for index, per_param in state["state"].items():
        for key, value in per_param.items():
            name = f"state.{index}.{key}"
            if isinstance(value, torch.Tensor):
                tensors[name] = value.detach().contiguous()
            else:
                scalars[name] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def unflatten_optimizer(tensors: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for name, value in [*tensors.items(), *meta["scalars"].items()]:
        _, index, key = name.split(".", 2)
        state.setdefault(int(index), {})[key] = value
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def write(path: str | os.PathLike[str], manifest: dict[str, Any], tensors: dict[str, dict[str, Any]]) -> Path:
    """Write ``tensors`` (file stem -> state dict) and ``manifest`` into ``path``.

    Written to a temporary directory beside it first and then moved into place,
    so an interrupted save never leaves a half-written checkpoint under ``path``.
    An existing checkpoint at ``path`` is replaced; any other non-empty directory
    or a file there is an error.
    """
    from safetensors.torch import save_file

    target = Path(path)
    if target.exists():
        if not target.is_dir():
            raise CheckpointError(f"cannot save a checkpoint to {target}: it is a file; choose a directory path")
        if any(target.iterdir()) and not (target / MANIFEST).exists():
            raise CheckpointError(
                f"cannot save a checkpoint to {target}: it is a non-empty directory that holds no checkpoint; "
                "choose a new or empty directory"
            )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    try:
        files = {}
        for stem, state in tensors.items():
            name = f"{stem}.safetensors"
            save_file({k: v.detach().contiguous() for k, v in state.items()}, str(staging / name))
            files[name] = _sha256(staging / name)
        manifest = {**manifest, "format": FORMAT, "format_version": FORMAT_VERSION, "files": files}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
        for file in staging.iterdir():  # mkdtemp and safetensors make them private
            file.chmod(0o666 & ~umask)
        staging.chmod(0o777 & ~umask)
        if target.exists():
            old = target.with_name(f".{target.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            target.rename(old)
            staging.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def read(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The manifest and tensors of the checkpoint at ``path``, every file verified."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(path)
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"no checkpoint at {root}: {MANIFEST} is missing (save one with sess.save(path))")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{manifest_path} is damaged: not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path} is not an rlnb checkpoint manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{root} has checkpoint format version {manifest.get('format_version')!r}; this rlnb "
            f"reads version {FORMAT_VERSION}: load it with the rlnb version that saved it "
            f"({manifest.get('rlnb', 'unknown')})"
        )
    tensors: dict[str, dict[str, Any]] = {}
    for name, expected in manifest["files"].items():
        file = root / name
        if not file.is_file():
            raise CheckpointError(f"{root} is incomplete: {name} is missing")
        if _sha256(file) != expected:
            raise CheckpointError(f"{file} is damaged: its SHA-256 does not match the one saved in {MANIFEST}")
        try:
            tensors[name.removesuffix(".safetensors")] = load_file(str(file))
        except SafetensorError as exc:
            raise CheckpointError(f"{file} is damaged: {exc}") from exc
    return manifest, tensors


def python_rng_state() -> list[Any]:
    version, state, gauss = random.getstate()
    return [version, list(state), gauss]


def set_python_rng_state(saved: list[Any]) -> None:
    version, state, gauss = saved
    random.setstate((version, tuple(state), gauss))


@contextlib.contextmanager
def mismatch(what: str, root: Path) -> Any:
    """Turn a load error into a CheckpointError that says which part did not fit."""
    try:
        yield
    except (RuntimeError, KeyError, ValueError) as exc:
        raise CheckpointError(f"{root}: the saved {what} does not fit this session ({exc})") from exc


# -- what a session's checkpoint holds -----------------------------------------------------


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
        "python_rng": python_rng_state(),
        "tracker": {"run_id": run_id},
        "reward": reward,  # the name of a custom reward in force (its code is not saved)
    }
    tensors: dict[str, dict[str, Any]] = {
        "model": learner.policy.state_dict(),
        "rng": {"torch": torch.get_rng_state()},
    }
    tensors["optimizer"], manifest["optimizer"] = flatten_optimizer(learner.optimizer.state_dict())
    if trainer.warmup_stage.optimizer is not None:
        tensors["warmup_optimizer"], manifest["warmup_optimizer"] = flatten_optimizer(
            trainer.warmup_stage.optimizer.state_dict()
        )
    if learner.reference is not None:
        tensors["reference"] = learner.reference.state_dict()
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
    left as they were. Returns the path."""
    with trainer.quiesced():
        manifest, tensors = capture(trainer, prompts=prompts, name=name, run_id=run_id, reward=reward)
        return write(path, manifest, tensors)


def check_reward(manifest: dict[str, Any], path: str | os.PathLike[str], *, given: Any) -> None:
    """A checkpoint saved with a custom reward loads only with a reward given again:
    otherwise the loaded session would silently score with the task's."""
    saved = manifest.get("reward")
    if saved is not None and given is None:
        raise CheckpointError(
            f"{path} was saved with a custom reward function ({saved}, from set_reward()); a checkpoint "
            f"holds no code: pass it again, rlnb.Session.load({str(path)!r}, reward={saved.split('.')[-1]})"
        )
    if given is not None and not callable(given):
        raise CheckpointError(
            f"Session.load(reward={given!r}): pass the reward function, (completion, answer) -> float"
        )


def saved_config(manifest: dict[str, Any], path: str | os.PathLike[str]) -> Config:
    """The config a checkpoint's manifest holds; :class:`CheckpointError` if it does not fit."""
    try:
        return config_from_dict(manifest["config"])
    except (ConfigError, TypeError, KeyError) as exc:
        raise CheckpointError(f"{path}: the saved config does not fit this rlnb ({exc})") from exc


def restore(trainer: Trainer, manifest: dict[str, Any], tensors: dict[str, Any], root: Path) -> None:
    """Apply a checkpoint read from ``root`` to the freshly built session ``trainer``
    trains (its prompt loader and tracker were built from the manifest already).

    Raises :class:`CheckpointError` naming the part that does not fit.
    """
    import torch

    from rlnb._samples import PromptItem

    learner, rollouter = trainer.learner, trainer.rollouter
    with mismatch("model", root):
        learner.policy.load_state_dict(tensors["model"])
    with mismatch("optimizer", root):
        learner.optimizer.load_state_dict(unflatten_optimizer(tensors["optimizer"], manifest["optimizer"]))
    warmup_state = None
    if "warmup_optimizer" in tensors:
        warmup_state = unflatten_optimizer(tensors["warmup_optimizer"], manifest["warmup_optimizer"])
    with mismatch("warm-up optimizer", root):
        trainer.warmup_stage.restore(int(manifest["warmup_steps"]), warmup_state)
    if learner.reference is not None:
        with mismatch("reference model", root):
            learner.reference.load_state_dict(tensors["reference"])
    with mismatch("buffer", root):
        trainer.buffer.load_state_dict(manifest["buffer"])
    learner.version = int(manifest["step"])
    rollouter.give_back([PromptItem(*item) for item in manifest["returned_prompts"]])
    trainer.sync_weights()
    torch.set_rng_state(tensors["rng"]["torch"])
    set_python_rng_state(manifest["python_rng"])

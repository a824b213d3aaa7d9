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
from typing import Any

from rlnb._errors import CheckpointError, ConfigError
from rlnb.config import PARTS, Config

__all__ = ["FORMAT", "FORMAT_VERSION", "config_from_dict", "config_to_dict", "read", "write"]

FORMAT = "rlnb-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "checkpoint.json"


def config_to_dict(config: Config) -> dict[str, Any]:
    """``config`` as JSON-safe data (tuples become lists)."""
    return dataclasses.asdict(config)


def config_from_dict(data: dict[str, Any]) -> Config:
    """The :class:`Config` of :func:`config_to_dict`; ConfigError for unknown fields."""
    data = dict(data)
    parts = {}
    for field, cls in PARTS.items():
        values = dict(data.pop(field, {}))
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

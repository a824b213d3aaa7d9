"""The checkpoint's files: a manifest (``checkpoint.json``) and safetensors files, each
verified by its SHA-256; written beside the target and swapped in, read back without
unpickling anything. What the manifest's entries mean is :mod:`._validate`'s and
:mod:`._state`'s business; this module knows the format and the files."""

from __future__ import annotations

import json
import os
import reprlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlnb._errors import CheckpointError, ConfigError
from rlnb._files import as_path, check_owned, clean_leftovers, save_place, sha256, write_dir
from rlnb.config import Config, SavedFunctionError, config_from_dict

FORMAT = "rlnb-checkpoint"
FORMAT_VERSION = 2
# The versions this rlnb reads. Version 1 saved buffer groups without their prompts'
# token ids: restore() makes them (with_prompt_ids), tokenising each prompt once.
READS = (1, 2)
MANIFEST = "checkpoint.json"
# The tensor files a checkpoint may hold (file stems); it always holds the first three.
STEMS = ("model", "optimizer", "rng", "warmup_optimizer", "reference", "critic", "critic_optimizer")


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


def _unshared(state: dict[str, Any]) -> dict[str, Any]:
    """``state``'s tensors, none sharing memory (as tied embeddings do): safetensors refuses that."""
    seen: set[int] = set()
    out = {k: v.detach().contiguous() for k, v in state.items()}
    for key, tensor in out.items():
        if (where := tensor.untyped_storage().data_ptr()) in seen:
            out[key] = tensor.clone()
        seen.add(where)
    return out


def write(path: str | os.PathLike[str], manifest: dict[str, Any], tensors: dict[str, dict[str, Any]]) -> Path:
    """Write ``tensors`` (file stem -> state dict) and ``manifest`` into ``path`` (``~``
    expanded; missing parents are made); returns it, absolute. Written beside it and
    swapped in (``rlnb._files``): a kill at any moment leaves the old or the new one,
    whole. Only a checkpoint there is replaced; anything else is refused, and every
    failure to write is a :class:`CheckpointError` naming the path and the cause."""
    from safetensors.torch import save_file

    target = target_dir(path)

    def fill(staging: Path) -> None:
        files = {}
        for stem, state in tensors.items():
            name = f"{stem}.safetensors"
            save_file(_unshared(state), str(staging / name))
            files[name] = sha256(staging / name)
        written = {**manifest, "format": FORMAT, "format_version": FORMAT_VERSION, "files": files}
        (staging / MANIFEST).write_text(json.dumps(written, indent=1))

    return write_dir(target, fill, "a checkpoint")


def target_dir(path: Any) -> Path:
    """``path`` as a place to save to: new, empty or a checkpoint (CheckpointError otherwise);
    what killed saves to it left is removed first."""
    target = save_place(path, "a checkpoint", call="Session.save", argument="path")
    clean_leftovers(target)
    check_owned(target, "a checkpoint", "checkpoint", _not_a_checkpoints)
    return target


def _not_a_checkpoints(root: Path) -> list[str] | None:
    """What ``root`` holds that no checkpoint does; None without a manifest."""
    if not (root / MANIFEST).is_file():
        return None
    ours = {MANIFEST, *(f"{stem}.safetensors" for stem in STEMS)}
    return sorted(repr(p.name + "/" * p.is_dir()) for p in root.iterdir() if p.name not in ours or p.is_dir())


def read_files(
    path: str | os.PathLike[str], *, model: dict[str, Any] | None = None, learn: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The manifest and tensors of the checkpoint at ``path``, every file verified, its
    ``ModelConfig`` fields replaced by ``model``'s (``Session.load``'s ``model_path`` and
    ``device``) and its ``LearnConfig`` fields by ``learn``'s (its ``algorithm``). Never
    unpickles: tensors are read with safetensors only."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = as_path(path, call="Session.load", argument="path")
    manifest_path = root / MANIFEST
    clean_leftovers(root)  # a killed save's; it may put the previous checkpoint back in place
    if root.is_file():
        raise CheckpointError(f"{root} is a file: pass the checkpoint's directory, the path given to sess.save(path)")
    if not manifest_path.is_file():
        raise CheckpointError(f"no checkpoint at {root}: {MANIFEST} is missing (save one with sess.save(path))")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{manifest_path} is damaged: not valid JSON ({exc})") from exc
    except OSError as exc:
        raise CheckpointError(f"cannot read {manifest_path}: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path} is not an rlnb checkpoint manifest")
    if manifest.get("format_version") not in READS:
        raise CheckpointError(
            f"{root} has checkpoint format version {manifest.get('format_version')!r}; this rlnb "
            f"reads versions {READS[0]} to {READS[-1]}: load it with the rlnb version that saved it "
            f"({manifest.get('rlnb', 'unknown')})"
        )
    saved = manifest.get("config")
    if model and isinstance(saved, dict) and isinstance(saved.get("model"), dict):
        if "path" in model and saved["model"].get("path") is None:
            raise ConfigError(
                f"Session.load(model_path=...): {root} holds the built-in policy, not a Hugging Face model"
            )
        manifest["config"] = {**saved, "model": {**saved["model"], **model}}
    saved = manifest.get("config")
    if learn and isinstance(saved, dict) and isinstance(saved.get("learn"), dict):
        manifest["config"] = {**saved, "learn": {**saved["learn"], **learn}}
    files, known = manifest.get("files") or {}, [f"{stem}.safetensors" for stem in STEMS]
    expect(
        isinstance(files, dict) and set(known[:3]) <= set(files) <= set(known),
        manifest_path,
        "files",
        files,
        f"a SHA-256 for each of {known[:3]} and at most {known[3:]}",
    )
    tensors: dict[str, dict[str, Any]] = {}
    for name, expected in files.items():
        file = root / name
        if not file.is_file():
            raise CheckpointError(f"{root} is incomplete: {name} is missing")
        try:
            if sha256(file) != expected:
                raise CheckpointError(f"{file} is damaged: its SHA-256 does not match the one saved in {MANIFEST}")
            tensors[name.removesuffix(".safetensors")] = load_file(str(file))
        except SafetensorError as exc:
            raise CheckpointError(f"{file} is damaged: {exc}") from exc
        except OSError as exc:
            raise CheckpointError(f"cannot read {file}: {exc}") from exc
    return manifest, tensors


def with_prompt_ids(buffer: dict[str, Any], encode: Callable[[str], list[int]]) -> dict[str, Any]:
    """A version-1 manifest's ``buffer`` entry as version 2 has it: each group with its
    prompt's token ids, ``encode(prompt)`` (what the rollouts gave the engine)."""
    partitions = {
        part: [{**group, "prompt_ids": encode(group["prompt"])} for group in groups]
        for part, groups in buffer["partitions"].items()
    }
    return {**buffer, "partitions": partitions}


def expect(ok: bool, where: Path, key: str, value: Any, want: str) -> None:
    if not ok:
        raise CheckpointError(
            f"{where} is damaged: {key} is {reprlib.repr(value)}, not {want}; it was edited or written by "
            "something else: restore it from a copy, or save the session again"
        )


def saved_config(manifest: dict[str, Any], path: str | os.PathLike[str]) -> Config:
    """The config a checkpoint's manifest holds; :class:`CheckpointError` if it does not fit."""
    try:
        return config_from_dict(manifest["config"])
    except SavedFunctionError as exc:  # not a misfit: the code has to be given again
        raise CheckpointError(f"{path}: {exc}") from exc
    except (ConfigError, TypeError, KeyError) as exc:
        raise CheckpointError(f"{path}: the saved config does not fit this rlnb ({exc})") from exc

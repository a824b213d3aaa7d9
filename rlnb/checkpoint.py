"""Checkpoints: a directory of safetensors files and one JSON file; nothing is pickled.

Layout of ``sess.save(path)``::

    path/checkpoint.json           format, config, step, prompt-loader state, buffer
                                   (groups with their tokens and log-probs), prompts
                                   given back by an interrupted rollout, Python RNG
                                   state, tracker run id, vocabulary (what each token
                                   id means), SHA-256 of every file below
    path/model.safetensors         the policy
    path/optimizer.safetensors     AdamW's moments (its hyper-parameters are in the JSON)
    path/warmup_optimizer.safetensors, path/reference.safetensors   when they exist
    path/rng.safetensors           torch's CPU generator state

Loading checks the format, every checksum and every entry against the saved config
before building anything: a damaged or mismatched checkpoint gets a :class:`CheckpointError`
naming the file and what is wrong, not an error from deep inside torch after a half-built load.

:func:`capture` says what of a session goes into a checkpoint and :func:`restore`
how it is applied to a freshly built one; :func:`write` and :func:`read` put it on
disk and take it back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import reprlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlnb._checks import RENAMED, is_int, is_number, vocabulary, vocabulary_change
from rlnb._errors import CheckpointError, ConfigError
from rlnb._files import as_path, check_owned, clean_leftovers, save_place, sha256, write_dir
from rlnb.config import PARTS, Config

if TYPE_CHECKING:
    from rlnb.data import PromptLoader
    from rlnb.learn import Trainer

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "capture",
    "check",
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
# The tensor files a checkpoint may hold (file stems); it always holds the first three.
STEMS = ("model", "optimizer", "rng", "warmup_optimizer", "reference")


def config_to_dict(config: Config) -> dict[str, Any]:
    """``config`` as JSON-safe data (paths become strings; tuples become lists in JSON)."""
    data = dataclasses.asdict(config)
    data["track"]["run_dir"] = None if config.track.run_dir is None else os.fspath(config.track.run_dir)
    return data


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

    target = _target(path)

    def fill(staging: Path) -> None:
        files = {}
        for stem, state in tensors.items():
            name = f"{stem}.safetensors"
            save_file(_unshared(state), str(staging / name))
            files[name] = sha256(staging / name)
        written = {**manifest, "format": FORMAT, "format_version": FORMAT_VERSION, "files": files}
        (staging / MANIFEST).write_text(json.dumps(written, indent=1))

    return write_dir(target, fill, "a checkpoint")


def _target(path: Any) -> Path:
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


def read(
    path: str | os.PathLike[str], *, model: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The manifest and tensors of the checkpoint at ``path``, every file verified and
    everything :func:`restore` applies checked against the saved config (:func:`check`),
    its ``ModelConfig`` fields replaced by ``model``'s first (``Session.load``'s
    ``model_path`` and ``device``). Never unpickles: tensors are read with safetensors only."""
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
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{root} has checkpoint format version {manifest.get('format_version')!r}; this rlnb "
            f"reads version {FORMAT_VERSION}: load it with the rlnb version that saved it "
            f"({manifest.get('rlnb', 'unknown')})"
        )
    saved = manifest.get("config")
    if model and isinstance(saved, dict) and isinstance(saved.get("model"), dict):
        if "path" in model and saved["model"].get("path") is None:
            raise ConfigError(
                f"Session.load(model_path=...): {root} holds the built-in policy, not a Hugging Face model"
            )
        manifest["config"] = {**saved, "model": {**saved["model"], **model}}
    files, known = manifest.get("files") or {}, [f"{stem}.safetensors" for stem in STEMS]
    _expect(
        isinstance(files, dict) and set(known[:3]) <= set(files) <= set(known),
        manifest_path, "files", files, f"a SHA-256 for each of {known[:3]} and at most {known[3:]}",
    )  # fmt: skip
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
    check(manifest, tensors, root)
    return manifest, tensors


def _expect(ok: bool, where: Path, key: str, value: Any, want: str) -> None:
    if not ok:
        raise CheckpointError(
            f"{where} is damaged: {key} is {reprlib.repr(value)}, not {want}; it was edited or written by "
            "something else: restore it from a copy, or save the session again"
        )


def _rng_ok(saved: Any) -> bool:
    with contextlib.suppress(TypeError, ValueError, IndexError, KeyError):
        random.Random().setstate(_python_rng(saved))
        return True
    return False


# Manifest entries restore() applies as they are: (valid?, what they should be).
_ENTRIES: dict[str, tuple[Any, str]] = {
    "step": (lambda v: is_int(v) and v >= 0, "an int >= 0"),
    "warmup_steps": (lambda v: is_int(v) and v >= 0, "an int >= 0"),
    "returned_prompts": (
        lambda v: isinstance(v, list) and all(isinstance(i, list) and len(i) == 3 and is_int(i[0]) for i in v),
        "a list of [prompt_id, prompt, answer]",
    ),
    "tracker": (lambda v: isinstance(v, dict) and isinstance(v.get("run_id"), str | None), '{"run_id": ...}'),
    "reward": (lambda v: isinstance(v, str | None), "null or a reward function's name"),
    "python_rng": (_rng_ok, "the state random.getstate() gave"),
}


def check(manifest: dict[str, Any], tensors: dict[str, dict[str, Any]], root: Path) -> None:
    """Check what :func:`restore` will apply against the saved config before any part is built,
    so a load fails here rather than half-way, leaving a live session of the same name alone."""
    import torch

    where, config = root / MANIFEST, saved_config(manifest, root)
    for key, (valid, want) in _ENTRIES.items():
        _expect(bool(valid(manifest.get(key))), where, key, manifest.get(key), want)
    loader, workers = manifest.get("loader"), config.data.num_workers
    _expect(
        isinstance(loader, dict) and isinstance(loader.get("loader"), dict) and loader.get("num_workers") == workers,
        where, "loader", loader, f"the prompt loader's state for the saved config's num_workers={workers}",
    )  # fmt: skip
    shapes, states, vocab_size = _model_shapes(config, root, manifest.get("vocabulary"))
    _check_buffer(manifest.get("buffer"), config, vocab_size, where)
    if config.learn.kl_coef > 0:  # the learner then keeps a reference model, restored from its file
        _expect("reference" in tensors, where, "files", manifest["files"], "a list with reference.safetensors")
    for stem, what in (("model", "model"), ("reference", "reference model")):
        saved = {k: tuple(v.shape) for k, v in tensors[stem].items()} if stem in tensors else states
        wrong = [f"{k} is {list(saved.get(k, ()))}, not {list(v)}" for k, v in states.items() if saved.get(k) != v]
        if wrong or set(saved) != set(states):
            raise CheckpointError(
                f"{root}: the saved {what} does not fit this session: {stem}.safetensors holds another model's "
                f"weights ({'; '.join(wrong[:2]) or 'other tensor names'}), or {MANIFEST}'s config was edited; "
                "load the checkpoint as it was saved"
            )
    for stem in ("optimizer", "warmup_optimizer"):
        _expect((stem in tensors) == (stem in manifest), where, stem, manifest.get(stem), f"{stem}.safetensors' data")
        if stem in tensors:
            _check_optimizer(tensors[stem], manifest[stem], list(shapes.values()), root, stem)
    state = tensors["rng"].get("torch")
    rng_ok = state is not None and state.dtype == torch.uint8 and state.shape == torch.get_rng_state().shape
    _expect(set(tensors["rng"]) == {"torch"} and rng_ok, root / "rng.safetensors", "torch", state, "torch's RNG state")


def _python_rng(saved: Any) -> tuple[Any, ...]:
    return (*saved[:1], tuple(saved[1]), *saved[2:])  # as random.getstate() gave it, before JSON


def _model_shapes(
    config: Config, root: Path, vocab: Any
) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]], int]:
    """The policy's parameter shapes (the optimiser's order), state dict shapes and vocabulary
    size, once the tokenizer has been found to mean what ``vocab`` (the saved one) says."""
    import torch

    from rlnb.data import get_task
    from rlnb.models import TinyPolicy, hf_model_on_meta, model_shape

    if config.model.path is not None and not Path(config.model.path).expanduser().is_dir():
        raise CheckpointError(
            f"{root}: its model's directory {config.model.path!r} is not here; pass a copy of it (its config, "
            f"tokenizer and weights) with rlnb.Session.load({str(root)!r}, model_path=DIR)"
        )
    try:
        tokenizer, model = model_shape(config, get_task(config.task))
        _check_vocabulary(vocab, vocabulary(tokenizer), config, root)
        if model.path is not None:
            policy: Any = hf_model_on_meta(model.path)
        else:
            with torch.device("meta"):
                policy = TinyPolicy(model, seed=config.seed)
    except ConfigError as exc:
        raise CheckpointError(f"{root}: the saved config does not fit this rlnb ({exc})") from exc
    params = {name: tuple(p.shape) for name, p in policy.named_parameters()}
    return params, {name: tuple(t.shape) for name, t in policy.state_dict().items()}, model.vocab_size or 0


def _check_vocabulary(saved: Any, here: dict[str, Any], config: Config, root: Path) -> None:
    """The token ids mean what they meant when it was saved (older checkpoints record nothing)."""
    ok = saved is None or (
        isinstance(saved, dict) and is_int(saved.get("size")) and isinstance(saved.get("sha256"), str)
    )
    _expect(ok, root / MANIFEST, "vocabulary", saved, "the size and SHA-256 of the tokens it was trained on")
    if saved is None or (how := vocabulary_change(saved, here)) is None:
        return
    tokens = saved.get("tokens")
    alphabet = reprlib.repr("".join(map(str, tokens))) if isinstance(tokens, list) else "it had"
    what, fix = f"task {config.task!r} gives its characters", f"register the task with the alphabet {alphabet}"
    if config.model.path is not None:
        what, fix = f"the tokenizer in {config.model.path!r} gives its tokens", "pass the model it was trained with"
    raise CheckpointError(
        f"{root}: {what} other token ids than when it was trained ({how}), so the model would read and write "
        f"other text; {fix}, and load again"
    )


def _check_optimizer(saved: dict[str, Any], meta: Any, params: list[tuple[int, ...]], root: Path, stem: str) -> None:
    """AdamW's state: one group over the policy's parameters, and moments of their shapes."""
    n = len(params)
    groups = meta.get("param_groups") if isinstance(meta, dict) else None
    _expect(
        isinstance(groups, list) and len(groups) == 1 and isinstance(groups[0], dict)
        and groups[0].get("params") == list(range(n)) and isinstance(meta.get("scalars"), dict),
        root / MANIFEST, f"{stem}.param_groups", groups, f"one AdamW group over the model's {n} parameters",
    )  # fmt: skip
    for name, value in [*saved.items(), *meta["scalars"].items()]:
        parts = name.split(".", 2)
        index = int(parts[1]) if len(parts) == 3 and parts[0] == "state" and parts[1].isdigit() else n
        shape = getattr(value, "shape", None) if parts[-1] in ("exp_avg", "exp_avg_sq") else None
        ok = index < n and (shape is None or tuple(shape) == params[index])
        _expect(ok, root / f"{stem}.safetensors", name, shape or value, "AdamW's state for this model")


def _check_buffer(buffer: Any, config: Config, vocab_size: int, where: Path) -> None:
    """The saved replay buffer: the config's partitions, and groups a step can train on."""
    from rlnb._samples import Group

    parts = (buffer.get("partitions") if isinstance(buffer, dict) else None) or {}
    counters = buffer.get("counters") if isinstance(buffer, dict) else None
    _expect(
        isinstance(parts, dict) and set(parts) == set(config.buffer.partitions) and is_int(buffer.get("version"))
        and isinstance(counters, dict) and all(is_int(counters.get(k)) for k in ("put", "taken", "evicted")),
        where, "buffer", buffer, f"the replay buffer's state with partitions {list(config.buffer.partitions)}",
    )  # fmt: skip
    for part, groups in parts.items():
        for i, data in enumerate(groups if isinstance(groups, list) else [None]):
            try:
                samples = Group.from_dict(data).samples
                ok = all(is_number(s.reward) and all(is_int(t) and 0 <= t < vocab_size for t in s.token_ids)
                         for s in samples)  # fmt: skip
            except (TypeError, ValueError, KeyError, AttributeError):
                ok = False
            _expect(ok, where, f"buffer group {i} of {part!r}", data, "a group of scored samples of this model")


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
        "vocabulary": vocabulary(model_shape(trainer.config, trainer.task)[0]),  # what each token id means
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
    left as they were. Returns the path. A path it cannot save to is refused first."""
    _target(path)
    with trainer.quiesced():
        manifest, tensors = capture(trainer, prompts=prompts, name=name, run_id=run_id, reward=reward)
        return write(path, manifest, tensors)


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
    try:  # check() found that it fits: this is for what it cannot foresee
        learner.policy.load_state_dict(tensors["model"])
        learner.optimizer.load_state_dict(unflatten_optimizer(tensors["optimizer"], manifest["optimizer"]))
        warmup_state = None
        if "warmup_optimizer" in tensors:
            warmup_state = unflatten_optimizer(tensors["warmup_optimizer"], manifest["warmup_optimizer"])
        trainer.warmup_stage.restore(int(manifest["warmup_steps"]), warmup_state)
        if learner.reference is not None:
            learner.reference.load_state_dict(tensors["reference"])
        trainer.buffer.load_state_dict(manifest["buffer"])
        learner.version = int(manifest["step"])
        rollouter.give_back([PromptItem(*item) for item in manifest["returned_prompts"]])
    except (RuntimeError, KeyError, ValueError, TypeError, AttributeError, IndexError) as exc:
        raise CheckpointError(f"{root}: the saved state does not fit this session ({exc})") from exc
    trainer.sync_weights()
    torch.set_rng_state(tensors["rng"]["torch"])
    random.setstate(_python_rng(manifest["python_rng"]))

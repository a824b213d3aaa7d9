"""Everything a checkpoint's manifest and tensors hold, checked against its saved config
before any part of a session is built: a damaged or mismatched checkpoint is a
:class:`CheckpointError` naming the file and the entry, not an error from deep inside
torch after a half-built load. Also what a tokenizer's ids mean (:func:`vocabulary`),
which a checkpoint records so that a changed task or tokenizer is caught."""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import reprlib
from pathlib import Path
from typing import Any

from rlnb._checks import is_int, is_number
from rlnb._errors import CheckpointError, ConfigError
from rlnb.checkpoint._format import MANIFEST, expect, saved_config
from rlnb.config import Config


def vocabulary(tokenizer: Any) -> dict[str, Any]:
    """What ``tokenizer``'s ids mean: its size, the SHA-256 of its tokens in id order, and
    the tokens themselves where there are at most 4096 (a Hugging Face tokenizer's own
    tokens; for rlnb's character tokenizer, each id's text)."""
    ids = list(range(tokenizer.vocab_size))
    hf = getattr(tokenizer, "tokenizer", None)
    tokens = [str(t) for t in hf.convert_ids_to_tokens(ids)] if hf is not None else [tokenizer.decode([i]) for i in ids]
    digest = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()
    return {"size": len(tokens), "sha256": digest, **({"tokens": tokens} if len(tokens) <= 4096 else {})}


def vocabulary_change(saved: dict[str, Any], here: dict[str, Any]) -> str | None:
    """How the :func:`vocabulary` ``here`` differs from ``saved`` ("id 3 was ['0'], is
    ['9']"), or None where it does not."""
    if saved["sha256"] == here["sha256"]:
        return None
    tokens = saved.get("tokens")
    was: list[Any] = tokens if isinstance(tokens, list) else []
    now: list[Any] = here.get("tokens", [])
    i = next((i for i in range(max(len(was), len(now))) if was[i : i + 1] != now[i : i + 1]), None)
    if i is None:
        return f"{saved['size']} tokens then, {here['size']} now"
    return f"id {i} was {was[i : i + 1]}, is {now[i : i + 1]}"


def _rng_ok(saved: Any) -> bool:
    with contextlib.suppress(TypeError, ValueError, IndexError, KeyError):
        random.Random().setstate(python_rng(saved))
        return True
    return False


_CHANGE = {"step", "field", "old", "new", "time"}
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
    "changes": (  # absent from checkpoints saved before live settings
        lambda v: v is None or (isinstance(v, list) and all(isinstance(c, dict) and _CHANGE <= set(c) for c in v)),
        'a list of {"step", "field", "old", "new", "time"} (Session.set\'s changes)',
    ),
}


def check(manifest: dict[str, Any], tensors: dict[str, dict[str, Any]], root: Path) -> None:
    """Check what :func:`restore` will apply against the saved config before any part is built,
    so a load fails here rather than half-way, leaving a live session of the same name alone."""
    import torch

    from rlnb.algorithms import CRITICS

    where, config = root / MANIFEST, saved_config(manifest, root)
    for key, (valid, want) in _ENTRIES.items():
        expect(bool(valid(manifest.get(key))), where, key, manifest.get(key), want)
    loader, workers = manifest.get("loader"), config.data.num_workers
    expect(
        isinstance(loader, dict) and isinstance(loader.get("loader"), dict) and loader.get("num_workers") == workers,
        where,
        "loader",
        loader,
        f"the prompt loader's state for the saved config's num_workers={workers}",
    )
    shapes, states, vocab_size = _model_shapes(config, root, manifest.get("vocabulary"))
    _check_data(manifest.get("data"), config, root)
    _check_buffer(manifest.get("buffer"), config, vocab_size, where)
    if (
        config.learn.resolved_algorithm.kl_coef > 0 and config.model.lora is None
    ):  # a reference model is kept, restored from its file
        expect("reference" in tensors, where, "files", manifest["files"], "a list with reference.safetensors")
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
        expect((stem in tensors) == (stem in manifest), where, stem, manifest.get(stem), f"{stem}.safetensors' data")
        if stem in tensors:
            _check_optimizer(tensors[stem], manifest[stem], list(shapes.values()), root, stem)
    expect(
        ("critic" in tensors) == ("critic_optimizer" in tensors) == ("critic_optimizer" in manifest),
        where,
        "critic_optimizer",
        manifest.get("critic_optimizer"),
        "critic.safetensors, critic_optimizer.safetensors and this entry together (a critic's weights and its "
        "optimiser's state), or none of them",
    )
    kind = manifest.get("critic")
    expect(
        kind is None or (kind in CRITICS and (kind != "lora" or config.model.lora is not None)),
        where,
        "critic",
        kind,
        f"one of {', '.join(map(repr, CRITICS))} (a 'lora' critic with a LoRA policy), or no entry without a critic",
    )
    state = tensors["rng"].get("torch")
    rng_ok = state is not None and state.dtype == torch.uint8 and state.shape == torch.get_rng_state().shape
    expect(set(tensors["rng"]) == {"torch"} and rng_ok, root / "rng.safetensors", "torch", state, "torch's RNG state")


def python_rng(saved: Any) -> tuple[Any, ...]:
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
            policy: Any = hf_model_on_meta(model.path, lora=model.lora)
        else:
            with torch.device("meta"):
                policy = TinyPolicy(model, seed=config.seed)
    except ConfigError as exc:
        raise CheckpointError(f"{root}: the saved config does not fit this rlnb ({exc})") from exc
    if model.lora is not None:  # the checkpoint and the optimiser hold the adapter's tensors only
        params = {name: tuple(p.shape) for name, p in policy.named_parameters() if p.requires_grad}
        return params, params, model.vocab_size or 0
    params = {name: tuple(p.shape) for name, p in policy.named_parameters()}
    return params, {name: tuple(t.shape) for name, t in policy.state_dict().items()}, model.vocab_size or 0


def _check_vocabulary(saved: Any, here: dict[str, Any], config: Config, root: Path) -> None:
    """The token ids mean what they meant when it was saved (older checkpoints record nothing)."""
    ok = saved is None or (
        isinstance(saved, dict) and is_int(saved.get("size")) and isinstance(saved.get("sha256"), str)
    )
    expect(ok, root / MANIFEST, "vocabulary", saved, "the size and SHA-256 of the tokens it was trained on")
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


# A "data" entry of a task made from records: its keys and the type of each.
_RECORDS = {"records": int, "sha256": str, "prompt": str, "answer": str, "held_out": int, "split_sha256": str}


def _data_ok(saved: Any) -> bool:
    if not isinstance(saved, dict) or saved.get("kind") not in ("records", "generated"):
        return False
    return saved["kind"] == "generated" or all(
        is_int(saved.get(key)) if kind is int else isinstance(saved.get(key), kind) for key, kind in _RECORDS.items()
    )


def _check_data(saved: Any, config: Config, root: Path) -> None:
    """The task's data is what the checkpoint trained on (older checkpoints record nothing):
    other records would go on mid-epoch on other prompts and evaluate on another held-out set."""
    from rlnb.data import get_task

    if saved is None:
        return
    expect(_data_ok(saved), root / MANIFEST, "data", saved, "what the session trained on (Task.fingerprint())")
    here = get_task(config.task).fingerprint()
    name = config.task
    if saved["kind"] != here["kind"]:
        then = f"{saved['records']} records" if saved["kind"] == "records" else "prompts from its make_prompt"
        now = f"{here['records']} records" if here["kind"] == "records" else "prompts from a make_prompt"
        how = f"it was trained on {then}, and task {name!r} now gives {now}"
    elif saved["kind"] == "generated":
        return
    elif (saved["records"], saved["sha256"]) != (here["records"], here["sha256"]):
        now = f"{here['records']}" if here["records"] != saved["records"] else f"{here['records']} other"
        how = (
            f"it was trained on {saved['records']} records (SHA-256 {saved['sha256'][:12]}…), and task {name!r} "
            f"now has {now} (SHA-256 {here['sha256'][:12]}…)"
        )
    elif (saved["prompt"], saved["answer"]) != (here["prompt"], here["answer"]):
        how = (
            f"task {name!r} read its records' fields prompt={saved['prompt']!r}, answer={saved['answer']!r} when it "
            f"was trained, and now reads prompt={here['prompt']!r}, answer={here['answer']!r}"
        )
    elif (saved["held_out"], saved["split_sha256"]) != (here["held_out"], here["split_sha256"]):
        now = f"{here['held_out']}" if here["held_out"] != saved["held_out"] else f"another {here['held_out']}"
        how = (
            f"task {name!r} held out {saved['held_out']} of its records when it was trained, and now holds out "
            f"{now} (another eval_size or split_seed)"
        )
    else:
        return
    raise CheckpointError(
        f"{root}: {how}, so the session would go on mid-epoch on other prompts and evaluate on another held-out "
        f"set; register the task as it was made then (rlnb.data.register_task(rlnb.data.Task.from_records("
        f"{name!r}, <the same records>, ...), replace=True)) and load again, or train on the new data in a new "
        "Session"
    )


def _check_optimizer(saved: dict[str, Any], meta: Any, params: list[tuple[int, ...]], root: Path, stem: str) -> None:
    """AdamW's state: one group over the policy's parameters, and moments of their shapes."""
    n = len(params)
    groups = meta.get("param_groups") if isinstance(meta, dict) else None
    expect(
        isinstance(groups, list)
        and len(groups) == 1
        and isinstance(groups[0], dict)
        and groups[0].get("params") == list(range(n))
        and isinstance(meta.get("scalars"), dict),
        root / MANIFEST,
        f"{stem}.param_groups",
        groups,
        f"one AdamW group over the model's {n} parameters",
    )
    for name, value in [*saved.items(), *meta["scalars"].items()]:
        parts = name.split(".", 2)
        index = int(parts[1]) if len(parts) == 3 and parts[0] == "state" and parts[1].isdigit() else n
        shape = getattr(value, "shape", None) if parts[-1] in ("exp_avg", "exp_avg_sq") else None
        ok = index < n and (shape is None or tuple(shape) == params[index])
        expect(ok, root / f"{stem}.safetensors", name, shape or value, "AdamW's state for this model")


def _check_buffer(buffer: Any, config: Config, vocab_size: int, where: Path) -> None:
    """The saved replay buffer: the config's partitions, and groups a step can train on."""
    from rlnb._samples import Group

    parts = (buffer.get("partitions") if isinstance(buffer, dict) else None) or {}
    counters = buffer.get("counters") if isinstance(buffer, dict) else None
    expect(
        isinstance(parts, dict)
        and set(parts) == set(config.buffer.partitions)
        and is_int(buffer.get("version"))
        and isinstance(counters, dict)
        and all(is_int(counters.get(k)) for k in ("put", "taken", "evicted")),
        where,
        "buffer",
        buffer,
        f"the replay buffer's state with partitions {list(config.buffer.partitions)}",
    )
    for part, groups in parts.items():
        for i, data in enumerate(groups if isinstance(groups, list) else [None]):
            try:
                group = Group.from_dict(data)
                ok = all(is_int(t) and 0 <= t < vocab_size for t in group.prompt_ids) and all(
                    is_number(s.reward) and all(is_int(t) and 0 <= t < vocab_size for t in s.token_ids)
                    for s in group.samples
                )
            except (TypeError, ValueError, KeyError, AttributeError):
                ok = False
            expect(ok, where, f"buffer group {i} of {part!r}", data, "a group of scored samples of this model")

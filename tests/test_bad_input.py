"""The bad-input catalogue (docs/bad-input.md): each input a user may get wrong, and
the error they get. Every test asserts the exception type and that the message names
the field and the fix; the checkpoint tests also assert that nothing already saved or
running is lost. A row marked "to fix" is a strict xfail that states the error wanted.
"""

from __future__ import annotations

import errno
import hashlib
import json
import pathlib
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import rlnb
import rlnb._files
from rlnb.cli import main
from rlnb.data import Task, register_task, task_names


def tiny_config(**changes: Any) -> rlnb.Config:
    return rlnb.Config(
        seed=3,
        data=rlnb.DataConfig(num_workers=0),
        model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2),
        rollout=rlnb.RolloutConfig(group_size=2, groups_per_step=2),
        learn=rlnb.LearnConfig(kl_coef=0.05),  # keeps a reference model: its file is saved too
        warmup=rlnb.WarmupConfig(steps=1, batch_size=4),  # and a warm-up optimiser
    ).replace(**changes)


def raises(kind: type[BaseException], make: Callable[[], object], *words: str) -> BaseException:
    """``make()`` raises ``kind`` whose message holds every one of ``words``."""
    with pytest.raises(kind) as info:
        make()
    for word in words:
        assert word in str(info.value), f"{word!r} is not in the message: {info.value}"
    return info.value


# -- configs and the session's own arguments ---------------------------------------------

E = rlnb.ConfigError
CONFIGS = [
    pytest.param(lambda: rlnb.Config(task="nope"), "Config.task='nope' is unknown", "use one of", id="task-unknown"),
    pytest.param(lambda: rlnb.Config(task=3), "Config.task=3", 'task="addition"', id="task-not-a-name"),
    pytest.param(lambda: rlnb.Config(mode="fast"), "Config.mode='fast'", '"sync" or "async"', id="mode"),
    pytest.param(lambda: rlnb.Config(seed=-1), "Config.seed=-1", "int >= 0", id="seed-negative"),
    pytest.param(lambda: rlnb.Config(seed="0"), "Config.seed='0'", "int >= 0", id="seed-a-string"),
    pytest.param(lambda: rlnb.Config(seed=2**64), f"Config.seed={2**64}", "< 2**32", id="seed-too-large"),
    pytest.param(lambda: rlnb.Config(seed=2**32), f"Config.seed={2**32}", "< 2**32", id="seed-too-large-for-numpy"),
    pytest.param(lambda: rlnb.Config(step_timeout=0), "Config.step_timeout=0", "seconds > 0", id="step-timeout"),
    pytest.param(lambda: rlnb.Config(learn={"lr": 1e-3}), "Config.learn=", "rlnb.LearnConfig(...)", id="part-a-dict"),
    pytest.param(
        lambda: rlnb.Config(mode="async", buffer=rlnb.BufferConfig(capacity=8)),
        "RolloutConfig.groups_per_step=16 is invalid",
        "holds at most BufferConfig.capacity=8 groups: use groups_per_step <= 8",
        id="batch-larger-than-the-buffer",
    ),
    pytest.param(
        lambda: rlnb.RolloutConfig(reward_weights=(1.0, float("inf"))),
        "RolloutConfig.reward_weights=(1.0, inf)",
        "one finite number per reward function",
        id="reward-weights-not-finite",
    ),
    pytest.param(
        lambda: rlnb.Config(rollout=rlnb.RolloutConfig(reward_weights=(1.0, 2.0))),
        "RolloutConfig.reward_weights=(1.0, 2.0)",
        "task 'addition' has 1 reward function(s)",
        id="reward-weights-count",
    ),
    pytest.param(
        lambda: rlnb.LearnConfig(keep_batches=-1), "LearnConfig.keep_batches=-1", "keep_batches=8", id="keep-batches"
    ),
    pytest.param(lambda: rlnb.LearnConfig(lr=float("nan")), "LearnConfig.lr=nan", "lr=1e-4", id="lr-nan"),
    pytest.param(lambda: rlnb.LearnConfig(lr="1e-4"), "LearnConfig.lr='1e-4'", "lr=1e-4", id="lr-a-string"),
    pytest.param(lambda: rlnb.LearnConfig(betas=(0.9,)), "LearnConfig.betas", "two numbers", id="betas"),
    pytest.param(lambda: rlnb.LearnConfig(clip_eps=1.5), "LearnConfig.clip_eps=1.5", "(0, 1)", id="clip-eps"),
    pytest.param(lambda: rlnb.LearnConfig(scale_advantages="yes"), "scale_advantages", "True (GRPO)", id="flag"),
    pytest.param(lambda: rlnb.RolloutConfig(group_size=0), "RolloutConfig.group_size=0", ">= 2", id="group-size"),
    pytest.param(
        lambda: rlnb.RolloutConfig(group_size=16, max_inflight=8),
        "RolloutConfig.max_inflight=8",
        "at least group_size=16",
        id="inflight-below-group",
    ),
    pytest.param(
        lambda: rlnb.RolloutConfig(max_staleness=1), "max_staleness was renamed", "max_policy_lag=1", id="renamed"
    ),
    pytest.param(lambda: rlnb.RolloutConfig(top_p=0), "RolloutConfig.top_p=0", "(0, 1]", id="top-p"),
    pytest.param(lambda: rlnb.RolloutConfig(temperature=-1), "RolloutConfig.temperature=-1", ">= 0", id="temp"),
    pytest.param(lambda: rlnb.RolloutConfig(reward_timeout=0), "reward_timeout=0", "None for no limit", id="timeout"),
    pytest.param(lambda: rlnb.ModelConfig(n_heads=3), "ModelConfig.n_heads=3", "divisor of d_model", id="n-heads"),
    pytest.param(lambda: rlnb.ModelConfig(d_model=64.0), "ModelConfig.d_model=64.0", "an int", id="d-model-float"),
    pytest.param(lambda: rlnb.DataConfig(num_workers=-1), "DataConfig.num_workers=-1", ">= 0", id="num-workers"),
    pytest.param(
        lambda: rlnb.DataConfig(multiprocessing_context="threads"),
        "multiprocessing_context='threads'",
        '"spawn"',
        id="mp-context",
    ),
    pytest.param(
        lambda: rlnb.EngineConfig(kind="sglang"), "EngineConfig.kind='sglang'", "'tiny', 'hf', 'vllm'", id="engine-kind"
    ),
    pytest.param(
        lambda: rlnb.Config(engine=rlnb.EngineConfig(kind="hf")),
        "EngineConfig.kind='hf'",
        "ModelConfig(path=",
        id="hf-no-path",
    ),
    pytest.param(
        lambda: rlnb.ModelConfig(path="/nowhere").replace(dtype="fp8"),
        "ModelConfig.dtype='fp8'",
        "bfloat16",
        id="dtype",
    ),
    pytest.param(
        lambda: rlnb.ModelConfig(path="/nowhere", device="gpu"),
        "ModelConfig.device='gpu'",
        '"cpu", "cuda" or "cuda:N"',
        id="device",
    ),
    pytest.param(
        lambda: rlnb.ModelConfig(device="cuda"),
        "ModelConfig.device='cuda'",
        "the built-in policy runs on the CPU",
        id="device-built-in",
    ),
    pytest.param(
        lambda: rlnb.EngineConfig(gpu_memory_utilization=1.5),
        "EngineConfig.gpu_memory_utilization=1.5",
        "use a fraction in (0, 1]",
        id="gpu-memory",
    ),
    pytest.param(
        lambda: rlnb.EngineConfig(kind="vllm", process=True),
        "EngineConfig.process=True",
        "vLLM already runs in processes of its own",
        id="process-vllm",
    ),
    pytest.param(
        lambda: rlnb.Config(engine=rlnb.EngineConfig(process=True), ray=rlnb.RayConfig(engine_replicas=2)),
        "EngineConfig.process=True",
        "already runs the engine in Ray's processes",
        id="process-ray",
    ),
    pytest.param(lambda: rlnb.BufferConfig(partitions=("val",)), "BufferConfig.partitions", '"train"', id="parts"),
    pytest.param(lambda: rlnb.WarmupConfig(steps=-1), "WarmupConfig.steps=-1", "steps=300", id="warmup-steps"),
    pytest.param(
        lambda: rlnb.WarmupConfig(task="nope"), "WarmupConfig.task='nope' is unknown", "use one of", id="warmup-task"
    ),
    pytest.param(
        lambda: rlnb.Config(task="addition", warmup=rlnb.WarmupConfig(task="sloppy_reverse")),
        "WarmupConfig.task='sloppy_reverse' is invalid: its answers may hold 'abcdefgh'",
        "use a task of the same characters",
        id="warmup-task-characters",
    ),
    pytest.param(lambda: rlnb.TrackConfig(backends="jsonl"), "TrackConfig.backends='jsonl'", "tuple", id="backends"),
    pytest.param(
        lambda: rlnb.TrackConfig(backends=("tensorboard",)),
        "unknown backend(s) ['tensorboard']",
        "'jsonl'",
        id="backend-unknown",
    ),
    pytest.param(
        lambda: rlnb.TrackConfig(backends=("jsonl",)), "TrackConfig.run_dir=None", "run_dir='runs/demo'", id="no-dir"
    ),
    pytest.param(
        lambda: rlnb.TrackConfig(backends=("jsonl",), run_dir=3),
        "TrackConfig.run_dir=3",
        "a directory path",
        id="run-dir-not-a-path",
    ),
    pytest.param(lambda: rlnb.TrackConfig(wandb_mode="on"), "wandb_mode='on'", "'offline', 'online'", id="wandb"),
    pytest.param(lambda: rlnb.Session({"task": "sort"}), "Session(config=...)", "rlnb.Config(...)", id="session"),
    pytest.param(lambda: rlnb.Session(name=""), "Session(name='')", "non-empty string", id="session-name"),
    pytest.param(lambda: rlnb.Session(engine=object()), "Session(engine=object)", "Engine methods", id="engine"),
    pytest.param(
        lambda: rlnb.Session(rlnb.Config(model=rlnb.ModelConfig(vocab_size=4))),
        "ModelConfig.vocab_size=4",
        "needs 15 token ids",
        id="vocab-too-small",
    ),
]


@pytest.mark.parametrize(("make", "field", "fix"), CONFIGS)
def test_a_bad_config_value_names_the_field_and_the_fix(make: Callable[[], object], field: str, fix: str) -> None:
    raises(rlnb.ConfigError, make, field, fix)
    assert rlnb.sessions() == [], "nothing was built"


def test_a_run_dir_that_is_a_file_is_refused_when_the_config_is_made(tmp_path: Path) -> None:
    (tmp_path / "notes").write_text("keep me")
    raises(E, lambda: rlnb.TrackConfig(backends=("jsonl",), run_dir=tmp_path / "notes"), "it is a file", "directory")
    raises(E, lambda: rlnb.TrackConfig(backends=("jsonl",), run_dir=tmp_path / "notes" / "run"), "notes is a file")
    assert (tmp_path / "notes").read_text() == "keep me"


def test_wandb_online_without_an_api_key_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc either
    make = lambda: rlnb.TrackConfig(backends=("wandb",), run_dir=str(tmp_path), wandb_mode="online")  # noqa: E731
    raises(E, make, "TrackConfig.wandb_mode='online'", "needs a wandb API key", "'offline'")


def test_a_path_object_as_run_dir_is_saved_in_a_checkpoint(tmp_path: Path) -> None:
    track = rlnb.TrackConfig(backends=("jsonl",), run_dir=tmp_path / "run")  # type: ignore[arg-type]
    with rlnb.Session(tiny_config(track=track), name="path-run-dir") as sess:
        sess.save(tmp_path / "ckpt")  # it used to fail, blaming a prompt's answer
    with rlnb.Session.load(tmp_path / "ckpt", name="path-run-dir") as sess:
        assert sess.config.track.run_dir == str(tmp_path / "run")


TO_FIX = "to fix: see docs/bad-input.md"


def test_a_misspelt_field_names_the_field_it_meant() -> None:
    raises(E, lambda: rlnb.LearnConfig(lrr=1e-3), "lrr", "lr")  # type: ignore[call-arg]


def test_a_group_of_one_is_refused() -> None:
    raises(E, lambda: rlnb.RolloutConfig(group_size=1), "RolloutConfig.group_size=1", ">= 2")


def test_a_context_too_short_for_the_task_is_refused_when_the_session_is_made() -> None:
    def make() -> None:
        with rlnb.Session(tiny_config(model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2, max_len=6))):
            pass

    raises(E, make, "ModelConfig.max_len=6", "addition")


def test_a_callback_that_is_not_a_callback_is_refused_when_the_session_is_made() -> None:
    def make() -> None:
        with rlnb.Session(tiny_config(), callbacks=[print]):  # type: ignore[list-item]
            pass

    raises(E, make, "callbacks", "rlnb.learn.Callback")


# -- the session's methods ----------------------------------------------------------------

METHODS = [
    pytest.param(
        lambda s: s.train(-1, progress=False), rlnb.InvalidValueError, "train(n_steps=-1)", "positive int", id="train"
    ),
    pytest.param(
        lambda s: s.train(until=-1), rlnb.InvalidValueError, "train(until=-1)", "an int >= 0", id="train-until"
    ),
    pytest.param(
        lambda s: s.warmup(-1, progress=False), rlnb.InvalidValueError, "warmup(n_steps=-1)", ">= 0", id="warmup"
    ),
    pytest.param(lambda s: s.rollout(0), rlnb.InvalidValueError, "rollout(n_groups=0)", "positive int", id="rollout"),
    pytest.param(
        lambda s: s.rollouts.pause("bogus"),
        rlnb.InvalidValueError,
        "pause(mode='bogus')",
        "'abort', 'keep', 'wait'",
        id="pause",
    ),
    pytest.param(
        lambda s: s.training.start(-1),
        rlnb.InvalidValueError,
        "start(steps=-1)",
        "None to train until stop()",
        id="start",
    ),
    pytest.param(
        lambda s: s.rollouts.set_reward("x"),
        rlnb.InvalidTypeError,
        "set_reward() takes a callable",
        "(completion, answer)",
        id="set-reward",
    ),
    pytest.param(lambda s: s.save(3), rlnb.CheckpointError, "Session.save(path=3)", "directory path", id="save"),
    pytest.param(
        lambda s: s.evaluate(0),
        rlnb.InvalidValueError,
        "evaluate(n_prompts=0)",
        "int >= 1",
        id="evaluate",
    ),
    pytest.param(
        lambda s: s.rollouts.set_reward(lambda completion: 1.0),
        rlnb.InvalidTypeError,
        "set_reward(",
        "(completion, answer)",
        id="set-reward-arity",
    ),
]


@pytest.mark.parametrize(("call", "kind", "field", "fix"), METHODS)
def test_a_bad_argument_to_a_session_method_names_it_and_changes_nothing(
    call: Callable[[rlnb.Session], object], kind: type[BaseException], field: str, fix: str
) -> None:
    with rlnb.Session(tiny_config(), name="methods") as sess:
        raises(kind, lambda: call(sess), field, fix)
        stats = sess.statistics()  # nothing was started: no step, no rollout, no background run
        assert sess.version == 0 and stats.rollout.dispatched == 0 and not stats.rollout.dispatching
        assert repr(sess).endswith("idle>")


# -- checkpoints ----------------------------------------------------------------------------


class Unpickled:
    """A pickle payload that touches ``marker`` when it is unpickled (and does nothing else)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (self.marker,))


def digest(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("saved") / "ckpt"
    with rlnb.Session(tiny_config(), name="saved") as sess:
        sess.warmup(progress=False)
        sess.step()
        sess.save(path)
    return path


def edit(key_path: str, value: Any) -> Callable[[Path], None]:
    """Set ``checkpoint.json``'s entry at ``key_path`` (dots between keys) to ``value``."""

    def damage(ckpt: Path) -> None:
        manifest = json.loads((ckpt / "checkpoint.json").read_text())
        *keys, last = key_path.split(".")
        node = manifest
        for key in keys:
            node = node[key]
        node[last] = value
        (ckpt / "checkpoint.json").write_text(json.dumps(manifest))

    return damage


def rehash(ckpt: Path, name: str) -> None:
    """Record ``name``'s new SHA-256 in the manifest, as a careful forger would."""
    manifest = json.loads((ckpt / "checkpoint.json").read_text())
    manifest["files"][name] = hashlib.sha256((ckpt / name).read_bytes()).hexdigest()
    (ckpt / "checkpoint.json").write_text(json.dumps(manifest))


def truncate(name: str, *, keep_checksum: bool = True) -> Callable[[Path], None]:
    def damage(ckpt: Path) -> None:
        data = (ckpt / name).read_bytes()
        (ckpt / name).write_bytes(data[: len(data) // 3])
        if not keep_checksum:
            rehash(ckpt, name)

    return damage


def pickle_for(name: str, *, keep_checksum: bool) -> Callable[[Path], None]:
    """A ``torch.save`` pickle put where ``name`` belongs; loading it would touch a marker."""

    def damage(ckpt: Path) -> None:
        import torch

        torch.save(
            {"tok_emb.weight": torch.zeros(15, 32), "payload": Unpickled(ckpt.parent / "UNPICKLED")}, ckpt / name
        )
        if not keep_checksum:
            rehash(ckpt, name)

    return damage


def other_shape(name: str) -> Callable[[Path], None]:
    """``name`` replaced by the same file of a model of another shape (d_model 64, not 32)."""

    def damage(ckpt: Path) -> None:
        import torch
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(ckpt / name))
        save_file({k: torch.zeros([2 * n if n == 32 else n for n in v.shape]) for k, v in tensors.items()}, ckpt / name)
        rehash(ckpt, name)

    return damage


def sample_group(token_id: int) -> dict[str, Any]:
    sample = {"prompt": "1+1=", "completion": "2", "token_ids": [token_id], "logprobs": [-1.0], "versions": [1]}
    return {"prompt": "1+1=", "prompt_id": 0, "samples": [{**sample, "reward": 1.0}]}


def move_out(name: str) -> Callable[[Path], None]:
    return lambda ckpt: (ckpt / name).unlink()


def copy_to(name: str, source: str) -> Callable[[Path], None]:
    def damage(ckpt: Path) -> None:
        shutil.copy(ckpt / source, ckpt / name)
        rehash(ckpt, name)

    return damage


def outside_file(ckpt: Path) -> None:
    """The manifest lists a file beside the checkpoint (with its right checksum)."""
    shutil.copy(ckpt / "model.safetensors", ckpt.parent / "elsewhere.safetensors")
    manifest = json.loads((ckpt / "checkpoint.json").read_text())
    manifest["files"]["../elsewhere.safetensors"] = manifest["files"]["model.safetensors"]
    (ckpt / "checkpoint.json").write_text(json.dumps(manifest))


# (id, damage, words the CheckpointError names)
DAMAGES = [
    ("truncated-tensor-file", truncate("model.safetensors"), "model.safetensors is damaged", "SHA-256"),
    ("truncated-tensor-file-rehashed", truncate("model.safetensors", keep_checksum=False),
     "model.safetensors is damaged", "header"),
    ("truncated-manifest", truncate("checkpoint.json"), "checkpoint.json is damaged: not valid JSON"),
    ("another-programs-json", lambda c: (c / "checkpoint.json").write_text("[]"), "not an rlnb checkpoint manifest"),
    ("format-version-bumped", edit("format_version", 3), "format version 3; this rlnb reads versions 1 to 2",
     "load it with the rlnb version that saved it"),
    ("step-edited", edit("step", "x"), "checkpoint.json is damaged: step is 'x'", "restore it from a copy"),
    ("step-negative", edit("step", -3), "step is -3, not an int >= 0", "save the session again"),
    ("loader-state-deleted", edit("loader", None), "loader is None", "prompt loader's state"),
    ("loader-workers-edited", edit("loader.num_workers", 2), "loader is", "num_workers=0"),
    ("buffer-edited", edit("buffer", []), "buffer is []", "partitions ['train', 'val']"),
    ("buffer-group-edited", edit("buffer.partitions.train", [{"x": 1}]), "buffer group 0 of 'train'",
     "scored samples"),
    ("buffer-token-outside-vocab", edit("buffer.partitions.train", [sample_group(999)]), "buffer group 0 of 'train'",
     "of this model"),
    ("returned-prompts-edited", edit("returned_prompts", [[1]]), "returned_prompts is [[1]]", "[prompt_id, prompt"),
    ("python-rng-edited", edit("python_rng", [3, [1, 2], None]), "python_rng is", "random.getstate()"),
    ("tracker-edited", edit("tracker", None), "tracker is None", "run_id"),
    ("file-outside-the-checkpoint", outside_file, "checkpoint.json is damaged: files is", "at most"),
    ("tensor-file-deleted", move_out("reference.safetensors"), "incomplete: reference.safetensors is missing"),
    ("config-unknown-field", edit("config.model.colour", "blue"), "ModelConfig has no field(s) ['colour']",
     "saved config does not fit"),
    ("config-invalid-value", edit("config.learn.lr", -1), "LearnConfig.lr=-1 is invalid", "lr=1e-4"),
    ("config-task-not-registered", edit("config.task", "never-registered"), "Config.task='never-registered' is unknown",
     "register_task"),
    ("config-another-model-shape", edit("config.model.d_model", 64), "saved model does not fit this session",
     "tok_emb.weight is [15, 32], not [15, 64]", "load the checkpoint as it was saved"),
    ("weights-of-another-model-shape", other_shape("model.safetensors"), "saved model does not fit this session",
     "model.safetensors holds another model's weights", "[15, 64]"),
    ("reference-of-another-model-shape", other_shape("reference.safetensors"),
     "saved reference model does not fit this session", "reference.safetensors holds another model's weights"),
    ("optimizer-of-another-model-shape", other_shape("optimizer.safetensors"), "optimizer.safetensors is damaged",
     "state.0.exp_avg", "AdamW's state"),
    ("rng-file-swapped", copy_to("rng.safetensors", "model.safetensors"), "rng.safetensors is damaged",
     "torch's RNG state"),
    ("pickle-for-tensors", pickle_for("model.safetensors", keep_checksum=True), "model.safetensors is damaged",
     "SHA-256"),
    ("pickle-for-tensors-rehashed", pickle_for("model.safetensors", keep_checksum=False),
     "model.safetensors is damaged"),
    ("custom-reward-not-given", edit("reward", "quarter"), "custom reward function (quarter",
     "reward=quarter"),
    ("vocabulary-edited", edit("vocabulary", [15]), "checkpoint.json is damaged: vocabulary is [15]",
     "the size and SHA-256 of the tokens it was trained on"),
]  # fmt: skip


@pytest.mark.parametrize(("damage", "words"), [(d[1], d[2:]) for d in DAMAGES], ids=[d[0] for d in DAMAGES])
def test_a_damaged_checkpoint_is_refused_before_anything_is_built(
    saved: Path, tmp_path: Path, damage: Callable[[Path], None], words: tuple[str, ...]
) -> None:
    before = digest(saved)
    ckpt = Path(shutil.copytree(saved, tmp_path / "copy"))
    damage(ckpt)
    with rlnb.Session(tiny_config(), name="work") as live:  # the notebook's session, with its work
        live.step()
        raises(rlnb.CheckpointError, lambda: rlnb.Session.load(ckpt, name="work"), *words)
        assert not live.closed and rlnb.sessions() == [live], "a failed load replaced the live session"
        assert live.step()["version"] == 2  # and it goes on
    assert not (tmp_path / "UNPICKLED").exists(), "loading unpickled something"
    assert digest(saved) == before


def test_the_pickle_used_above_would_run_code_if_it_were_unpickled(tmp_path: Path) -> None:
    """So the checkpoint rows above prove that loading never unpickles."""
    pickle.loads(pickle.dumps(Unpickled(tmp_path / "UNPICKLED")))
    assert (tmp_path / "UNPICKLED").exists()


@pytest.mark.parametrize(
    ("where", "words"),
    [
        pytest.param(lambda c: c / "checkpoint.json", ("is a file", "checkpoint's directory"), id="the-json-file"),
        pytest.param(lambda c: c.parent / "nowhere", ("no checkpoint at", "sess.save(path)"), id="no-checkpoint"),
        pytest.param(lambda c: None, ("Session.load(path=None)", "directory path"), id="not-a-path"),
    ],
)
def test_loading_from_the_wrong_path_says_what_to_pass(
    saved: Path, where: Callable[[Path], Any], words: tuple[str, ...]
) -> None:
    raises(rlnb.CheckpointError, lambda: rlnb.Session.load(where(saved)), *words)


def test_a_reward_that_is_not_a_function_is_refused_on_load(saved: Path) -> None:
    raises(rlnb.CheckpointError, lambda: rlnb.Session.load(saved, reward="x"), "reward='x'", "reward function")


def test_saving_over_something_that_is_not_a_checkpoint_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    (tmp_path / "file").write_text("keep me too")
    with rlnb.Session(tiny_config(), name="save") as sess:
        raises(rlnb.CheckpointError, lambda: sess.save(tmp_path / "file"), "it is a file", "directory path")
        raises(rlnb.CheckpointError, lambda: sess.save(tmp_path / "notes"), "holds no checkpoint", "new or empty")
        raises(rlnb.CheckpointError, lambda: sess.save(tmp_path / "file" / "ckpt"), "cannot save", "write to")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"
    assert (tmp_path / "file").read_text() == "keep me too"


def test_a_full_disk_while_safetensors_writes_is_a_checkpoint_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """safetensors (Rust) reports a full disk as its own SafetensorError, not an OSError:
    it reached the caller as it was, not as the CheckpointError save() documents."""
    import safetensors.torch
    from safetensors import SafetensorError

    def disk_full(*args: Any, **kwargs: Any) -> None:
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    with rlnb.Session(tiny_config(), name="save") as sess:
        sess.save(tmp_path / "ckpt")
        before = digest(tmp_path / "ckpt")
        monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
        error = raises(rlnb.CheckpointError, lambda: sess.save(tmp_path / "ckpt"), "No space left", "free some space")
    assert str(error).startswith(f"cannot save a checkpoint to {tmp_path / 'ckpt'}: [Errno 28] No space left")
    assert digest(tmp_path / "ckpt") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_save_that_fails_half_way_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import safetensors.torch

    real_save = safetensors.torch.save_file
    calls = []

    def disk_full_on_the_second_file(*args: Any, **kwargs: Any) -> None:
        calls.append(args)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(*args, **kwargs)

    def swap_fails(staging: Path, target: Path) -> bool:
        raise OSError(errno.EIO, "Input/output error")

    with rlnb.Session(tiny_config(), name="save") as sess:
        sess.save(tmp_path / "ckpt")
        before = digest(tmp_path / "ckpt")
        sess.step()
        with monkeypatch.context() as patch:
            patch.setattr(safetensors.torch, "save_file", disk_full_on_the_second_file)
            raises(rlnb.CheckpointError, lambda: sess.save(tmp_path / "ckpt"), "No space left", "nothing there")
        with monkeypatch.context() as patch:
            patch.setattr(rlnb._files, "_exchange", swap_fails)
            raises(rlnb.CheckpointError, lambda: sess.save(tmp_path / "ckpt"), "Input/output error", "save again")
        assert digest(tmp_path / "ckpt") == before, "the previous checkpoint was changed"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"], "a staging directory was left behind"
        sess.save(tmp_path / "ckpt")  # and saving works again
    assert json.loads((tmp_path / "ckpt" / "checkpoint.json").read_text())["step"] == 1


# -- task definitions -----------------------------------------------------------------------


def make_sum(rng: Any) -> tuple[str, str]:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    return f"{a}+{b}=", str(a + b)


def exact(completion: str, answer: Any) -> float:
    return float(completion == answer)


def boom(rng: Any) -> tuple[str, str]:
    raise RuntimeError("boom")


class _EnvClass:
    def reset(self, row: Any) -> None:
        return None

    def step(self, completion: str) -> Any:
        return None


GOOD = {"name": "sum", "alphabet": "0123456789+=", "make_prompt": make_sum, "reward": exact, "max_new_tokens": 3}
TASKS = [
    pytest.param({"name": ""}, "Task.name=''", "non-empty string", id="name-empty"),
    pytest.param({"alphabet": ""}, "Task.alphabet=''", "every character", id="alphabet-empty"),
    pytest.param({"alphabet": "0123456789+=+"}, "Task.alphabet=", "repeats '+'", id="alphabet-repeats"),
    pytest.param({"make_prompt": None}, "Task.make_prompt=None", "make_prompt(rng) -> (prompt, answer)", id="no-fn"),
    pytest.param({"make_prompt": lambda: ("1+1=", "2")}, "Task.make_prompt=", "make_prompt(rng)", id="fn-no-rng"),
    pytest.param({"reward": lambda c: 1.0}, "Task.reward=", "reward(completion, answer)", id="reward-one-arg"),
    pytest.param({"max_new_tokens": 0}, "Task.max_new_tokens=0", "longest answer's length + 1", id="max-new-tokens"),
    pytest.param({"env": _EnvClass(), "max_turns": 2}, "Task.env=", "a factory", id="env-an-instance"),
    pytest.param({"env": lambda level: None, "max_turns": 2}, "Task.env=", "lambda: MyEnv(arg)", id="env-takes-args"),
    pytest.param({"env": _EnvClass, "max_turns": 0}, "Task.max_turns=0", "max_turns=3", id="max-turns"),
    pytest.param({"max_turns": 3}, "Task.max_turns=3", "give env= an environment factory", id="turns-no-env"),
    pytest.param({"reward": None}, "Task.reward=None", "None is for a task with env=", id="reward-none-no-env"),
]


@pytest.mark.parametrize(("change", "field", "fix"), TASKS)
def test_a_bad_task_field_names_the_field_and_the_fix(change: dict[str, Any], field: str, fix: str) -> None:
    raises(E, lambda: Task(**{**GOOD, **change}), field, fix)


REGISTERED = [
    pytest.param({"make_prompt": boom}, "make_prompt(rng) raised RuntimeError('boom')", "fix it", id="raises"),
    pytest.param({"make_prompt": lambda rng: "1+1="}, "returned '1+1='", "tuple (prompt, answer)", id="not-a-pair"),
    pytest.param({"make_prompt": lambda rng: (11, "2")}, "returned (11, '2')", "prompt is a str", id="int-prompt"),
    pytest.param({"alphabet": "0123456789="}, "Task.alphabet='0123456789='", "holds '+'", id="prompt-outside"),
    pytest.param({"make_prompt": lambda rng: ("1+1=", "two")}, "answer 'two' holds", "add every", id="answer-outside"),
    pytest.param({"max_new_tokens": 2}, "Task.max_new_tokens=2", "use the longest answer's length + 1", id="too-long"),
    pytest.param({"name": "addition"}, "a task named 'addition' exists already", "replace=True", id="name-taken"),
]


@pytest.mark.parametrize(("change", "words", "fix"), REGISTERED)
def test_registering_a_task_tries_its_prompts_first(change: dict[str, Any], words: str, fix: str) -> None:
    task = Task(**{**GOOD, "name": "unchecked", "make_prompt": lambda rng: ("9+9=", "18"), **change})
    raises(E, lambda: register_task(task), words, fix)
    assert "unchecked" not in task_names(), "a task that failed its check was registered"


def test_registering_something_that_is_not_a_task_says_what_to_pass() -> None:
    raises(E, lambda: register_task(GOOD), "register_task(task)=", "rlnb.data.Task(name, alphabet")  # type: ignore[arg-type]


# -- the command line -----------------------------------------------------------------------


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[Any, str]:
    """``rlnb ARGV`` in this process: its exit status and what it printed on stderr."""
    try:
        status: Any = main(list(argv))
    except SystemExit as exc:
        status = exc.code
    return status, capsys.readouterr().err


FLAGS = [
    pytest.param(["--steps", "-1"], "argument --steps: -1 is invalid", "int >= 0", id="steps-negative"),
    pytest.param(["--steps", "x"], "argument --steps: 'x' is not an int", "int >= 0", id="steps-not-an-int"),
    pytest.param(["--bogus"], "unrecognized arguments: --bogus", "rlnb train --help", id="unknown-flag"),
    pytest.param(["--config", "c.json"], "unrecognized arguments: --config c.json", "--help", id="config-flag"),
    pytest.param(["--mode", "fast"], "argument --mode: invalid choice: 'fast'", "'sync', 'async'", id="mode"),
    pytest.param(["--eval-every", "0"], "argument --eval-every: 0 is invalid", "int >= 1", id="eval-every"),
    pytest.param(["--eval-prompts", "0"], "argument --eval-prompts: 0 is invalid", "int >= 1", id="eval-prompts"),
    pytest.param(["--target-accuracy", "2"], "argument --target-accuracy: 2.0", "(0, 1]", id="target-accuracy"),
    pytest.param(["--lr", "x"], "argument --lr: invalid float value: 'x'", "--help", id="lr-not-a-number"),
    pytest.param(["--lr", "-1"], "--lr -1.0: LearnConfig.lr=-1.0 is invalid", "lr=1e-4", id="lr-negative"),
    pytest.param(["--task", "nope"], "--task nope: Config.task='nope' is unknown", "use one of", id="task"),
    pytest.param(["--group-size", "0"], "--group-size 0: RolloutConfig.group_size=0", ">= 2", id="group-size"),
    pytest.param(["--num-workers", "-1"], "--num-workers -1: DataConfig.num_workers=-1", ">= 0", id="num-workers"),
    pytest.param(["--warmup-steps", "-1"], "--warmup-steps -1: WarmupConfig.steps=-1", ">= 0", id="warmup-steps"),
    pytest.param(
        ["--warmup-task", "sort"],
        "--warmup-task sort: WarmupConfig.task='sort' is invalid",
        "--warmup-task none",
        id="warmup-task",
    ),
    pytest.param(["--tracker", "tensorboard"], "--tracker 'tensorboard'", "use names from", id="tracker-unknown"),
    pytest.param(["--tracker", ","], "--tracker ',' names no backend", "console, jsonl", id="tracker-none"),
    pytest.param(["--run-dir", ""], "--run-dir ''", "give a directory", id="run-dir-empty"),
    pytest.param(["--run-dir", "{file}"], "--run-dir", "it is a file; give a directory", id="run-dir-a-file"),
    pytest.param(["--seed", str(2**64)], f"argument --seed: {2**64} is invalid", "< 2**32", id="seed-too-large"),
    pytest.param(["--seed", "-1"], "argument --seed: -1 is invalid", "int >= 0", id="seed-negative"),
]


@pytest.mark.parametrize(("flags", "words", "fix"), FLAGS)
def test_a_bad_train_flag_is_one_line_naming_the_flag_and_exit_status_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flags: list[str], words: str, fix: str
) -> None:
    (tmp_path / "file").write_text("")
    flags = [f.format(file=tmp_path / "file") for f in flags]
    status, err = cli(capsys, "train", "--steps", "1", "--run-dir", str(tmp_path / "run"), *flags)
    assert status == 2
    assert err.startswith("rlnb train: error: ") and len(err.strip().splitlines()) == 1, err
    assert words in err and fix in err, err
    assert not (tmp_path / "run").exists(), "the run started"


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        pytest.param(["nope"], "invalid choice: 'nope'", id="unknown-command"),
        pytest.param([], "the following arguments are required: COMMAND", id="no-command"),
        pytest.param(["bench", "nope"], "rlnb bench: error: argument name: invalid choice: 'nope'", id="bench"),
        pytest.param(["train", "--run-dir", "r"], "required: --steps", id="steps-missing"),
    ],
)
def test_a_bad_command_is_one_line_and_exit_status_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], words: str
) -> None:
    status, err = cli(capsys, *argv)
    assert status == 2 and len(err.strip().splitlines()) == 1 and words in err and "--help" in err, err


@pytest.mark.parametrize("command", ["demo", "make-tiny-llama"])
def test_a_seed_out_of_range_is_one_line_for_every_command(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str
) -> None:
    """It was a traceback from torch ("Overflow when unpacking long long") after the work had started."""
    where = ["--run-dir", str(tmp_path / "out")] if command == "demo" else [str(tmp_path / "out")]
    status, err = cli(capsys, command, *where, "--seed", str(2**64))
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"rlnb {command}: error: argument --seed: {2**64} is invalid: use an int >= 0 and < 2**32")
    assert not (tmp_path / "out").exists()


def test_a_bad_wandb_mode_in_the_environment_is_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "bogus")
    status, err = cli(capsys, "train", "--steps", "1", "--run-dir", str(tmp_path / "run"))
    assert status == 2 and "WANDB_MODE 'bogus'" in err and "'offline', 'online' or 'disabled'" in err, err
    assert not (tmp_path / "run").exists()


def test_a_group_larger_than_the_default_inflight_is_taken_as_given() -> None:
    from rlnb.cli import _build_parser, _train_config

    args = _build_parser().parse_args(["train", "--steps", "1", "--run-dir", "r", "--group-size", "200"])
    config, _ = _train_config(args)
    assert config.rollout.group_size == 200 and config.rollout.max_inflight == 200


@pytest.mark.parametrize(
    "flags", [["--steps", "x"], ["--run-dir", "{file}"], ["--seed", str(2**64)]], ids=["argparse", "config", "seed"]
)
def test_the_real_command_prints_no_traceback(tmp_path: Path, flags: list[str]) -> None:
    (tmp_path / "file").write_text("")
    flags = [f.format(file=tmp_path / "file") for f in flags]
    proc = subprocess.run(
        [sys.executable, "-m", "rlnb", "train", "--steps", "1", "--run-dir", str(tmp_path / "run"), *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import rlnb
from rlnb.checkpoint import config_from_dict, config_to_dict
from tests.helpers import HookedEngine, assert_same_metrics, ctrl_c_once


def small_config(**changes: object) -> rlnb.Config:
    base = rlnb.Config(
        seed=3,
        data=rlnb.DataConfig(num_workers=1),
        model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2),
        rollout=rlnb.RolloutConfig(group_size=4, groups_per_step=4),
        learn=rlnb.LearnConfig(lr=3e-3, kl_coef=0.05, epochs=2, minibatches=2),
        warmup=rlnb.WarmupConfig(steps=2, batch_size=8),
    )
    return base.replace(**changes)


RESUME = textwrap.dedent(
    """
    import json, sys
    import rlnb

    with rlnb.Session.load(sys.argv[1], name="resumed") as sess:
        history = [sess.step() for _ in range(int(sys.argv[2]))]
        print(json.dumps(history))
    """
)


def test_n_steps_save_load_in_a_new_process_n_steps_equals_2n_straight(tmp_path: Path) -> None:
    n = 2
    with rlnb.Session(small_config(), name="straight") as sess:
        sess.warmup(progress=False)
        straight = [sess.step() for _ in range(2 * n)]
    with rlnb.Session(small_config(), name="first-half") as sess:
        sess.warmup(progress=False)
        first = [sess.step() for _ in range(n)]
        saved = sess.save(tmp_path / "ckpt")
    assert_same_metrics(first, straight[:n])
    assert sorted(p.name for p in saved.iterdir()) == [
        "checkpoint.json",
        "model.safetensors",
        "optimizer.safetensors",
        "reference.safetensors",
        "rng.safetensors",
        "warmup_optimizer.safetensors",
    ]  # JSON and safetensors only: nothing to unpickle
    out = subprocess.run(
        [sys.executable, "-c", RESUME, str(saved), str(n)], capture_output=True, text=True, timeout=120, check=True
    )
    second = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("[")))
    assert_same_metrics(second, straight[n:])
    assert second[-1]["version"] == 2 * n


def test_an_interrupted_rollouts_prompts_survive_a_checkpoint(tmp_path: Path) -> None:
    config = small_config(warmup=rlnb.WarmupConfig())
    with rlnb.Session(config, name="straight") as sess:
        expected = sess.step()
    engine = HookedEngine(config)
    with rlnb.Session(config, name="given-back", engine=engine) as sess:
        # an interrupted step leaves its prompts taken from the loader, to go first
        generating = engine.slow_down(0.05)
        with ctrl_c_once(generating):
            sess.step()
        assert sess.version == 0
        sess.save(tmp_path / "ckpt")
    with rlnb.Session.load(tmp_path / "ckpt", name="loaded") as sess:
        assert_same_metrics([sess.step()], [expected])


def test_async_save_finishes_generations_into_the_buffer_and_load_restores_it(tmp_path: Path) -> None:
    config = small_config(mode="async", warmup=rlnb.WarmupConfig())
    with rlnb.Session(config, name="async") as sess:
        sess.step()
        sess.save(tmp_path / "ckpt")
        stats = sess.statistics()
        assert stats.rollout.dispatching and stats.rollout.state == "running"  # rollouts go on after saving
        saved = json.loads((tmp_path / "ckpt" / "checkpoint.json").read_text())
    groups = saved["buffer"]["partitions"]["train"]
    assert groups, "the background rollouts' groups were saved"
    with rlnb.Session.load(tmp_path / "ckpt", name="loaded") as sess:
        assert sess.version == 1
        assert [g.prompt_id for g in sess.buffer.get_nowait(len(groups))] == [g["prompt_id"] for g in groups]
        assert sess.step()["version"] == 2


def test_buffer_groups_keep_their_prompt_ids_and_a_version_1_checkpoint_gets_them_at_load(tmp_path: Path) -> None:
    config = small_config(mode="async", warmup=rlnb.WarmupConfig())
    with rlnb.Session(config, name="async-ids") as sess:
        sess.step()
        sess.save(tmp_path / "v2")
    manifest = json.loads((tmp_path / "v2" / "checkpoint.json").read_text())
    assert manifest["format_version"] == 2
    ids = [g["prompt_ids"] for g in manifest["buffer"]["partitions"]["train"]]
    assert ids and all(ids)
    with rlnb.Session.load(tmp_path / "v2", name="v2") as sess:
        assert [list(g.prompt_ids) for g in sess.buffer.get_nowait(len(ids))] == ids

    # The same checkpoint as version 1 wrote it: groups without their prompts' token ids.
    shutil.copytree(tmp_path / "v2", tmp_path / "v1")
    manifest["format_version"] = 1
    for group in manifest["buffer"]["partitions"]["train"]:
        del group["prompt_ids"]
    (tmp_path / "v1" / "checkpoint.json").write_text(json.dumps(manifest))
    with rlnb.Session.load(tmp_path / "v1", name="v1") as sess:
        loaded = sess.buffer.get_nowait(len(ids))
        assert [list(g.prompt_ids) for g in loaded] == ids  # tokenised at load
        sess.buffer.put_back(loaded)
        assert sess.step()["version"] == 2


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "ckpt"
    with rlnb.Session(small_config(warmup=rlnb.WarmupConfig()), name="saved") as sess:
        sess.step()
        sess.save(path)
    return path


def copy_of(saved: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(saved, tmp_path / "copy"))


def test_a_flipped_byte_is_reported_as_damage_naming_the_file(saved: Path, tmp_path: Path) -> None:
    ckpt = copy_of(saved, tmp_path)
    data = bytearray((ckpt / "model.safetensors").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (ckpt / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(rlnb.CheckpointError, match=r"model\.safetensors is damaged"):
        rlnb.Session.load(ckpt)


def test_missing_files_and_a_missing_checkpoint_are_named(saved: Path, tmp_path: Path) -> None:
    ckpt = copy_of(saved, tmp_path)
    (ckpt / "optimizer.safetensors").unlink()
    with pytest.raises(rlnb.CheckpointError, match=r"incomplete: optimizer\.safetensors is missing"):
        rlnb.Session.load(ckpt)
    with pytest.raises(rlnb.CheckpointError, match=r"no checkpoint at .*checkpoint\.json is missing"):
        rlnb.Session.load(tmp_path / "nowhere")


def test_a_damaged_manifest_or_another_format_version_is_refused(saved: Path, tmp_path: Path) -> None:
    ckpt = copy_of(saved, tmp_path)
    manifest = ckpt / "checkpoint.json"
    good = manifest.read_text()
    manifest.write_text(good[: len(good) // 2])
    with pytest.raises(rlnb.CheckpointError, match="damaged: not valid JSON"):
        rlnb.Session.load(ckpt)
    manifest.write_text(good.replace('"format_version": 2', '"format_version": 99'))
    with pytest.raises(rlnb.CheckpointError, match="format version 99; this rlnb reads versions 1 to 2"):
        rlnb.Session.load(ckpt)


def test_a_buffer_groups_prompt_ids_outside_the_vocabulary_are_refused(saved: Path, tmp_path: Path) -> None:
    ckpt = copy_of(saved, tmp_path)
    manifest = json.loads((ckpt / "checkpoint.json").read_text())
    sample = rlnb.Sample("1+1=", "2", token_ids=(4,), logprobs=(-1.0,), versions=(0,), reward=1.0)
    manifest["buffer"]["partitions"]["train"] = [rlnb.Group("1+1=", (sample,), prompt_ids=(1, 999)).to_dict()]
    (ckpt / "checkpoint.json").write_text(json.dumps(manifest))
    with pytest.raises(rlnb.CheckpointError, match="buffer group 0 of 'train'"):
        rlnb.Session.load(ckpt)


def test_a_config_that_does_not_fit_the_saved_tensors_is_a_clear_error(saved: Path, tmp_path: Path) -> None:
    ckpt = copy_of(saved, tmp_path)
    manifest = json.loads((ckpt / "checkpoint.json").read_text())
    manifest["config"]["model"]["d_model"] = 64
    (ckpt / "checkpoint.json").write_text(json.dumps(manifest))
    with pytest.raises(rlnb.CheckpointError, match="the saved model does not fit this session"):
        rlnb.Session.load(ckpt)
    assert not rlnb.sessions(), "a failed load leaves no session behind"
    manifest["config"]["model"]["colour"] = "blue"
    (ckpt / "checkpoint.json").write_text(json.dumps(manifest))
    with pytest.raises(rlnb.CheckpointError, match=r"ModelConfig has no field\(s\) \['colour'\]"):
        rlnb.Session.load(ckpt)


def test_save_replaces_a_checkpoint_but_not_other_data(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with rlnb.Session(small_config(warmup=rlnb.WarmupConfig()), name="save") as sess:
        with pytest.raises(rlnb.CheckpointError, match="non-empty directory that holds no checkpoint"):
            sess.save(tmp_path / "notes")
        sess.save(tmp_path / "ckpt")
        sess.step()
        sess.save(tmp_path / "ckpt")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"
    assert json.loads((tmp_path / "ckpt" / "checkpoint.json").read_text())["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "notes"]  # no staging left over


def test_config_round_trips_through_json() -> None:
    config = small_config(mode="async")
    assert config_from_dict(json.loads(json.dumps(config_to_dict(config)))) == config


def quarter(completion: str, answer: str) -> float:
    """A reward no task gives: every completion scores 0.25."""
    return 0.25


def test_a_custom_reward_is_asked_for_again_when_its_checkpoint_loads(tmp_path: Path) -> None:
    config = small_config(warmup=rlnb.WarmupConfig())
    with rlnb.Session(config, name="custom-reward") as sess:
        sess.rollouts.set_reward(quarter)
        sess.save(tmp_path / "ckpt")
    # Loading without it would silently score with the task's reward instead.
    with pytest.raises(rlnb.CheckpointError, match=r"custom reward function \(quarter.*reward=quarter"):
        rlnb.Session.load(tmp_path / "ckpt", name="loaded")
    assert rlnb.sessions() == []
    with rlnb.Session.load(tmp_path / "ckpt", name="loaded", reward=quarter) as sess:
        assert sess.rollouts.reward_name == "quarter"
        assert {s.reward for g in sess.rollout(4) for s in g.samples} == {0.25}  # scored by it
        sess.save(tmp_path / "again")  # and it is recorded again
    with pytest.raises(rlnb.CheckpointError, match="quarter"):
        rlnb.Session.load(tmp_path / "again", name="again")


def test_a_checkpoint_refuses_to_load_where_its_token_ids_mean_other_characters(tmp_path: Path) -> None:
    """A task's alphabet gives each character its token id: the same task with its
    alphabet in another order (built from a set, say) makes the model read and write
    other characters, so a checkpoint records its vocabulary and refuses to load there."""
    import dataclasses

    from rlnb.data import get_task, register_task

    task = dataclasses.replace(get_task("addition"), name="addition-in-order")
    register_task(task, replace=True)
    config = small_config(task=task.name, warmup=rlnb.WarmupConfig())
    with rlnb.Session(config, name="vocab") as sess:
        sess.save(tmp_path / "ckpt")
    saved = json.loads((tmp_path / "ckpt" / "checkpoint.json").read_text())["vocabulary"]
    assert saved["size"] == 15 and saved["tokens"][3:] == list(task.alphabet)
    register_task(dataclasses.replace(task, alphabet=task.alphabet[::-1]), replace=True)
    try:
        with pytest.raises(rlnb.CheckpointError) as info:
            rlnb.Session.load(tmp_path / "ckpt", name="vocab")
        assert rlnb.sessions() == []
    finally:
        register_task(task, replace=True)
    message = str(info.value)
    assert "task 'addition-in-order' gives its characters other token ids than when it was trained" in message
    assert "(id 3 was ['0'], is ['='])" in message and f"the alphabet {task.alphabet!r}" in message
    with rlnb.Session.load(tmp_path / "ckpt", name="vocab") as sess:  # the task as it was: it loads
        sess.step()
    # A checkpoint saved before checkpoints recorded the vocabulary has nothing to check against.
    manifest = json.loads((tmp_path / "ckpt" / "checkpoint.json").read_text())
    del manifest["vocabulary"]
    (tmp_path / "ckpt" / "checkpoint.json").write_text(json.dumps(manifest))
    with rlnb.Session.load(tmp_path / "ckpt", name="vocab") as sess:
        assert sess.version == 0


def test_a_hugging_face_models_checkpoint_refuses_a_tokenizer_that_gives_other_ids(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the 'hf' extra (transformers) is not installed")
    from rlnb.models import tiny_llama

    alphabet = "0123456789+="
    model = tiny_llama(tmp_path / "llama", alphabet=alphabet)
    other = tiny_llama(tmp_path / "other", alphabet=alphabet[::-1])  # the same shapes, other ids
    config = small_config(model=rlnb.ModelConfig(path=str(model), max_len=32), warmup=rlnb.WarmupConfig())
    with rlnb.Session(config, name="hf-vocab") as sess:
        sess.save(tmp_path / "ckpt")
    with pytest.raises(rlnb.CheckpointError, match=r"the tokenizer in '.*other' gives its tokens other token ids"):
        rlnb.Session.load(tmp_path / "ckpt", name="hf-vocab", model_path=other)
    with rlnb.Session.load(tmp_path / "ckpt", name="hf-vocab", model_path=tmp_path / "llama") as sess:
        assert sess.version == 0


SUMS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10, 20) for b in range(10, 14)]


def _sums(name: str, rows: list[dict[str, str]] = SUMS, **options: object) -> rlnb.data.Task:
    options = {"eval_size": 4, "alphabet": "+0123456789=", **options}
    task = rlnb.data.Task.from_records(name, rows, reward=lambda completion, answer: 0.0, **options)  # type: ignore[arg-type]
    return rlnb.data.register_task(task, replace=True)


@pytest.mark.parametrize(
    ("registered", "words"),
    [
        ({"rows": SUMS[:30]}, ["trained on 40 records (SHA-256 ", "now has 30 (SHA-256 "]),
        ({"rows": [*SUMS[:39], {"prompt": "19+13=", "answer": "33"}]}, ["now has 40 other (SHA-256"]),
        ({"prompt": "answer", "answer": "prompt"}, ["now reads prompt='answer', answer='prompt'"]),
        ({"eval_size": 8}, ["held out 4 of its records when it was trained, and now holds out 8"]),
        ({"split_seed": 1}, ["now holds out another 4 (another eval_size or split_seed)"]),
        ({"generated": True}, ["trained on 40 records, and task 'sums-ckpt' now gives prompts from a make_prompt"]),
    ],
    ids=["fewer-records", "one-record-changed", "other-fields", "other-eval-size", "other-split-seed", "generated"],
)
def test_a_checkpoint_refuses_to_load_where_its_records_differ(
    registered: dict[str, object], words: list[str], tmp_path: Path
) -> None:
    """A session loaded on other records went on "mid-epoch" on other prompts and scored
    another held-out set, with no word: a checkpoint records the records' count and
    hash, the fields read and the split, and refuses to load where they differ."""
    import dataclasses

    from rlnb.data import addition, register_task

    _sums("sums-ckpt")
    config = small_config(task="sums-ckpt", data=rlnb.DataConfig(num_workers=0), warmup=rlnb.WarmupConfig())
    with rlnb.Session(config, name="records-ckpt") as sess:
        sess.step()
        sess.save(tmp_path / "ckpt")
    data = json.loads((tmp_path / "ckpt" / "checkpoint.json").read_text())["data"]
    assert data["kind"] == "records" and data["records"] == 40 and data["held_out"] == 4
    if registered.pop("generated", False):
        register_task(dataclasses.replace(addition, name="sums-ckpt", alphabet="+0123456789="), replace=True)
    else:
        _sums("sums-ckpt", **registered)  # type: ignore[arg-type]
    with pytest.raises(rlnb.CheckpointError) as caught:
        rlnb.Session.load(tmp_path / "ckpt", name="records-ckpt")
    assert rlnb.sessions() == []  # refused before anything was built
    for word in [*words, "register the task as it was made then", "Task.from_records('sums-ckpt', "]:
        assert word in str(caught.value), caught.value


def test_the_same_records_from_a_file_load_and_a_checkpoint_without_a_record_of_its_data_loads(
    tmp_path: Path,
) -> None:
    _sums("sums-file")
    config = small_config(task="sums-file", data=rlnb.DataConfig(num_workers=0), warmup=rlnb.WarmupConfig())
    with rlnb.Session(config, name="records-file") as sess:
        sess.step()
        sess.save(tmp_path / "ckpt")
    (tmp_path / "sums.jsonl").write_text("".join(json.dumps(row) + "\n" for row in SUMS))
    _sums("sums-file", tmp_path / "sums.jsonl")  # type: ignore[arg-type]
    with rlnb.Session.load(tmp_path / "ckpt", name="records-file") as sess:
        assert sess.step()["version"] == 2
    manifest_path = tmp_path / "ckpt" / "checkpoint.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "data": {"kind": "records", "records": "40"}}))
    with pytest.raises(rlnb.CheckpointError, match=r"checkpoint.json is damaged: data is \{.*what the session trained"):
        rlnb.Session.load(tmp_path / "ckpt", name="records-file")
    del manifest["data"]  # as saved before checkpoints recorded it: nothing to check against
    manifest_path.write_text(json.dumps(manifest))
    _sums("sums-file", SUMS[:30])
    with rlnb.Session.load(tmp_path / "ckpt", name="records-file") as sess:
        assert sess.version == 1

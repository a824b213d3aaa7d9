"""Live settings (``Session.set``), fork, and what-if of a running session.

The states each call meets, and what it waits for:
- ``set`` never waits for training: learner settings are read at the start of the next
  update (a step already updating keeps its own), rollout settings by each group as it
  is dispatched; it waits only for the bridge loop to take the new sampling settings.
  It runs beside a background run, a foreground step on another thread, a pause (the
  partial rollouts keep theirs) and a full buffer alike.
- ``fork`` quiesces the parent as ``save`` does (in-flight groups finish into the
  buffer, rollouts are left as they were); it refuses a parent that trains in the
  background rather than wait for a step boundary.
- ``what_if`` takes its twins under the trainer's update lock (never half a step) and
  trains them on the caller's thread; ``rescore`` calls the reward on the caller's thread.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from typing import Any

import pytest

import rlnb
from rlnb.config import LIVE_FIELDS, Change, live_value
from rlnb.data import get_task, register_task
from rlnb.engines import FakeEngine
from tests.helpers import TIMING_METRICS, assert_same_metrics, small_config, wait_until

# -- set: the values, where they take effect ----------------------------------------------


def test_set_changes_learner_settings_from_the_next_step_and_records_each_change() -> None:
    with rlnb.Session(small_config(), name="live") as sess:
        first = sess.step()
        assert first["lr"] == pytest.approx(1e-4)
        made = sess.set(lr=3e-3, clip_eps=0.1, max_grad_norm=0.5, lr_decay_steps=100)
        assert [(c.step, c.field, c.old, c.new) for c in made] == [
            (1, "lr", 1e-4, 3e-3),
            (1, "lr_decay_steps", None, 100),
            (1, "clip_eps", 0.2, 0.1),
            (1, "max_grad_norm", 1.0, 0.5),
        ]
        assert sess.changes == made
        learn = sess.config.learn
        assert (learn.lr, learn.clip_eps, learn.max_grad_norm, learn.lr_decay_steps) == (3e-3, 0.1, 0.5, 100)
        assert sess.step()["lr"] == pytest.approx(3e-3 * (1 - 1 / 100))  # the decay counts from step 0
        assert sess.set(lr=3e-3) == []  # the value in force: nothing to record
        assert len(sess.changes) == 4
        assert "step 1: lr 0.0001 -> 0.003" in str(made[0])


def test_sampling_settings_apply_to_the_groups_dispatched_after_the_call() -> None:
    with rlnb.Session(small_config(), name="live") as sess:
        sess.step()
        sess.set(group_size=6, temperature=0.0, max_new_tokens=2, groups_per_step=3)
        sess.step()
        batch = sess.batches[-1]
        assert len(batch.groups) == 3
        assert {len(g.samples) for g in batch.groups} == {6}
        for group in batch.groups:
            assert len({s.completion for s in group.samples}) == 1  # greedy: one completion per prompt
            assert all(len(s.token_ids) <= 2 for s in group.samples)
        assert sess.history[-1]["groups"] == 3


def test_in_flight_samples_keep_their_settings_and_are_counted() -> None:
    config = small_config(mode="async", rollout=rlnb.RolloutConfig(group_size=4, groups_per_step=4))
    engine = FakeEngine(lengths=4, token_delay=0.02)  # slow enough to pause with samples in flight
    with rlnb.Session(config, name="live", engine=engine) as sess:
        sess.rollouts.start()
        wait_until(lambda: sess.statistics().rollout.in_flight > 0, "samples in flight")
        sess.rollouts.pause("abort")  # in-flight samples become partial rollouts, waiting to continue
        before = sess.statistics().rollout
        live = before.in_flight + before.kept_partial
        assert live > 0 and before.old_settings_in_flight == 0
        sess.set(temperature=0.5)
        assert sess.statistics().rollout.old_settings_in_flight >= live
        sess.rollouts.resume()
        sess.step()
        wait_until(lambda: sess.statistics().rollout.old_settings_in_flight == 0, "the old groups to end")
        sess.rollouts.stop()


def test_a_bad_change_raises_the_configs_error_and_changes_nothing() -> None:
    with rlnb.Session(small_config(), name="live") as sess:
        sess.step()
        config = sess.config
        cases: list[tuple[dict[str, Any], str]] = [
            ({"lr": -1.0}, "LearnConfig.lr=-1.0 is invalid"),
            ({"group_size": 1}, "RolloutConfig.group_size=1 is invalid"),
            ({"lr": 1e-3, "top_p": 2.0}, "top_p"),  # a good one beside a bad one: neither is made
            ({"mode": "async"}, "Config.mode cannot change in a running session"),
            ({"d_model": 64}, "ModelConfig.d_model cannot change in a running session"),
            ({"temprature": 0.5}, "did you mean temperature=...?"),
            ({"kl_coef": 0.1}, "this session started with kl_coef=0"),
            ({"reward_weights": (1.0, 2.0)}, "has 1 reward function(s)"),
            ({"max_new_tokens": 500}, "set(max_new_tokens=500): ModelConfig.max_len=32 is invalid"),
        ]
        for changes, words in cases:
            with pytest.raises(rlnb.ConfigError) as info:
                sess.set(**changes)
            assert words in str(info.value), (changes, str(info.value))
            if "cannot change" in words or "not a setting" in words or "did you mean" in words:
                assert "the live settings are lr, lr_decay_steps" in str(info.value)
        assert sess.config == config and sess.changes == []
        assert sess.step()["lr"] == pytest.approx(1e-4)


def test_set_while_training_in_the_background_takes_effect_at_a_step_boundary() -> None:
    with rlnb.Session(small_config(mode="async"), name="live") as sess:
        sess.training.start()
        wait_until(lambda: len(sess.history) >= 2, "two background steps")
        (change,) = sess.set(lr=2e-3)
        wait_until(lambda: sess.version >= change.step + 3, "three more steps")
        sess.training.stop()
        lrs = {int(m["version"]): m["lr"] for m in sess.history}
        assert all(lr == pytest.approx(1e-4) for v, lr in lrs.items() if v <= change.step)
        # The step updating when set() came keeps its lr; every later one has the new one.
        assert all(lr == pytest.approx(2e-3) for v, lr in lrs.items() if v >= change.step + 2)


def test_set_from_another_thread_during_a_foreground_train() -> None:
    with rlnb.Session(small_config(), name="live") as sess:
        done: list[Change] = []

        class SetOnce(rlnb.learn.Callback):
            def on_step_end(self, metrics: object) -> None:
                if not done:  # a callback that calls back into the session
                    thread = threading.Thread(target=lambda: done.extend(sess.set(temperature=0.7)))
                    thread.start()
                    thread.join()

        sess.callbacks.append(SetOnce())
        sess.train(3, progress=False)
        assert [c.field for c in done] == ["temperature"] and sess.config.rollout.temperature == 0.7


def test_reward_weights_change_the_rewards_of_later_groups() -> None:
    def short(completion: str, answer: object) -> float:
        return 1.0 if len(completion) <= 2 else 0.0

    base = get_task("addition")
    assert callable(base.reward)
    task = register_task(
        dataclasses.replace(base, name="addition-two-rewards", reward=[base.reward, short]), replace=True
    )
    with rlnb.Session(small_config(task=task.name), name="live") as sess:
        sess.step()
        (change,) = sess.set(reward_weights=(0.0, 2.0))
        assert (change.old, change.new) == (None, (0.0, 2.0))
        sess.step()
        for group in sess.batches[-1].groups:
            for s in group.samples:
                assert s.reward == pytest.approx(2.0 * (s.rewards["short"] or 0.0))
        sess.rollouts.set_reward(lambda completion, answer: 1.0)
        with pytest.raises(rlnb.ConfigError, match=r"a custom reward from sess\.rollouts\.set_reward\(\)"):
            sess.set(reward_weights=(1.0, 1.0))


def test_every_live_field_can_be_set() -> None:
    values = {
        "lr": 2e-4,
        "lr_decay_steps": 50,
        "kl_coef": 0.0,
        "clip_eps": 0.3,
        "is_cap": 3.0,
        "max_grad_norm": 2.0,
        "temperature": 0.9,
        "top_p": 0.9,
        "top_k": 5,
        "max_new_tokens": 3,
        "max_policy_lag": 2,
        "groups_per_step": 2,
        "group_size": 3,
        "reward_weights": (2.0,),
    }
    # the algorithm and its own fields; clip_eps=None so that it hides neither clip bound
    algorithm = {"algorithm": "dapo", "clip_eps": None, "clip_low": 0.1, "clip_high": 0.35, "entropy_coef": 0.001}
    assert set(values) | set(algorithm) == set(LIVE_FIELDS)
    config = small_config(learn=rlnb.LearnConfig(kl_coef=0.01))
    with rlnb.Session(config, name="live") as sess:
        made = sess.set(**values) + sess.set(**algorithm)
        assert {c.field for c in made} == set(LIVE_FIELDS)
        for field, value in {**values, **algorithm}.items():
            if field not in ("algorithm", "clip_eps"):
                assert live_value(sess.config, field) == value, field
        assert sess.config.learn.resolved_algorithm == rlnb.algorithms.preset("dapo").replace(
            clip_low=0.1, clip_high=0.35, entropy_coef=0.001, correction_high=3.0, kl_coef=0.0
        )
        (changed,) = [c for c in made if c.field == "algorithm"]
        assert changed.old == "grpo" and changed.as_dict()["new"].startswith("custom (")  # dapo, changed
        assert "clip_high=0.35" in changed.as_dict()["new"]
        metrics = sess.step()
        assert metrics["groups"] == 2 and sess.batches[-1].groups[0].samples.__len__() == 3


# -- where changes are recorded -------------------------------------------------------------


def test_changes_reach_the_console_and_the_jsonl_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    track = rlnb.TrackConfig(backends=("console", "jsonl"), run_dir=str(tmp_path / "run"))
    with rlnb.Session(small_config(track=track), name="live") as sess:
        sess.step()
        sess.set(lr=1e-3, reward_weights=(0.5,))
        sess.step()
    out = capsys.readouterr().out
    assert "rlnb: step 1: lr 0.0001 -> 0.001" in out and "rlnb: step 1: reward_weights None -> (0.5)" in out
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    changes = [r for r in records if r.get("event") == "change"]
    assert [(c["step"], c["field"], c["old"], c["new"]) for c in changes] == [
        (1, "lr", 1e-4, 1e-3),
        (1, "reward_weights", None, [0.5]),
    ]
    steps = [r for r in records if "step" in r and "event" not in r]
    assert [r["lr"] for r in steps] == pytest.approx([1e-4, 1e-3])


def test_wandb_gets_the_new_config_and_a_marker(wandb_offline: Path) -> None:
    track = rlnb.TrackConfig(backends=("wandb",), run_dir=str(wandb_offline / "run"), wandb_mode="offline")
    with rlnb.Session(small_config(track=track), name="live") as sess:
        sess.step()
        sess.set(lr=1e-3)
        run = sess.tracker.backend("wandb").run  # type: ignore[attr-defined]
        assert run.config["learn"]["lr"] == 1e-3
        sess.step()  # wandb commits a step's row once a later step arrives: the marker's is committed now
        assert run.summary["change/lr"] == 1e-3


def test_a_checkpoint_keeps_the_settings_in_force_and_the_change_log(tmp_path: Path) -> None:
    """Exact resume of a run with changes in it: the loaded session goes on as the saved one did."""
    with rlnb.Session(small_config(), name="saved") as sess:
        sess.train(2, progress=False)
        sess.set(lr=2e-3, temperature=0.8, group_size=5)
        sess.step()
        sess.save(tmp_path / "ckpt")
        config, changes = sess.config, sess.changes
        expected = sess.train(2, progress=False)
    with rlnb.Session.load(tmp_path / "ckpt", name="loaded") as loaded:
        assert loaded.config == config and loaded.changes == changes
        assert_same_metrics(loaded.train(2, progress=False), expected)
        assert {len(g.samples) for g in loaded.batches[-1].groups} == {5}


# -- fork -------------------------------------------------------------------------------------


def test_a_fork_without_changes_steps_as_its_parent() -> None:
    """Same samples, rewards and updates; a loss near zero may differ in its last bits (summation order)."""
    with rlnb.Session(small_config(), name="parent") as parent:
        parent.train(2, progress=False)
        parent.set(lr=1e-3)
        with parent.fork("child") as child:
            assert child.version == parent.version == 2
            assert child.history == parent.history and child.changes == parent.changes
            assert child.config == parent.config
            assert_same_metrics([child.step() for _ in range(2)], [parent.step() for _ in range(2)])
            assert rlnb.sessions() == [parent, child] or set(rlnb.sessions()) == {parent, child}
        assert child.closed and not parent.closed
        parent.step()  # the parent goes on after its fork closed


def test_a_fork_with_changes_and_its_parent_train_side_by_side_in_the_background(tmp_path: Path) -> None:
    track = rlnb.TrackConfig(backends=("jsonl",), run_dir=str(tmp_path / "run"))
    with rlnb.Session(small_config(mode="async", track=track), name="parent") as parent:
        parent.train(2, progress=False)
        size = parent.buffer.size()
        child = parent.fork("hot", temperature=1.5, lr=5e-4)
        try:
            # The buffer's groups came along, and the groups in flight, finished into it first.
            assert child.buffer.size() >= size
            assert (child.config.rollout.temperature, child.config.learn.lr) == (1.5, 5e-4)
            assert parent.config.rollout.temperature == 1.0 and parent.changes == []
            assert [(c.step, c.field) for c in child.changes] == [(2, "lr"), (2, "temperature")]
            parent.training.start(steps=2)
            child.training.start(steps=2)
            parent.training.wait()
            child.training.wait()
            assert parent.version == child.version == 4
            assert child.history[-1]["lr"] == pytest.approx(5e-4) and parent.history[-1]["lr"] == pytest.approx(1e-4)
        finally:
            child.close()
    fork_dir = tmp_path / "run-hot"  # the fork's tracker writes beside the parent's run
    records = [json.loads(line) for line in (fork_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["field"] for r in records if r.get("event") == "change"] == ["lr", "temperature"]
    assert [r["step"] for r in records if "lr" in r and "event" not in r] == [3, 4]


def test_a_fork_is_refused_before_anything_is_made() -> None:
    with rlnb.Session(small_config(), name="parent") as parent:
        parent.step()
        for name in ("parent", "", 3):
            with pytest.raises(rlnb.ConfigError, match="give the new session a name of its own"):
                parent.fork(name)  # type: ignore[arg-type]
        with pytest.raises(rlnb.ConfigError, match=r"LearnConfig\.lr=0 is invalid"):
            parent.fork("child", lr=0)
        parent.training.start()
        try:
            with pytest.raises(RuntimeError, match=r"fork\(\) cannot run while training .* call stop\(\) first"):
                parent.fork("child")
        finally:
            parent.training.stop()
        assert rlnb.sessions() == [parent]
        parent.step()


def test_a_fork_carries_a_custom_reward() -> None:
    def always(completion: str, answer: object) -> float:
        return 0.25

    with rlnb.Session(small_config(), name="parent") as parent:
        parent.rollouts.set_reward(always)
        with parent.fork("child") as child:
            assert child.rollouts.reward_name == parent.rollouts.reward_name
            assert child.step()["reward_mean"] == pytest.approx(0.25)


# -- what if, rescore -----------------------------------------------------------------------------


def test_what_if_and_rescore_leave_the_session_as_a_twin_that_did_not_ask() -> None:
    with (
        rlnb.Session(small_config(), name="asks") as asks,
        rlnb.Session(small_config(), name="twin") as twin,
    ):
        assert_same_metrics(asks.train(2, progress=False), twin.train(2, progress=False))
        result = asks.what_if(lr=1e-2, clip_eps=0.05)
        asks.what_if(batch=0, kl_coef=0.0, is_cap=1.5)
        asks.rescore(reward=lambda completion, answer: float(len(completion)))
        assert asks.version == 2 and len(asks.history) == 2
        assert_same_metrics(asks.train(2, progress=False), twin.train(2, progress=False))
    assert result.step == 2 and dict(result.changes) == {"lr": 1e-2, "clip_eps": 0.05}
    assert result.recorded == asks.history[1]
    # Before the update, lr changes nothing; the update moves the policy further with a larger lr.
    assert result.changed["loss"] == pytest.approx(result.baseline["loss"])
    assert result.changed["update_kl"] > result.baseline["update_kl"] > 0
    assert "update_kl" in repr(result) and "<table>" in result._repr_html_()


def test_what_if_without_changes_matches_the_baseline_and_works_in_the_background() -> None:
    with rlnb.Session(small_config(mode="async"), name="asks") as sess:
        sess.training.start()
        wait_until(lambda: len(sess.batches) >= 2, "two kept batches")
        result = sess.what_if()
        sess.training.stop()
    assert {k: result.changed[k] for k in result.changed if k not in TIMING_METRICS} == pytest.approx(
        {k: result.baseline[k] for k in result.baseline if k not in TIMING_METRICS}
    )


def test_batches_keeps_the_last_n_and_what_if_says_when_there_are_none() -> None:
    config = small_config(learn=rlnb.LearnConfig(keep_batches=2))
    with rlnb.Session(config, name="kept") as sess:
        with pytest.raises(RuntimeError, match="no step has been trained yet"):
            sess.what_if(lr=1e-3)
        sess.train(3, progress=False)
        kept = sess.batches
        assert [b.step for b in kept] == [2, 3]
        batch = kept[-1]
        assert batch.metrics == sess.history[-1] and batch.config == sess.config.learn
        assert len(batch.advantages) == len(batch.groups) == 4
        for group, advantages in zip(batch.groups, batch.advantages, strict=True):
            rewards = [s.reward for s in group.samples]
            if len(set(rewards)) == 1:
                assert advantages == pytest.approx([0.0] * len(rewards))
            assert sum(advantages) == pytest.approx(0.0, abs=1e-5)
        with pytest.raises(IndexError, match="2 batches are kept"):
            sess.what_if(batch=5)
        with pytest.raises(rlnb.ConfigError, match="kl_coef"):
            sess.what_if(kl_coef=0.1)
    with rlnb.Session(small_config(learn=rlnb.LearnConfig(keep_batches=0)), name="none") as sess:
        sess.step()
        assert sess.batches == []
        with pytest.raises(RuntimeError, match=r"LearnConfig\.keep_batches is 0"):
            sess.rescore(reward=lambda c, a: 1.0)


def test_rescore_gives_the_rewards_and_advantages_under_another_reward() -> None:
    with rlnb.Session(small_config(), name="rescore") as sess:
        sess.step()
        flat = sess.rescore(reward=lambda completion, answer: 1.0)
        assert all(a == pytest.approx(0.0) for group in flat["advantages"] for a in group)
        by_length = sess.rescore(-1, reward=lambda completion, answer: float(len(completion)))
        batch = sess.batches[-1]
        assert by_length["rewards"] == [[float(len(s.completion)) for s in g.samples] for g in batch.groups]
        assert by_length["recorded_rewards"] == [[s.reward for s in g.samples] for g in batch.groups]
        answers = sess.rescore(reward=lambda completion, answer: float(completion == str(answer)))
        task = get_task("addition")  # each group's answer is its prompt's, made again from its id
        assert answers["rewards"] == [
            [float(s.completion == str(task.item(0, g.prompt_id).answer)) for s in g.samples] for g in batch.groups
        ]
        with pytest.raises(rlnb.ConfigError, match=r"rescore\.reward"):
            sess.rescore(reward="not a function")


def test_logprobs_are_the_current_policys_for_each_completion_token() -> None:
    with rlnb.Session(small_config(), name="logprobs") as sess:
        rolled = sess.rollout(2)  # by the engine's copy of the same weights: the learner agrees
        learner = sess.logprobs(rolled)
        for group, per_sample in zip(rolled, learner, strict=True):
            for sample, values in zip(group.samples, per_sample, strict=True):
                assert len(values) == len(sample.token_ids)
                assert values == pytest.approx(list(sample.logprobs), abs=1e-4)
        sess.step()
        assert [len(v) for v in sess.logprobs(sess.batches[-1])[0]] == [
            len(s.token_ids) for s in sess.batches[-1].groups[0].samples
        ]
        assert sess.logprobs([]) == [] and sess.version == 1


# -- issue 42: a fork never replaces a session, its run dir is its own --------------------------


def test_a_fork_never_replaces_a_live_session_not_even_its_own_earlier_fork() -> None:
    """It used to close an unrelated session of that name, even one training in the background."""
    with (
        rlnb.Session(small_config(mode="async"), name="other") as other,
        rlnb.Session(small_config(), name="parent") as parent,
    ):
        parent.step()
        other.training.start()
        try:
            with pytest.raises(rlnb.ConfigError, match=r"a live session is called 'other' .* pick another name"):
                parent.fork("other")
            assert not other.closed and other.training.running
        finally:
            other.training.stop()
        with parent.fork("a") as first:
            with pytest.raises(rlnb.ConfigError, match=r"fork\(name='a'\) is invalid: a live session is called 'a'"):
                parent.fork("a")
            assert not first.closed and first.step()["version"] == 2
        with parent.fork("a") as again:  # once closed, the name is free
            assert again.version == 1
        assert set(rlnb.sessions()) == {other, parent}


def test_each_fork_writes_to_a_run_dir_of_its_own(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """ "x y" and "x?y" shared one directory and interleaved their metrics; an existing
    directory of another run, or a live session's, is left to it and the next free one taken."""
    run = tmp_path / "run"
    track = rlnb.TrackConfig(backends=("jsonl",), run_dir=str(run))
    (tmp_path / "run-old").mkdir()
    (tmp_path / "run-old" / "metrics.jsonl").write_text('{"event": "start", "run_id": "earlier"}\n')
    own = rlnb.TrackConfig(backends=("jsonl",), run_dir=str(tmp_path / "run-b"))
    with (
        rlnb.Session(small_config(track=own), name="b-elsewhere") as elsewhere,
        rlnb.Session(small_config(track=track), name="parent") as parent,
    ):
        parent.step()
        forks = [parent.fork(name) for name in ("x y", "x?y", "old", "b")]
        try:
            dirs = [Path(str(f.config.track.run_dir)) for f in forks]
            for f in forks:
                f.step()
        finally:
            for f in forks:
                f.close()
        assert elsewhere.config.track.run_dir == str(tmp_path / "run-b")
    assert len(set(dirs)) == 4 and all(d.parent == tmp_path and d.name.startswith("run-") for d in dirs)
    assert dirs[2:] == [tmp_path / "run-old-2", tmp_path / "run-b-2"]
    out = capsys.readouterr().out
    assert (
        f"fork 'old' writes its run to {tmp_path / 'run-old-2'} ({tmp_path / 'run-old'} holds another run's files)"
        in out
    )
    assert f"({tmp_path / 'run-b'} is a live session's run dir)" in out
    for d in dirs:
        records = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        assert [r["event"] for r in records if "event" in r] == ["start", "finish"]  # one run each
    assert (tmp_path / "run-old" / "metrics.jsonl").read_text() == '{"event": "start", "run_id": "earlier"}\n'


# -- issue 42: what-if, rescore, logprobs and explore read only what they can ---------------------


def test_a_batch_of_another_task_or_vocabulary_is_refused_naming_both_sessions() -> None:
    """It was read with this session's vocabulary: numbers for other tokens, or an IndexError."""
    pytest.importorskip("ipywidgets")
    calculator = small_config(task="calculator", model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2, max_len=48))
    with (
        rlnb.Session(small_config(), name="adds") as adds,
        rlnb.Session(small_config(task="reverse"), name="reverses") as reverses,
        rlnb.Session(calculator, name="multiplies") as multiplies,
    ):
        adds.step()
        reverses.step()
        theirs = adds.batches[-1]
        assert theirs.origin is not None and (theirs.origin.session, theirs.origin.task) == ("adds", "addition")
        said = r"it was kept by session 'adds' on task 'addition' \(seed 0\), and this is session 'reverses' on task"
        for call, ask in (
            ("what_if", lambda: reverses.what_if(theirs, lr=1e-3)),
            ("rescore", lambda: reverses.rescore(theirs, reward=lambda c, a: 1.0)),
            ("logprobs", lambda: reverses.logprobs(theirs)),
            ("explore", lambda: reverses.explore(theirs)),
        ):
            with pytest.raises(rlnb.ConfigError, match=rf"{call}\(.*\) is invalid: {said}.* another vocabulary"):
                ask()
        with pytest.raises(rlnb.ConfigError, match="outside this session's vocabulary of 15 ids"):
            adds.logprobs(multiplies.rollout(1))  # groups another tokenizer made (an IndexError before)
        # A fork has its parent's task, seed and vocabulary: its parent's batches read as its own.
        with adds.fork("adds-b") as fork:
            assert fork.rescore(theirs, reward=lambda c, a: 1.0)["rewards"] == [[1.0] * 4] * 4
            assert fork.logprobs(theirs) and fork.what_if(theirs).step == 1
    with (
        rlnb.Session(small_config(seed=1), name="seed-1") as one,
        rlnb.Session(small_config(seed=2), name="seed-2") as two,
    ):
        one.step()
        with pytest.raises(rlnb.ConfigError, match="drawn with another seed, so its prompt ids name other prompts"):
            two.rescore(one.batches[-1], reward=lambda c, a: 1.0)


class _Talk:
    """An environment that answers every first turn and closes the second, with rewards."""

    def __init__(self) -> None:
        self.turns = 0

    def reset(self, row: Any) -> None:
        return None

    def step(self, completion: str) -> Any:
        from rlnb.envs import Turn

        self.turns += 1
        return Turn("1+1", reward=0.5) if self.turns == 1 else Turn(None, reward=1.0, done=True)


def _length_and_env(completion: str, answer: object, env_reward: float | None = None) -> float:
    return len(completion) + 10 * (env_reward or 0.0)


def test_rescore_of_conversations_scores_the_last_turn_with_the_environments_reward() -> None:
    """It scored the whole transcript without env_reward: [10, 5, 9, 7] for the recorded [8, 6, 8, 6]."""
    addition = get_task("addition")
    task = register_task(
        rlnb.data.Task(
            "talks",
            alphabet=addition.alphabet,
            make_prompt=addition.make_prompt,
            reward=_length_and_env,
            max_new_tokens=4,
            env=_Talk,
            max_turns=2,
        ),
        replace=True,
    )
    config = small_config(task="talks", model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2, max_len=48))
    with rlnb.Session(config, name="talks") as sess:
        sess.step()
        batch = sess.batches[-1]
        assert all(s.is_conversation and s.env_reward == 0.5 for g in batch.groups for s in g.samples)
        again = sess.rescore(reward=task.rewards.functions[0].fn)
        assert again["rewards"] == again["recorded_rewards"]
        assert [a for g in again["advantages"] for a in g] == pytest.approx(
            [a for g in again["recorded_advantages"] for a in g]
        )


def test_rescore_names_a_reward_that_fails_and_the_sample() -> None:
    """A NaN was a private ``BadValue: nan``."""

    def not_a_number(completion: str, answer: object) -> float:
        return float("nan")

    def broken(completion: str, answer: object) -> float:
        raise KeyError("score")

    with rlnb.Session(small_config(), name="rescore-bad") as sess:
        sess.step()
        with pytest.raises(
            rlnb.RolloutError,
            match=r"rescore\(\): the reward function 'not_a_number' returned nan for group 0, sample 0: prompt \d+ "
            r".*a reward must be a finite number.*or None when it does not apply",
        ):
            sess.rescore(reward=[lambda c, a: 1.0, not_a_number], reward_weights=[0.0, 1.0])
        with pytest.raises(
            rlnb.RolloutError, match=r"rescore\(\): a reward function raised KeyError\('score'\) for group 0"
        ) as info:
            sess.rescore(reward=broken)
        assert isinstance(info.value.__cause__, KeyError)

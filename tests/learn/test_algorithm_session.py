"""An algorithm in a session, end to end (``LearnConfig(algorithm=...)``: the
``rlnb.algorithms`` parts run by the learner): every preset trains in sync and async
mode; a function as advantage or loss trains in the foreground and the background,
and one that raises fails its step and loses nothing; switching mid-run is recorded
and resumes exactly; a checkpoint with a function part asks for it again; whether a
clip can act; ``what_if`` and ``fork`` with an algorithm; the default is GRPO as it was.
"""

from __future__ import annotations

import json
import math
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import rlnb
from rlnb.algorithms import Algorithm, preset
from rlnb.data import Task, register_task
from tests.helpers import Recorder, assert_same_metrics, cause_chain, small_config

PRESETS = [name for name, _ in rlnb.algorithms.algorithms()]

# -- parts of one's own, as functions ---------------------------------------------------------


def centred(rewards: torch.Tensor, **context: Any) -> torch.Tensor:
    """Each group's rewards less their mean (a function part a checkpoint names)."""
    return rewards - rewards.mean(dim=1, keepdim=True)


def reinforce(inputs: Any) -> torch.Tensor:
    """Plain REINFORCE per token: -A log pi."""
    adv = inputs.advantages
    return -(adv[:, None] if adv.dim() == 1 else adv) * inputs.logp


class Flaky:
    """A part (``advantage`` or ``loss``) that counts its calls and, once ``fail_from``
    is set, raises its own error from that call on (counted from when it was set)."""

    def __init__(self, part: str) -> None:
        self.part, self.calls = part, 0
        self.fail_from: int | None = None
        self._lock = threading.Lock()

    def arm(self, fail_from: int = 1) -> None:
        with self._lock:
            self.calls, self.fail_from = 0, fail_from

    def disarm(self) -> None:
        with self._lock:
            self.fail_from = None

    def _count(self) -> None:
        with self._lock:
            self.calls += 1
            if self.fail_from is not None and self.calls >= self.fail_from:
                raise ZeroDivisionError(f"flaky {self.part} failed on call {self.calls}")

    def advantage(self, rewards: torch.Tensor, **context: Any) -> torch.Tensor:
        self._count()
        return centred(rewards)

    def loss(self, inputs: Any) -> torch.Tensor:
        self._count()
        return reinforce(inputs)

    def algorithm(self) -> Algorithm:
        return Algorithm(**{self.part: getattr(self, self.part)})


def _weights(sess: rlnb.Session) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in sess.policy.state_dict().items()}


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def half_flat() -> Iterator[str]:
    """A task where half the prompts score every completion 0 (flat groups, no signal)
    and the rest score its characters' codes mod 3 (mostly groups with signal)."""

    def reward(completion: str, answer: str) -> float:
        return 0.0 if answer == "0" else float(sum(map(ord, completion)) % 3)

    rows = [{"prompt": f"{i}+{i}=", "answer": str(i % 2)} for i in range(40)]
    register_task(Task.from_records("half-flat", rows, reward=reward, eval_size=0), replace=True)
    yield "half-flat"


# -- 1. every preset trains ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_trains_in_sync_and_async_mode(name: str, mode: str, half_flat: str) -> None:
    # step_timeout: an async step that waits in vain fails in seconds, not two minutes
    config = small_config(task=half_flat, mode=mode, step_timeout=20.0, learn=rlnb.LearnConfig(algorithm=name))
    with rlnb.Session(config, name="preset") as sess:
        assert sess.config.learn.resolved_algorithm == preset(name)
        before = _weights(sess)
        steps = [sess.step() for _ in range(2)]
        assert sess.version == 2 and [m["version"] for m in steps] == [1.0, 2.0]
        assert not _same_weights(before, _weights(sess)), "two steps left the weights as they were"
    for m in steps:
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]), m
        if preset(name).dynamic_sampling:
            # flat groups are dropped, and more rolled out (or taken) until the step is full
            assert m["groups"] == 4.0, m
        else:
            assert (m["groups"], m["groups_dropped"]) == (4.0, 0.0), m
    if preset(name).drop_flat_groups:
        assert sum(m["groups_dropped"] for m in steps) > 0  # the task gave flat groups to drop


def test_each_preset_makes_its_own_update_of_the_same_batch(half_flat: str) -> None:
    """Sync mode, one seed: every preset's first step rolls out the same groups (dapo
    more), and none updates as grpo does."""
    grad_norms = {}
    for name in PRESETS:
        config = small_config(task=half_flat, learn=rlnb.LearnConfig(algorithm=name))
        with rlnb.Session(config, name=name) as sess:
            grad_norms[name] = sess.step()["grad_norm"]
    assert grad_norms["grpo"] > 0
    same = [name for name in PRESETS[1:] if grad_norms[name] == pytest.approx(grad_norms["grpo"], rel=1e-3)]
    assert not same, f"{same} updated as grpo does: {grad_norms}"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_dynamic_sampling_fills_the_step_with_groups_that_have_signal(mode: str, half_flat: str) -> None:
    config = small_config(task=half_flat, mode=mode, step_timeout=20.0, learn=rlnb.LearnConfig(algorithm="dapo"))
    recorder = Recorder()
    with rlnb.Session(config, name="dapo", callbacks=[recorder]) as sess:
        steps = [sess.step() for _ in range(3)]
        taken = [[[s.reward for s in g.samples] for g in batch.groups] for batch in sess.batches]
    assert [m["groups"] for m in steps] == [4.0, 4.0, 4.0]
    # each step took groups until 4 had signal, and dropped (did not train on) the flat ones
    assert [sum(len(set(rewards)) > 1 for rewards in batch) for batch in taken] == [4, 4, 4], taken
    assert [len(batch) for batch in taken] == [4 + m["groups_dropped"] for m in steps]
    assert [len(batch) for batch in recorder.batches] == [len(batch) for batch in taken]
    assert sum(m["groups_dropped"] for m in steps) > 0


# -- 2. functions as parts -------------------------------------------------------------------------


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("part", ["advantage", "loss"])
def test_a_function_as_a_part_trains(part: str, mode: str, background: bool) -> None:
    fn = Flaky(part)
    config = small_config(mode=mode, learn=rlnb.LearnConfig(algorithm=fn.algorithm()))
    with rlnb.Session(config, name="mine") as sess:
        assert sess.config.learn.resolved_algorithm.functions == (f"{__name__}.Flaky.{part}",)
        fn.arm(fail_from=10**9)  # count the calls from here
        if background:
            sess.training.start(2)
            sess.training.wait()
            steps = sess.history
        else:
            steps = [sess.step() for _ in range(2)]
        assert sess.version == 2
    assert len(steps) == 2 and all(math.isfinite(m["loss"]) for m in steps)
    assert fn.calls >= 2  # the learner ran the function, once a step at least


def weighted_reinforce(inputs: Any) -> torch.Tensor:
    """The built-in "reinforce" loss, written as a function: -w A log pi."""
    return reinforce(inputs) * rlnb.algorithms.functional.mismatch_weight(inputs)


@pytest.mark.parametrize(
    ("mine", "built_in"),
    [
        (Algorithm(advantage=centred), Algorithm(advantage="dr_grpo")),
        (Algorithm(loss=weighted_reinforce), Algorithm(loss="reinforce")),
    ],
    ids=["advantage", "loss"],
)
def test_a_function_part_trains_as_the_built_in_part_it_equals(mine: Algorithm, built_in: Algorithm) -> None:
    runs = []
    for i, algorithm in enumerate((mine, built_in)):
        with rlnb.Session(small_config(learn=rlnb.LearnConfig(algorithm=algorithm, lr=1e-2)), name=f"run-{i}") as sess:
            runs.append(sess.train(3, progress=False))
    assert max(m["grad_norm"] for m in runs[1]) > 0
    assert_same_metrics(runs[0], runs[1])


def test_an_advantage_function_of_zeros_trains_nothing() -> None:
    zeros = Algorithm(advantage=lambda rewards, **context: torch.zeros_like(rewards))
    with rlnb.Session(small_config(learn=rlnb.LearnConfig(algorithm=zeros)), name="zeros") as sess:
        before = _weights(sess)
        steps = sess.train(2, progress=False)
        assert _same_weights(before, _weights(sess))
    assert [m["grad_norm"] for m in steps] == [0.0, 0.0]


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("part", ["advantage", "loss"])
def test_a_function_that_raises_fails_its_step_and_loses_nothing(part: str, mode: str, background: bool) -> None:
    """Two updates a step (epochs=2): the loss fails on the second, after the first has
    moved the weights; they are put back, as for a loss that is not finite."""
    fn = Flaky(part)
    recorder = Recorder()
    config = small_config(mode=mode, learn=rlnb.LearnConfig(algorithm=fn.algorithm(), epochs=2, lr=1e-2))
    with rlnb.Session(config, name="mine", callbacks=[recorder]) as sess:
        sess.step()
        weights, history = _weights(sess), list(sess.history)
        fn.arm(fail_from=2 if part == "loss" else 1)
        if background:
            sess.training.start(2)
            with pytest.raises(rlnb.TrainingError) as info:
                sess.training.wait()
            chain = cause_chain(info.value)
            assert any(isinstance(e, ZeroDivisionError) for e in chain), chain  # its own error, chained
            error = next(e for e in chain if isinstance(e, ZeroDivisionError))
        else:
            with pytest.raises(ZeroDivisionError, match=f"flaky {part} failed") as raised:
                sess.step()  # its own error, as it raised it
            error = raised.value
        frames = [f.name for f in traceback.extract_tb(error.__traceback__)]
        assert frames[-2:] == [part, "_count"], frames  # with its own traceback
        assert sess.version == 1 and sess.history == history
        assert _same_weights(weights, _weights(sess)), "the failed step changed the weights"
        failed = recorder._batch
        # fixed: the next step trains, on the failed step's prompts (they were not lost)
        made = sess.set(algorithm=Algorithm(**{part: centred if part == "advantage" else reinforce}))
        assert [c.field for c in made] == ["algorithm"]
        sess.step()
        assert sess.version == 2
        assert sorted(recorder.batches[-1]) == sorted(failed)


# -- 3. switching mid-run --------------------------------------------------------------------------


def test_switching_the_algorithm_mid_run_is_recorded_and_the_next_step_uses_it(tmp_path: Path) -> None:
    track = rlnb.TrackConfig(backends=("jsonl",), run_dir=str(tmp_path / "run"))
    with (
        rlnb.Session(small_config(track=track), name="switched") as sess,
        rlnb.Session(small_config(), name="twin") as twin,
    ):
        assert_same_metrics([sess.step()], [twin.step()])
        made = sess.set(algorithm="gspo")
        assert [(c.step, c.field, c.old, c.new) for c in made] == [(1, "algorithm", "grpo", "gspo")]
        assert sess.changes == made
        assert sess.config.learn.resolved_algorithm == preset("gspo")
        switched, kept = sess.step(), twin.step()  # the same batch (same seed, same weights)
        assert sess.batches[-1].config.resolved_algorithm == preset("gspo")
        assert twin.batches[-1].config.resolved_algorithm == preset("grpo")
        # GSPO's sequence-mean and Bessel's std give another gradient on that batch
        assert switched["grad_norm"] != pytest.approx(kept["grad_norm"], rel=1e-3)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    changes = [r for r in records if r.get("event") == "change"]
    assert [(c["step"], c["field"], c["old"], c["new"]) for c in changes] == [(1, "algorithm", "grpo", "gspo")]


def test_a_run_that_switched_resumes_exactly(tmp_path: Path) -> None:
    """Saved after a switch to a preset and a change of one of its knobs (an Algorithm,
    saved field by field): the loaded session's next steps are the saved one's."""
    config = small_config(learn=rlnb.LearnConfig(epochs=2, lr=3e-3))
    with rlnb.Session(config, name="saved") as sess:
        sess.step()
        sess.set(algorithm="gspo")
        sess.step()
        sess.set(entropy_coef=0.01)
        sess.step()
        sess.save(tmp_path / "ckpt")
        config, changes = sess.config, sess.changes
        assert config.learn.algorithm == preset("gspo").replace(entropy_coef=0.01)
        expected = sess.train(2, progress=False)
    with rlnb.Session.load(tmp_path / "ckpt", name="loaded") as loaded:
        assert loaded.config == config and loaded.changes == changes
        assert_same_metrics(loaded.train(2, progress=False), expected)


# -- 4. a checkpoint with a function part ----------------------------------------------------------


def test_a_checkpoint_with_a_function_part_asks_for_it_again(tmp_path: Path) -> None:
    config = small_config(learn=rlnb.LearnConfig(algorithm=Algorithm(advantage=centred)))
    with rlnb.Session(config, name="saved") as sess:
        sess.step()
        sess.save(tmp_path / "ckpt")
        expected = [sess.step()]
    # code is not saved: loading without it names the function and the fix
    with pytest.raises(rlnb.CheckpointError) as info:
        rlnb.Session.load(tmp_path / "ckpt", name="loaded")
    message = str(info.value)
    assert "does not fit" not in message, message  # the checkpoint is sound: the code has to be given again
    assert f"advantage={__name__}.centred" in message, message
    assert "Session.load(path, algorithm=rlnb.algorithms.Algorithm(...))" in message, message
    assert rlnb.sessions() == []
    with rlnb.Session.load(tmp_path / "ckpt", name="loaded", algorithm=Algorithm(advantage=centred)) as loaded:
        assert loaded.config.learn.resolved_algorithm.advantage is centred
        assert_same_metrics([loaded.step()], expected)
    with rlnb.Session.load(tmp_path / "ckpt", name="other", algorithm="rloo") as other:
        assert other.config.learn.algorithm == "rloo"
        other.step()


def test_load_refuses_an_algorithm_that_is_not_one() -> None:
    with pytest.raises(rlnb.ConfigError, match=r"Session\.load\(algorithm='gpso'\): .*did you mean 'gspo'"):
        rlnb.Session.load("nowhere", name="loaded", algorithm="gpso")


# -- 5. whether a clip can act ---------------------------------------------------------------------


def test_a_clip_can_act_only_with_more_than_one_update_per_batch() -> None:
    with rlnb.Session(small_config(learn=rlnb.LearnConfig(lr=5e-2)), name="one") as sess:
        one = sess.train(2, progress=False)
    # with one update per batch the ratio is 1: no clip can act, and the record says so
    for m in one:
        assert (m["clip_active"], m["clip_fraction"], m["clip_low_fraction"], m["clip_high_fraction"]) == (0, 0, 0, 0)
    for learn in (rlnb.LearnConfig(lr=5e-2, epochs=2), rlnb.LearnConfig(lr=5e-2, minibatches=2)):
        with rlnb.Session(small_config(learn=learn), name="two") as sess:
            two = sess.train(3, progress=False)
        assert [m["clip_active"] for m in two] == [1.0, 1.0, 1.0]
        # a large lr moves the ratio out of [0.8, 1.2] on the second update
        assert max(m["clip_fraction"] for m in two) > 0, two
        # of the tokens outside the range, those where the clip acts (below with A < 0, above with A > 0)
        assert max(m["clip_low_fraction"] + m["clip_high_fraction"] for m in two) > 0, two
        for m in two:
            assert m["clip_low_fraction"] + m["clip_high_fraction"] <= m["clip_fraction"] + 1e-9, m


def test_clip_high_is_refused_while_clip_eps_hides_it_and_set_with_clip_eps_none() -> None:
    with rlnb.Session(small_config(learn=rlnb.LearnConfig(clip_eps=0.1)), name="clip") as sess:
        sess.step()
        with pytest.raises(rlnb.ConfigError, match=r"LearnConfig\.clip_eps=0\.1 sets both clip bounds") as info:
            sess.set(clip_high=0.3)
        assert "sess.set(clip_eps=None, clip_high=0.28)" in str(info.value)
        alg = sess.config.learn.resolved_algorithm
        assert sess.changes == [] and (alg.clip_low, alg.clip_high) == (0.1, 0.1)
        made = sess.set(clip_eps=None, clip_high=0.3)
        assert {c.field for c in made} == {"clip_eps", "clip_high"}
        alg = sess.config.learn.resolved_algorithm
        assert (alg.clip_low, alg.clip_high) == (0.2, 0.3)  # clip_low is the algorithm's again
        assert sess.step()["version"] == 2.0


# -- 6. what_if, fork, a name that is no preset ----------------------------------------------------


def test_what_if_with_another_algorithm_leaves_the_session_as_it_was() -> None:
    with rlnb.Session(small_config(), name="asks") as sess:
        sess.train(2, progress=False)
        weights = _weights(sess)
        result = sess.what_if(algorithm="cispo")
        mine = sess.what_if(algorithm=Algorithm(loss=reinforce))
        assert sess.version == 2 and sess.config.learn.algorithm == "grpo" and sess.changes == []
        assert _same_weights(weights, _weights(sess))
    assert dict(result.changes) == {"algorithm": "cispo"}
    # with the ratio at 1, PPO-clip's loss is -w A (near 0 summed), CISPO's -w A log pi
    assert result.changed["loss"] != pytest.approx(result.baseline["loss"], abs=1e-4)
    assert dict(mine.changes)["algorithm"].loss is reinforce
    assert mine.changed["loss"] != pytest.approx(mine.baseline["loss"], abs=1e-4)  # -A log pi as well


def test_what_if_takes_the_algorithms_own_fields_and_refuses_what_would_hide_one() -> None:
    config = small_config(learn=rlnb.LearnConfig(epochs=2, lr=3e-3))  # two updates: a clip can act
    with rlnb.Session(config, name="asks-knobs") as sess:
        sess.train(2, progress=False)
        weights = _weights(sess)
        tight = sess.what_if(clip_low=1e-4, clip_high=1e-4)
        other = sess.what_if(loss="gspo", clip_high=4e-4, clip_low=3e-4)
        assert sess.config.learn.resolved_algorithm == preset("grpo") and sess.changes == []
        assert _same_weights(weights, _weights(sess))
        with pytest.raises(rlnb.ConfigError, match="clip_eps sets both clip bounds"):
            sess.what_if(clip_eps=0.1, clip_high=0.3)
        with pytest.raises(rlnb.ConfigError, match="clip_high"):
            sess.what_if(clip_high=-1.0)
    # a clip range of 1e-4 cuts the second update's ratios: more clipped, a different loss
    assert tight.changed["clip_fraction"] > tight.baseline["clip_fraction"]
    assert other.changed["loss"] != pytest.approx(other.baseline["loss"], abs=1e-6)


def test_a_fork_with_another_algorithm_trains_beside_its_parent() -> None:
    with rlnb.Session(small_config(), name="parent") as parent:
        parent.step()
        with parent.fork("rloo", algorithm="rloo") as child:
            assert child.config.learn.algorithm == "rloo"
            assert child.config.learn.resolved_algorithm == preset("rloo")
            assert [(c.step, c.field, c.old, c.new) for c in child.changes] == [(1, "algorithm", "grpo", "rloo")]
            assert child.step()["version"] == 2.0
            with parent.fork("mine", algorithm=Algorithm(advantage=centred)) as mine:
                assert mine.config.learn.resolved_algorithm.advantage is centred
                assert mine.step()["version"] == 2.0
        assert parent.config.learn.algorithm == "grpo" and parent.changes == []
        assert parent.step()["version"] == 2.0


def test_an_algorithm_that_is_no_preset_names_the_nearest() -> None:
    with pytest.raises(rlnb.ConfigError, match=r"LearnConfig\.algorithm='gpso' is invalid: .*did you mean 'gspo'\?"):
        rlnb.LearnConfig(algorithm="gpso")
    with pytest.raises(rlnb.ConfigError, match=r"the presets are grpo, dr_grpo, dapo, gspo"):
        rlnb.LearnConfig(algorithm="nope")
    with rlnb.Session(small_config(), name="asks") as sess:
        sess.step()
        for call in (
            lambda: sess.set(algorithm="gpso"),
            lambda: sess.fork("fork", algorithm="gpso"),
            lambda: sess.what_if(algorithm="gpso"),
        ):
            with pytest.raises(rlnb.ConfigError, match=r"LearnConfig\.algorithm='gpso' is invalid: .*'gspo'"):
                call()
        assert sess.changes == [] and rlnb.sessions() == [sess]


# -- 7. the default is GRPO as it was ---------------------------------------------------------------


def test_the_default_algorithm_is_grpo_with_its_settings_spelt_out() -> None:
    """Two updates a step and a large lr, so that the clip range and the mismatch cap act."""
    common: dict[str, Any] = {"lr": 3e-2, "epochs": 2}
    learns: list[Callable[[], rlnb.LearnConfig]] = [
        lambda: rlnb.LearnConfig(**common),
        lambda: rlnb.LearnConfig(algorithm=Algorithm(), **common),
        lambda: rlnb.LearnConfig(
            algorithm="grpo", clip_eps=0.2, is_cap=2.0, kl_coef=0.0, scale_advantages=True, **common
        ),
    ]
    runs = []
    for i, learn in enumerate(learns):
        with rlnb.Session(small_config(learn=learn()), name=f"default-{i}") as sess:
            runs.append(sess.train(3, progress=False))
    assert max(m["clip_fraction"] for m in runs[0]) > 0  # the clip acted
    assert_same_metrics(runs[1], runs[0])
    assert_same_metrics(runs[2], runs[0])


def test_dr_grpos_constant_normaliser_is_the_sampling_limit_not_the_batchs_longest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Dr. GRPO divides the summed token losses by samples x the most tokens a completion
    # may have (the sampling's max_new_tokens), whatever the batch's longest is.
    config = small_config(learn=rlnb.LearnConfig(algorithm="dr_grpo"), rollout=rlnb.RolloutConfig(max_new_tokens=6))
    with rlnb.Session(config, name="dr-grpo-norm") as sess:
        groups = list(sess.rollout(4))
        longest = max(len(s.token_ids) for g in groups for s in g.samples)
        learner = sess._trainer.learner
        by_limit = learner.twin().step(groups, max_length=2 * longest)["loss"]
        by_longest = learner.twin().step(groups)["loss"]
        assert by_longest != 0 and by_limit == pytest.approx(by_longest / 2, rel=1e-5)
        seen: list[int | None] = []
        step = learner.step
        monkeypatch.setattr(learner, "step", lambda g, *, max_length=None: seen.append(max_length) or step(g))
        sess.step()
        assert seen == [6]  # the session's steps pass the sampling's limit


def test_a_config_says_why_no_clip_acts_in_its_steps() -> None:
    assert rlnb.LearnConfig().why_no_clip == "ratio 1: one update per batch"
    assert rlnb.LearnConfig(epochs=2).why_no_clip is None
    assert rlnb.LearnConfig(minibatches=2, algorithm="gspo").why_no_clip is None
    assert rlnb.LearnConfig(epochs=2, algorithm="sapo").why_no_clip == "the loss 'sapo' has no clip"
    mine = rlnb.LearnConfig(epochs=2, algorithm=Algorithm(loss=reinforce)).why_no_clip
    assert mine is not None and mine.endswith("reinforce' is a function: a clip inside it is not measured")


def per_token_centred(rewards: torch.Tensor, **context: Any) -> torch.Tensor:
    """Centred rewards on each trained token (a per-token advantage function)."""
    return (rewards - rewards.mean(dim=1, keepdim=True))[..., None] * context["mask"]


def test_kept_batches_record_the_advantages_the_update_used_and_rescore_takes_per_token_ones(half_flat: str) -> None:
    """The kept batch's advantages are the learner's (a per-token function's averaged
    over each sample's tokens; GAE's from the critic), and rescore gives a per-token
    function the samples' masks as the learner does."""

    def flat(rows: Any) -> list[float]:
        return [float(x) for row in rows for x in row]

    def centred_rows(rows: list[list[float]]) -> list[float]:
        return [x - sum(row) / len(row) for row in rows for x in row]

    config = small_config(task=half_flat, learn=rlnb.LearnConfig(algorithm=Algorithm(advantage=per_token_centred)))
    with rlnb.Session(config, name="per-token") as sess:
        sess.step()
        kept = sess.batches[-1]
        assert any(flat(kept.advantages))  # some group had signal
        assert flat(kept.advantages) == pytest.approx(centred_rows([list(r) for r in kept.rewards]), abs=1e-5)
        rescored = sess.rescore(reward=lambda completion, answer: float(len(completion)))
        lengths = [[float(len(s.completion)) for s in g.samples] for g in kept.groups]
        assert flat(rescored["advantages"]) == pytest.approx(centred_rows(lengths), abs=1e-5)
    with rlnb.Session(small_config(task=half_flat, learn=rlnb.LearnConfig(algorithm="ppo")), name="ppo") as sess:
        sess.step()
        assert [list(a) for a in sess.batches[-1].advantages] == [
            list(a) for a in sess._trainer.learner.last_advantages
        ]

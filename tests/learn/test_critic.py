"""The critic in a session (``advantage="gae"``, the ``ppo`` preset): a value model of
its own that learns the returns, made when first needed (from the policy then), kept by
checkpoints for an exact resume, copied by what-if and fork, and put back with the
policy when a step is not taken."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import rlnb
from rlnb.algorithms import Algorithm, preset
from rlnb.data import Task, register_task
from tests.helpers import assert_same_metrics, small_config

CRITIC_METRICS = {"value_loss", "value_clip_fraction", "critic_grad_norm", "value_mean", "return_mean"}


def _ppo(**learn: Any) -> rlnb.Config:
    return small_config(learn=rlnb.LearnConfig(algorithm="ppo", **learn))


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def varied() -> str:
    """A task whose reward (the completion's length mod 3) varies within every group."""
    rows = [{"prompt": f"{i}+{i}=", "answer": str(i)} for i in range(40)]
    task = Task.from_records("varied", rows, reward=lambda completion, answer: float(len(completion) % 3), eval_size=0)
    register_task(task, replace=True)
    return "varied"


def test_ppo_learns_a_value_function_with_its_own_optimiser(varied: str) -> None:
    with rlnb.Session(_ppo(lr=3e-3), name="ppo") as sess:
        learner = sess._trainer.learner
        critic = learner.critic
        assert critic is not None and critic.model is not learner.policy
        assert critic.optimizer is not learner.optimizer
        policy_before, critic_before = _state(learner.policy), _state(critic.model)
        history = sess.train(3, progress=False)
        assert CRITIC_METRICS | {"explained_variance"} <= set(history[-1])
        # both learn, each by its own update
        assert not _same(_state(learner.policy), policy_before)
        assert not _same(_state(critic.model), critic_before)
        assert history[0]["value_mean"] == 0.0  # the head starts at 0


def test_the_critic_fits_the_returns_of_a_batch(varied: str) -> None:
    """With lam = 1 the returns are the rewards themselves: updates on one batch bring
    the critic's values to them (the value loss falls, the explained variance rises)."""
    alg = Algorithm(advantage="gae", lam=1.0, critic_lr=3e-3)
    with rlnb.Session(small_config(task=varied, learn=rlnb.LearnConfig(algorithm=alg, lr=1e-6)), name="fit") as sess:
        sess.step()
        groups = list(sess.batches[-1].groups)
        learner = sess._trainer.learner
        fits = [learner.step(groups) for _ in range(12)]
    losses = [m["value_loss"] for m in fits]
    assert losses[-1] < 0.5 * losses[0], losses
    assert fits[-1]["explained_variance"] > fits[0]["explained_variance"] + 0.2, [m["explained_variance"] for m in fits]


def test_an_algorithm_without_a_critic_keeps_none_and_records_no_value_metrics() -> None:
    with rlnb.Session(small_config(), name="grpo") as sess:
        metrics = sess.step()
        assert sess._trainer.learner.critic is None
        assert not CRITIC_METRICS & set(metrics)


def test_switching_to_ppo_mid_run_makes_a_critic_from_the_policy_then() -> None:
    with rlnb.Session(small_config(learn=rlnb.LearnConfig(lr=3e-3)), name="switch") as sess:
        sess.train(2, progress=False)
        learner = sess._trainer.learner
        assert learner.critic is None
        policy_now = _state(learner.policy)
        sess.set(algorithm="ppo")
        learner.ensure_critic()  # what the next step does first
        assert learner.critic is not None and _same(_state(learner.critic.model), policy_now)
        metrics = sess.step()
        assert CRITIC_METRICS <= set(metrics)
        sess.set(algorithm="grpo")  # back: the critic is kept for a switch back, unused
        assert not CRITIC_METRICS & set(sess.step())
        assert learner.critic is not None


def test_a_ppo_run_resumes_exactly_with_its_critic(tmp_path: Path) -> None:
    with rlnb.Session(_ppo(lr=3e-3, epochs=2), name="saved") as sess:
        sess.train(2, progress=False)
        sess.save(tmp_path / "ckpt")
        expected = sess.train(2, progress=False)
    assert {p.name for p in (tmp_path / "ckpt").iterdir()} >= {"critic.safetensors", "critic_optimizer.safetensors"}
    with rlnb.Session.load(tmp_path / "ckpt", name="loaded") as loaded:
        assert_same_metrics(loaded.train(2, progress=False), expected)


def test_a_run_that_switched_to_ppo_resumes_exactly(tmp_path: Path) -> None:
    with rlnb.Session(small_config(learn=rlnb.LearnConfig(lr=3e-3)), name="saved") as sess:
        sess.step()
        sess.set(algorithm="ppo")
        sess.step()
        sess.save(tmp_path / "ckpt")
        expected = sess.train(2, progress=False)
    with rlnb.Session.load(tmp_path / "ckpt", name="loaded") as loaded:
        assert_same_metrics(loaded.train(2, progress=False), expected)


def test_loading_a_checkpoint_without_a_critic_as_ppo_starts_the_critic_from_the_loaded_policy(
    tmp_path: Path,
) -> None:
    with rlnb.Session(small_config(learn=rlnb.LearnConfig(lr=3e-3)), name="saved") as sess:
        sess.train(2, progress=False)
        trained = _state(sess._trainer.learner.policy)
        sess.save(tmp_path / "ckpt")
    with rlnb.Session.load(tmp_path / "ckpt", name="loaded", algorithm="ppo") as loaded:
        critic = loaded._trainer.learner.critic
        assert critic is not None and _same(_state(critic.model), trained)
        assert CRITIC_METRICS <= set(loaded.step())


def test_what_if_and_fork_with_ppo_train_critics_of_their_own() -> None:
    with rlnb.Session(_ppo(lr=3e-3), name="parent") as sess:
        sess.step()
        critic = sess._trainer.learner.critic
        assert critic is not None
        before = _state(critic.model)
        table = sess.what_if(value_clip=None, lam=0.5)
        rows = {key: (now, what) for key, _, now, what in table.rows()}
        assert rows["value_loss"][0] is not None and rows["value_loss"][1] is not None
        assert _same(_state(critic.model), before)  # the session's critic is as it was
        with sess.fork("child") as child:
            child_critic = child._trainer.learner.critic
            assert child_critic is not None and child_critic is not critic
            assert _same(_state(child_critic.model), before)
            child.step()
            assert _same(_state(critic.model), before)


def test_what_if_ppo_on_a_run_without_a_critic_leaves_the_run_without_one() -> None:
    with rlnb.Session(small_config(), name="grpo") as sess:
        sess.step()
        table = sess.what_if(algorithm="ppo")
        rows = {key: (now, what) for key, _, now, what in table.rows()}
        assert rows["value_loss"][0] is None and rows["value_loss"][1] is not None
        assert "value_loss" in repr(table)
        assert sess._trainer.learner.critic is None


class Failing:
    """A policy loss that raises once armed: the step fails after its critic update."""

    armed = False

    def __call__(self, inputs: Any) -> torch.Tensor:
        if self.armed:
            raise ZeroDivisionError("the loss failed")
        adv = inputs.advantages
        return -(adv[:, None] if adv.dim() == 1 else adv) * inputs.logp


@pytest.mark.parametrize("epochs", [1, 2], ids=["held-step", "copy"])
def test_a_step_that_fails_after_the_critics_update_puts_the_critic_back(epochs: int) -> None:
    """One update a step: the critic's optimiser step waits for the policy's; several:
    the critic is put back from a copy."""
    failing = Failing()
    algorithm = Algorithm(advantage="gae", loss=failing)
    config = small_config(learn=rlnb.LearnConfig(algorithm=algorithm, lr=3e-3, epochs=epochs))
    with rlnb.Session(config, name="failing") as sess:
        sess.step()
        learner = sess._trainer.learner
        assert learner.critic is not None
        critic_before, head_before = _state(learner.critic.model), _state(learner.critic.head)
        moments = {k: v.clone() for k, v in learner.critic.optimizer.state_dict()["state"][0].items()}
        failing.armed = True
        with pytest.raises(ZeroDivisionError, match="the loss failed"):
            sess.step()
        assert _same(_state(learner.critic.model), critic_before)
        assert _same(_state(learner.critic.head), head_before)
        after = learner.critic.optimizer.state_dict()["state"][0]
        assert all(torch.equal(after[k], v) for k, v in moments.items())
        failing.armed = False
        assert CRITIC_METRICS <= set(sess.step())  # and the run goes on


def test_the_critics_learning_rate_is_its_own_when_given() -> None:
    config = small_config(learn=rlnb.LearnConfig(algorithm=preset("ppo").replace(critic_lr=0.0123), lr=1e-3))
    with rlnb.Session(config, name="lr") as sess:
        sess.step()
        critic = sess._trainer.learner.critic
        assert critic is not None
        assert [g["lr"] for g in critic.optimizer.param_groups] == [0.0123]
        assert sess.history[-1]["lr"] == 1e-3

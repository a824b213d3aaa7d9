"""The learner's torch threads: ``LearnConfig.threads``, or, by default in async mode
with the engine on this machine's CPU, what is left beside the engine's threads."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import rlnb
from rlnb.learn._learner import intra_op_threads
from rlnb.session._assembly import learner_threads


@pytest.fixture(autouse=True)
def _four_threads() -> Iterator[None]:
    # Whatever torch's count in this process (scripts/test.sh runs the suite on one
    # thread a process): four, so that one thread and "what was there before" differ.
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)


def test_async_with_a_local_engine_leaves_the_engine_its_threads() -> None:
    cores = torch.get_num_threads()
    assert cores == 4
    assert learner_threads(rlnb.Config(mode="sync")) is None  # the rollout and the update take turns
    assert learner_threads(rlnb.Config(mode="async")) == max(1, cores - 1)
    engine = rlnb.EngineConfig(process=True, threads=2)
    assert learner_threads(rlnb.Config(mode="async", engine=engine)) == max(1, cores - 2)
    replicas = rlnb.RayConfig(engine_replicas=3)
    assert learner_threads(rlnb.Config(mode="async", ray=replicas)) == max(1, cores - 3)
    attached = rlnb.RayConfig(engine_replicas=3, address="auto")  # replicas on the cluster's nodes
    assert learner_threads(rlnb.Config(mode="async", ray=attached)) is None
    chosen = rlnb.LearnConfig(threads=3)
    assert learner_threads(rlnb.Config(mode="async", learn=chosen)) == 3
    assert learner_threads(rlnb.Config(mode="sync", learn=chosen)) == 3


def test_threads_are_set_for_the_block_on_this_thread_and_restored() -> None:
    before = torch.get_num_threads()
    with intra_op_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(KeyError), intra_op_threads(1):
        raise KeyError("an update that fails")
    assert torch.get_num_threads() == before
    with intra_op_threads(None):
        assert torch.get_num_threads() == before


def test_a_bad_thread_count_is_refused_naming_the_field() -> None:
    with pytest.raises(rlnb.ConfigError, match=r"LearnConfig\.threads=0"):
        rlnb.LearnConfig(threads=0)


def test_a_session_step_restores_the_callers_threads() -> None:
    before = torch.get_num_threads()
    config = rlnb.Config(
        mode="async",
        learn=rlnb.LearnConfig(threads=1),
        model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2),
        rollout=rlnb.RolloutConfig(group_size=4, groups_per_step=2),
        data=rlnb.DataConfig(num_workers=0),
    )
    with rlnb.Session(config, name="threads") as sess:
        sess.step()
        assert torch.get_num_threads() == before

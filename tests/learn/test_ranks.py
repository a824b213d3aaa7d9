"""The learner split across processes (rlnb.learn._ranks): two ranks on a gloo
process group take the step one process takes on the same batches, and a rank
whose share fails fails the step on every rank, none left waiting."""

from __future__ import annotations

import json
import os

import pytest
import torch

import rlnb
from rlnb.learn import LearnConfig
from rlnb.learn._ranks import Ranks
from tests.helpers.processes import PythonProcesses

# gloo connects the ranks over loopback
processes = pytest.mark.netns

# Each trains 5 steps of 2 epochs of 2 minibatches: presets of every policy loss and
# of the critic's advantages (ppo), and grpo:2, in micro-batches of 2.
ALGORITHMS = ("grpo", "dr_grpo", "dapo", "gspo", "cispo", "rloo", "sapo", "ppo", "grpo:2")


def _run(start_python: PythonProcesses, *args: str) -> object:
    proc = start_python("-m", "tests.helpers.ranks", *args, env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return json.loads(out)


@processes
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_take_the_step_one_process_takes(start_python: PythonProcesses, strategy: str) -> None:
    # each algorithm's loss is the same code whatever holds the model: every one with the default, three with ddp
    chosen = ALGORITHMS if strategy == "fsdp" else ("grpo", "gspo", "ppo", "grpo:2")
    algorithms = ",".join(chosen)
    result = _run(
        start_python, "compare", "--world", "2", "--steps", "5", "--algorithms", algorithms, "--strategy", strategy
    )
    assert isinstance(result, dict) and set(result) == set(chosen)
    for algorithm, seen in result.items():
        assert len(seen["alone"]) == len(seen["ranks"]) == 5
        for step, (alone, ranks) in enumerate(zip(seen["alone"], seen["ranks"], strict=True), 1):
            for key, value in alone.items():
                assert ranks[key] == pytest.approx(value, abs=1e-9), (algorithm, step, key)
        assert seen["weights"] < 1e-9, algorithm  # float64: the split itself adds nothing but rounding
        assert seen["ranks agree"], algorithm  # every rank holds the same weights


@processes
@pytest.mark.parametrize(("model", "strategy"), [("checkpointing", "fsdp"), ("lora", "fsdp")])
def test_two_ranks_train_a_hugging_face_model_and_its_lora_adapter_as_one_process(
    start_python: PythonProcesses, model: str, strategy: str
) -> None:
    # A small random Llama (in float64: its rotary tables stay float32, whose rounding
    # differs with the rows' split) with gradient checkpointing (its layers run again
    # in the backward pass, gathering their shards again), and its LoRA adapter (only
    # the adapter trains and is compared), in micro-batches of 2: the ranks' shares
    # cut into different numbers of chunks.
    args = ("compare", "--world", "2", "--steps", "5", "--algorithms", "grpo:2", "--strategy", strategy)
    result = _run(start_python, *args, "--model", model)
    assert isinstance(result, dict)
    seen = result["grpo:2"]
    assert len(seen["alone"]) == len(seen["ranks"]) == 5
    for step, (alone, ranks) in enumerate(zip(seen["alone"], seen["ranks"], strict=True), 1):
        for key, value in alone.items():
            assert ranks[key] == pytest.approx(value, abs=1e-5), (model, step, key)
    assert seen["weights"] < 1e-5 and seen["ranks agree"]


@processes
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_rank_whose_share_fails_fails_the_step_on_every_rank_and_keeps_the_weights(
    start_python: PythonProcesses, strategy: str
) -> None:
    first, last = _run(start_python, "fail", "--world", "2", "--strategy", strategy)  # type: ignore[misc]
    assert last["raised"] == "ValueError: a loss function that fails on rank 1"  # its own error
    assert first["raised"] == (
        "RankFailed: learner rank 1 failed during update 1 of step 2; the step was not taken on any rank"
    )
    assert first["weights kept"] and last["weights kept"]
    assert first["version"] == last["version"] == 1


def test_ranks_split_rows_evenly_and_contiguously() -> None:
    rows = torch.arange(7)
    shares = [Ranks(rank, 3).mine(rows).tolist() for rank in range(3)]
    assert shares == [[0, 1, 2], [3, 4], [5, 6]]
    assert Ranks(1, 2).mine(torch.arange(1)).tolist() == []  # fewer rows than ranks: a rank may have none


def test_sharded_ranks_run_as_many_chunks_as_the_rank_with_the_most() -> None:
    rows = torch.arange(5)

    def pairs(share: torch.Tensor) -> list[torch.Tensor]:
        return list(share.split(2))

    def cut(rank: int, world: int, strategy: str) -> list[list[int] | None]:
        chunks = Ranks(rank, world, sharded=strategy == "fsdp").even_chunks(rows, pairs)
        return [None if c is None else c.tolist() for c in chunks]

    assert cut(0, 2, "fsdp") == [[0, 1], [2]]  # 3 rows and 2
    assert cut(1, 2, "fsdp") == [[3, 4], None]  # an idle pass: FSDP2 gathers on every rank at once
    assert cut(1, 2, "ddp") == [[3, 4]]  # each rank alone until the gradients are summed
    assert cut(5, 6, "fsdp") == [None]  # no rows at all: still one pass
    assert cut(5, 6, "ddp") == []


def test_a_lora_critic_on_sharded_ranks_is_refused_before_anything_is_made() -> None:
    lora_critic = rlnb.Algorithm(advantage="gae", critic="lora")
    with pytest.raises(rlnb.ConfigError, match=r"LearnConfig\.strategy='fsdp' is invalid: a LoRA critic shares"):
        LearnConfig(ranks=2, algorithm=lora_critic)
    assert LearnConfig(ranks=2, algorithm=lora_critic, strategy="ddp").ranks == 2  # whole copies: fine
    assert LearnConfig(ranks=2, algorithm="ppo").ranks == 2  # a critic of its own: sharded like the policy


def test_the_learner_flags_of_rlnb_train_set_ranks_and_strategy_and_a_wrong_strategy_names_the_fix() -> None:
    from rlnb.cli import _build_parser, _train_config

    args = ["train", "--steps", "1", "--run-dir", "r", "--learner-ranks", "2", "--learner-strategy", "ddp"]
    learn = _train_config(_build_parser().parse_args(args))[0].learn
    assert (learn.ranks, learn.strategy) == (2, "ddp")
    assert LearnConfig(ranks=2).strategy == "fsdp"  # sharded unless told
    with pytest.raises(rlnb.ConfigError, match=r"LearnConfig\.strategy='zero' is invalid: use \"fsdp\""):
        LearnConfig(ranks=2, strategy="zero")

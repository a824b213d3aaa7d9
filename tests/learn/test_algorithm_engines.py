"""Algorithms on the other models and engines (test_algorithm_session.py runs them on
the tiny policy and its engine): every preset trains a Hugging Face model and its LoRA
adapter on the "hf" engine, in sync and async mode; an advantage function (per token)
and a loss function train in the foreground and the background; a run that switched
algorithm resumes exactly, on a Hugging Face model, its LoRA adapter and with the
engine in a process of its own; and a process engine and vLLM each go through every
preset and both kinds of function in one session, switching between steps.

A covering matrix, not the full product: on the "hf" engine, where a step costs a
tenth of a second, each preset meets both models and both modes (``PRESET_CELLS``);
the process and vLLM engines, which cost seconds and tens of seconds to start, get one
async session each (vLLM starts once), and the process engine the sync run that is
saved and loaded (vLLM in sync mode: tests/session/test_session_vllm.py). Each step
checks what a user sees: it ran under that algorithm (the kept batch's config,
``groups``, ``groups_dropped``, ``clip_active``), the trained weights moved (with LoRA,
the adapter's alone), and the engine serves the step's version."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import rlnb
import rlnb.models
from rlnb.algorithms import Algorithm, preset
from rlnb.data import Task, register_task
from tests.helpers import assert_same_metrics, small_config
from tests.serve.helpers import assert_serves

PRESETS = [name for name, _ in rlnb.algorithms.algorithms()]
LORA = rlnb.LoraConfig(r=4, alpha=8)
PROCESS = rlnb.EngineConfig(process=True)


# -- parts of one's own, as functions ---------------------------------------------------------


def per_token(rewards: torch.Tensor, **context: Any) -> torch.Tensor:
    """Per token [groups, G, T]: each group's centred rewards, on the tokens each
    sample trains on, halved past its first token (so the tokens of a sample differ)."""
    mask = context["mask"]
    first = torch.zeros_like(mask)
    first[..., 0] = 1.0
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    return centred[..., None] * mask * (0.5 + 0.5 * first)


def reinforce(inputs: Any) -> torch.Tensor:
    """Plain REINFORCE per token: -A log pi (advantages per sample or per token)."""
    adv = inputs.advantages
    return -(adv[:, None] if adv.dim() == 1 else adv) * inputs.logp


class Counted:
    """A function part that counts its calls (the learner may call it from its thread)."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls += 1
        return self.fn(*args, **kwargs)


# -- what the tests share ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny random Llama for the module (transformers' import and the build: seconds)."""
    pytest.importorskip("transformers", reason="the 'hf' extra (transformers) is not installed")
    return rlnb.models.tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture
def half_flat() -> Iterator[str]:
    """A task where half the prompts score every completion 0 (flat groups, for the
    presets that drop them) and the rest score its characters' codes mod 3."""

    def reward(completion: str, answer: str) -> float:
        return 0.0 if answer == "0" else float(sum(map(ord, completion)) % 3)

    rows = [{"prompt": f"{i}+{i}=", "answer": str(i % 2)} for i in range(40)]
    register_task(Task.from_records("half-flat-hf", rows, reward=reward, eval_size=0), replace=True)
    yield "half-flat-hf"


def _model(llama: Path, model: str) -> rlnb.ModelConfig:
    """The tiny Llama, whole ("hf") or with a LoRA adapter ("lora")."""
    return rlnb.ModelConfig(path=str(llama), max_len=32, lora=LORA if model == "lora" else None)


def _trained(sess: rlnb.Session) -> dict[str, torch.Tensor]:
    """The parameters the learner trains (with LoRA: the adapter's), copied."""
    return {n: p.detach().clone() for n, p in sess.policy.named_parameters() if p.requires_grad}


def _frozen(sess: rlnb.Session) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in sess.policy.named_parameters() if not p.requires_grad}


def _moved(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> bool:
    assert before.keys() == after.keys()
    return any(not torch.equal(before[k], after[k]) for k in before)


def _check_step(sess: rlnb.Session, m: dict[str, float], algorithm: Algorithm) -> None:
    """The step ``m``, just made, ran under ``algorithm``, and the engine has its weights."""
    assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]), m
    assert m["version"] == sess.version
    kept = sess.batches[-1]
    assert kept.config.resolved_algorithm == algorithm
    assert kept.metrics["version"] == m["version"]
    # the weight sync reached the engine: it serves the step's version
    assert sess.statistics().engine.version == sess.version
    assert m["clip_active"] == float(sess.config.learn.why_no_clip is None), m
    if algorithm.dynamic_sampling:
        assert m["groups"] == 4.0, m  # flat groups dropped, and more taken until 4 have signal
    elif not algorithm.drop_flat_groups:
        assert (m["groups"], m["groups_dropped"]) == (4.0, 0.0), m


# -- 1. every preset on a Hugging Face model and its LoRA adapter -------------------------------


# Each preset in two of the four (model, mode) cells, the other two for the next preset:
# every preset meets both models and both modes, and each model each mode, in 24 runs.
CELLS = [("hf", "sync"), ("lora", "async"), ("hf", "async"), ("lora", "sync")]
PRESET_CELLS = [(name, *CELLS[(2 * i + j) % 4]) for i, name in enumerate(PRESETS) for j in range(2)]


@pytest.mark.parametrize(("name", "model", "mode"), PRESET_CELLS)
def test_every_preset_trains_a_hugging_face_model(
    name: str, model: str, mode: str, llama: Path, half_flat: str
) -> None:
    config = small_config(
        model=_model(llama, model),
        task=half_flat,
        mode=mode,
        step_timeout=20.0,
        learn=rlnb.LearnConfig(algorithm=name, lr=1e-2),
    )
    with rlnb.Session(config, name=f"{name}-{model}") as sess:
        assert isinstance(sess.policy, rlnb.models.HFPolicy)
        trained, frozen = _trained(sess), _frozen(sess)
        steps = []
        for _ in range(2):
            steps.append(sess.step())
            _check_step(sess, steps[-1], preset(name))
        assert sess.version == 2
        assert _moved(trained, _trained(sess)), "two steps left the trained weights as they were"
        assert not _moved(frozen, _frozen(sess)), "a step moved a frozen weight"
        assert bool(frozen) == (model == "lora")  # LoRA trains the adapter alone
    if preset(name).drop_flat_groups:
        assert sum(m["groups_dropped"] for m in steps) > 0  # the task gave flat groups to drop


# -- 2. functions as parts, in the foreground and the background ---------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("model", ["hf", "lora"])
def test_an_advantage_and_a_loss_function_train_a_hugging_face_model(model: str, mode: str, llama: Path) -> None:
    """A step in the foreground, then one in the background, under each function."""
    advantage, loss = Counted(per_token), Counted(reinforce)
    config = small_config(model=_model(llama, model), mode=mode, step_timeout=20.0, learn=rlnb.LearnConfig(lr=1e-2))
    with rlnb.Session(config, name=f"mine-{model}") as sess:
        trained = _trained(sess)
        for algorithm, fn in ((Algorithm(advantage=advantage), advantage), (Algorithm(loss=loss), loss)):
            made = sess.set(algorithm=algorithm)
            assert [(c.step, c.field, c.new) for c in made] == [(sess.version, "algorithm", algorithm)]
            fn.calls = 0
            _check_step(sess, sess.step(), algorithm)
            if fn is advantage:
                # the kept batch records each sample's advantage: the mean over its trained tokens
                kept = sess.batches[-1]
                rewards = torch.tensor(kept.rewards, dtype=torch.float64)
                tokens = torch.tensor([[sum(s.mask) for s in g.samples] for g in kept.groups], dtype=torch.float64)
                expected = (rewards - rewards.mean(dim=1, keepdim=True)) * (0.5 + 0.5 / tokens)
                torch.testing.assert_close(torch.tensor(kept.advantages, dtype=torch.float64), expected)
            sess.training.start(1)
            sess.training.wait()
            _check_step(sess, sess.history[-1], algorithm)
            assert fn.calls >= 2  # the learner ran it in each step
        assert sess.version == 4
        assert _moved(trained, _trained(sess))
        assert [c.field for c in sess.changes] == ["algorithm", "algorithm"]


def test_an_advantage_function_is_called_once_a_step_and_one_that_raises_changes_nothing(llama: Path) -> None:
    """The learner calls an advantage function once a step (the batch it keeps records
    the advantages the update used); one that raises fails the step before anything changed."""
    calls, failing = [0], [False]

    def flaky(rewards: torch.Tensor, **context: Any) -> torch.Tensor:
        calls[0] += 1
        if failing[0]:
            raise ZeroDivisionError("flaky advantage failed")
        return per_token(rewards, **context)

    config = small_config(model=_model(llama, "lora"), learn=rlnb.LearnConfig(algorithm=Algorithm(advantage=flaky)))
    with rlnb.Session(config, name="flaky") as sess:
        calls[0] = 0  # the dry run of the Algorithm's check
        sess.step()
        assert calls[0] == 1  # the kept batch records the update's advantages: no second call
        trained, history = _trained(sess), list(sess.history)
        failing[0] = True
        with pytest.raises(ZeroDivisionError, match="flaky advantage failed"):
            sess.step()
        assert sess.version == 1 and sess.history == history and sess.statistics().engine.version == 1
        assert not _moved(trained, _trained(sess)), "the failed step changed the weights"
        failing[0] = False
        _check_step(sess, sess.step(), sess.config.learn.resolved_algorithm)
        assert sess.version == 2


# -- 3. switching mid-run, saved and resumed exactly ----------------------------------------------


@pytest.mark.parametrize(
    ("model", "engine", "to"),
    [
        ("hf", None, "ppo"),  # its critic starts at the switch, and is saved
        ("lora", None, "gspo"),  # a sequence ratio of the adapted policy
        pytest.param("tiny", PROCESS, "dapo", marks=pytest.mark.slow, id="tiny-process-dapo"),  # more rolled out
    ],
)
def test_a_run_that_switched_resumes_exactly(
    model: str, engine: rlnb.EngineConfig | None, to: str, llama: Path, half_flat: str, tmp_path: Path
) -> None:
    """Two updates a batch (a clip can act): GRPO, then another preset, then one of its
    knobs changed; saved, the loaded session's next steps are the saved one's."""
    config = small_config(task=half_flat, learn=rlnb.LearnConfig(epochs=2, lr=3e-3))
    if model != "tiny":
        config = config.replace(model=_model(llama, model))
    if engine is not None:
        config = config.replace(engine=engine)
    with rlnb.Session(config, name="switched") as sess:
        _check_step(sess, sess.step(), preset("grpo"))
        sess.set(algorithm=to)
        switched = sess.step()
        _check_step(sess, switched, preset(to))
        assert switched["clip_active"] == 1.0
        if to == "ppo":
            assert math.isfinite(switched["value_loss"])  # the critic learnt in the step
        sess.set(clip_high=0.1)
        _check_step(sess, sess.step(), preset(to).replace(clip_high=0.1))
        sess.save(tmp_path / "ckpt")
        config, changes = sess.config, sess.changes
        assert [(c.step, c.field) for c in changes] == [(1, "algorithm"), (2, "clip_high")]
        expected = sess.train(2, progress=False)
    with rlnb.Session.load(tmp_path / "ckpt", name="loaded") as loaded:
        assert loaded.config == config and loaded.changes == changes
        got = loaded.train(2, progress=False)
        assert loaded.statistics().engine.version == 5
    assert_same_metrics(got, expected)


# -- 4. the process and vLLM engines: one session through every algorithm --------------------------


def _tour(sess: rlnb.Session) -> None:
    """One step under each preset, then under an advantage and a loss function, then
    two steps in the background: ``sess.set(algorithm=...)`` between them."""
    trained = _trained(sess)
    for name in PRESETS:
        sess.set(algorithm=name)
        _check_step(sess, sess.step(), preset(name))
    advantage, loss = Counted(per_token), Counted(reinforce)
    for algorithm in (Algorithm(advantage=advantage), Algorithm(loss=loss)):
        sess.set(algorithm=algorithm)
        _check_step(sess, sess.step(), algorithm)
    assert advantage.calls >= 1 and loss.calls >= 1
    sess.training.start(2)
    sess.training.wait()
    _check_step(sess, sess.history[-1], Algorithm(loss=loss))
    assert loss.calls >= 3
    steps = len(PRESETS) + 4
    # set(algorithm="grpo") at step 0 changed nothing (it is the default): not recorded
    assert sess.version == steps and [c.step for c in sess.changes] == list(range(1, len(PRESETS) + 2))
    assert _moved(trained, _trained(sess))


@pytest.mark.slow  # the engine process imports torch: seconds
@pytest.mark.netns  # its endpoint listens
def test_every_algorithm_trains_with_the_engine_in_a_process() -> None:
    """Async, the tiny policy (a sync run on the process engine is the resume test's);
    then the session's endpoint serves the engine process."""
    with rlnb.Session(small_config(mode="async", step_timeout=20.0, engine=PROCESS), name="process") as sess:
        assert sess.statistics().engine.extra["pid"]
        _tour(sess)
        sess.rollouts.stop()
        assert_serves(sess, "12+34=")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.usefixtures("vllm")
def test_every_algorithm_trains_on_vllm(llama: Path) -> None:
    """Async (behaviour log-probs and versions from vLLM, some of them stale), a LoRA
    adapter merged into vLLM at each sync (a sync session of the tiny Llama on vLLM:
    tests/session/test_session_vllm.py). vLLM starts once, in 30-50 s here."""
    config = small_config(
        model=_model(llama, "lora"),
        mode="async",
        step_timeout=60.0,
        engine=rlnb.EngineConfig(kind="vllm", max_batch=64),
        learn=rlnb.LearnConfig(lr=1e-2),
    )
    with rlnb.Session(config, name="vllm") as sess:
        assert sess.statistics().engine.extra, "a vLLM engine reports its own figures"
        _tour(sess)
        sess.rollouts.stop()
        assert_serves(sess, "12+34=")  # the endpoint serves vLLM, LoRA merged, at the session's version
        versions = {v for kept in sess.batches for g in kept.groups for s in g.samples for v in s.versions}
        assert max(versions) < sess.version

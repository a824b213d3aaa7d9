"""verifiers environments as tasks (Task.from_verifiers), with the real verifiers
package (0.3, the classic API) on environments defined here: each sample is an
``env.rollout`` through the session's endpoint, scored by the environment's rubric.
SingleTurnEnv, MultiTurnEnv, ToolEnv, ``load_environment`` packaging, the tokens
verifiers read back against the sample's, failures named, and a tiny policy that
gains on a SingleTurnEnv."""

from __future__ import annotations

import signal
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import rlnb
from rlnb.data import Task, register_task
from rlnb.engines import FakeEngine, GenerateRequest, GenerateResult
from tests.helpers import small_config


def envs() -> Any:
    """tests/data/verifiers_envs.py, once verifiers is found (skips otherwise)."""
    pytest.importorskip("verifiers", reason="scripts/setup-agents.sh installs verifiers")
    from tests.data import verifiers_envs

    return verifiers_envs


@pytest.fixture(autouse=True)
def signal_handlers_as_they_were() -> Iterator[None]:
    """Each test leaves SIGINT's and SIGTERM's handlers as it found them (a verifiers
    environment made without rlnb's wrapper puts in its own, for the whole process)."""
    saved = [(sig, signal.getsignal(sig)) for sig in (signal.SIGINT, signal.SIGTERM)]
    yield
    for sig, handler in saved:
        signal.signal(sig, handler)


@pytest.mark.slow  # importing verifiers takes seconds
def test_a_verifiers_environment_leaves_the_processs_ctrl_c_and_sigterm_alone() -> None:
    m = envs()
    rlnb.runtime.install_hooks()  # as a session does: rlnb's SIGTERM handler closes the sessions
    ours = signal.getsignal(signal.SIGTERM)
    # An environment made before rlnb imported verifiers puts in its own handlers (verifiers
    # 0.3.1's Environment.__post_init__); Task.from_verifiers takes the process's back.
    post_init = m.vf.Environment.__post_init__
    original = getattr(post_init, "__wrapped__", post_init)
    m.vf.Environment.__post_init__ = original
    try:
        env = m.vf.SingleTurnEnv(dataset=m.datasets.Dataset.from_list(m.words(8)), rubric=m.vf.Rubric(funcs=[m.exact]))
        assert "Environment.__post_init__" in getattr(signal.getsignal(signal.SIGINT), "__qualname__", "")
        Task.from_verifiers(env, name="vf-signals", eval_size=2, alphabet="abcdefgh=")
    finally:  # from_verifiers wrapped it again; put back what there was if it did not get that far
        if not getattr(m.vf.Environment.__post_init__, "_rlnb_keeps_signals", False):
            m.vf.Environment.__post_init__ = post_init
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert "on_sigterm" in getattr(signal.getsignal(signal.SIGTERM), "__qualname__", "")
    # Made once rlnb has imported verifiers, an environment changes neither.
    before = [signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)]
    m.vf.SingleTurnEnv(dataset=m.datasets.Dataset.from_list(m.words(8)), rubric=m.vf.Rubric(funcs=[m.exact]))
    assert [signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)] == before
    assert ours is not None


class ScriptedEngine(FakeEngine):
    """A FakeEngine whose every reply is ``script`` (then EOS), a conversation's later
    turns too: set it once the session's tokenizer is known."""

    def __init__(self) -> None:
        self.script: list[int] = []
        super().__init__(lengths=lambda request: len(request.prefix_ids) + len(self.script) + 1)

    def _result(self, request: GenerateRequest, total: int, versions: list[int], reason: str) -> GenerateResult:
        result = super()._result(request, total, versions, reason)
        ids = tuple([*self.script, rlnb.models.CharTokenizer.EOS][: len(result.token_ids)])
        return GenerateResult(result.request_id, ids, result.logprobs, result.versions, result.finish_reason)


@pytest.fixture
def scripted(request: pytest.FixtureRequest) -> Iterator[tuple[rlnb.Session, ScriptedEngine]]:
    """A session on the task ``request.param`` whose policy writes what the test sets."""
    engine = ScriptedEngine()
    task = register_task(getattr(envs(), request.param)(), replace=True)
    config = small_config(task=task.name, rollout=rlnb.RolloutConfig(group_size=2, groups_per_step=1))
    with rlnb.Session(config, name="vf", engine=engine) as sess:
        yield sess, engine


@pytest.mark.netns
@pytest.mark.parametrize("scripted", ["single_turn_task"], indirect=True)
def test_a_single_turn_env_sample_is_what_was_served_and_its_reward_the_rubrics(scripted: Any) -> None:
    m = envs()
    sess, engine = scripted
    env = sess.task.agent.env
    engine.script = sess.tokenizer.encode("abc")
    (group,) = sess.rollout(1, timeout=60)
    assert len(group.samples) == len(env.states) == 2
    for sample in group.samples:
        assert sample.completion == "abc" and sample.mask == (1,) * 4 and sample.turns == (0,)
    for state in env.states:
        answer = state["answer"]
        assert state["reward"] == m.exact(state["completion"], answer) + 0.5 * m.close(state["completion"], answer)
        # The tokens verifiers read back are the sample's: what the endpoint served.
        (step,) = state["trajectory"]
        tokens = step["tokens"]
        assert tuple(tokens["completion_ids"]) == group.samples[0].token_ids
        assert tokens["completion_logprobs"] == pytest.approx(list(group.samples[0].logprobs))
    assert sorted(s.reward for s in group.samples) == sorted(s["reward"] for s in env.states)
    assert sess.serve().statistics().served.sampled == 2


@pytest.mark.netns
@pytest.mark.parametrize("scripted", ["multi_turn_task"], indirect=True)
def test_a_multi_turn_env_is_one_sample_of_its_turns_with_the_envs_replies_masked(scripted: Any) -> None:
    m = envs()
    sess, engine = scripted
    env = sess.task.agent.env
    engine.script = sess.tokenizer.encode("ab")
    (group,) = sess.rollout(1, timeout=60)
    for sample, state in zip(group.samples, env.states, strict=True):
        assert state["stop_condition"] == "max_turns_reached" and len(state["trajectory"]) == 3
        assert len(sample.turns) == 3
        replies = [ids for trained, ids in sample.segments() if trained]
        assert [sess.tokenizer.decode(list(ids)) for ids in replies] == ["ab"] * 3
        masked = [ids for trained, ids in sample.segments() if not trained]
        assert len(masked) == 2 and all("=" in sess.tokenizer.decode(list(ids)) for ids in masked)
        # verifiers' last call saw the whole conversation: its prompt and reply end the sample.
        last = state["trajectory"][-1]["tokens"]
        assert tuple(last["completion_ids"]) == sample.token_ids[sample.turns[-1] :]
        assert sample.reward == state["reward"] == m.exact(state["completion"], state["answer"])


@pytest.mark.netns
@pytest.mark.parametrize("scripted", ["tool_task"], indirect=True)
def test_a_tool_env_runs_its_tool_and_the_tools_replies_are_masked(scripted: Any) -> None:
    sess, engine = scripted
    env = sess.task.agent.env
    engine.script = sess.tokenizer.encode("add(3,4)")  # the built-in policy's tool syntax
    (group,) = sess.rollout(1, timeout=60)
    for sample, state in zip(group.samples, env.states, strict=True):
        assert state.get("error") is None and len(state["trajectory"]) == 3
        tool_messages = [m for m in state["completion"] if m["role"] == "tool"]
        assert [m["content"] for m in tool_messages] == ["7", "7"]
        assert len(sample.turns) == 3
        masked = [sess.tokenizer.decode(list(ids)) for trained, ids in sample.segments() if not trained]
        assert len(masked) == 2 and all("7" in text for text in masked)
        assert sample.reward == state["reward"] == 0.0  # it never answered: the rubric's 0
    calls = sess.serve().log()
    assert calls[-1].request.tools and calls[-1].request.tools[0]["function"]["name"] == "add"


HUB_MODULE = """
import verifiers as vf
from datasets import Dataset


def load_environment(n=4, **kwargs):
    rows = [{"question": w + "=", "answer": w[::-1]} for w in ["abc", "bad", "cab", "fed", "hag", "ace"][:n]]

    def exact(completion, answer):
        return float(completion[-1]["content"] == answer)

    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[exact]), **kwargs)
"""


@pytest.fixture
def hub_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An installed Hub environment: a module with ``load_environment``, on sys.path."""
    (tmp_path / "vf_test_reverse.py").write_text(textwrap.dedent(HUB_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "vf-test-reverse"
    sys.modules.pop("vf_test_reverse", None)


@pytest.mark.netns
def test_a_hub_environment_is_loaded_by_its_id_with_its_arguments(hub_module: str) -> None:
    m = envs()
    task = Task.from_verifiers(hub_module, env_args={"n": 5}, eval_size=1, alphabet=m.ALPHABET)
    assert task.name == "vf-test-reverse" and task.records is not None
    assert len(task.records.train) == 4 and task.agent is not None
    engine = ScriptedEngine()
    register_task(task, replace=True)
    config = small_config(task=task.name, rollout=rlnb.RolloutConfig(group_size=2, groups_per_step=1))
    with rlnb.Session(config, name="vf-hub", engine=engine) as sess:
        (group,) = sess.rollout(1, timeout=60)
        answer = group.samples[0].completion  # the script is empty: EOS alone, an empty reply
        assert answer == "" and [s.reward for s in group.samples] == [0.0, 0.0]

    with pytest.raises(rlnb.ConfigError, match="could not load it"):
        Task.from_verifiers("vf-not-installed-anywhere")


@pytest.mark.slow  # importing verifiers takes seconds
def test_what_from_verifiers_refuses_is_named() -> None:
    m = envs()

    def group_reward(completions: Any, answers: Any) -> list[float]:
        return [0.0] * len(completions)

    env = m.vf.SingleTurnEnv(dataset=m.datasets.Dataset.from_list(m.words(4)), rubric=m.vf.Rubric(funcs=[group_reward]))
    with pytest.raises(rlnb.ConfigError, match=r"group_reward.*score a whole group"):
        Task.from_verifiers(env)
    with pytest.raises(rlnb.ConfigError, match="pass a verifiers Environment"):
        Task.from_verifiers(object())
    env = m.vf.SingleTurnEnv(dataset=m.datasets.Dataset.from_list(m.words(4)), rubric=m.vf.Rubric(funcs=[m.exact]))
    with pytest.raises(rlnb.ConfigError, match="env_args"):
        Task.from_verifiers(env, env_args={"n": 3})


@pytest.mark.netns
def test_a_rollout_that_ended_on_an_error_fails_its_sample_named_not_a_silent_zero() -> None:
    m = envs()
    env = m.vf.SingleTurnEnv(dataset=m.datasets.Dataset.from_list(m.words(6)), rubric=m.vf.Rubric(funcs=[m.exact]))
    # The endpoint refuses presence_penalty: verifiers keeps the 400 as state["error"].
    task = Task.from_verifiers(
        env, name="vf-refused", sampling_args={"presence_penalty": 0.5}, eval_size=1, alphabet=m.ALPHABET
    )
    register_task(task, replace=True)
    config = small_config(task=task.name, rollout=rlnb.RolloutConfig(group_size=2, groups_per_step=1))
    with rlnb.Session(config, name="vf-err", engine=ScriptedEngine()) as sess:
        with pytest.raises(rlnb.RolloutError, match=r"'vf-refused' ended its rollout on an error.*presence_penalty"):
            sess.rollout(1, timeout=60)
        assert sess.serve().statistics().by_status.get(400, 0) >= 1

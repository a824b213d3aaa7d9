"""Agents in a session: ``Task(agent=...)`` trained through the session's endpoint with
the real ``openai`` client (async and sync), in the foreground and the background
with a pause mid-episode, evaluated, explored, and closed with episodes in flight.
The rollouts' side (masks, branches, every pause mode, failures) is in
tests/rollout/test_agents.py; the endpoint's HTTP side in tests/serve."""

from __future__ import annotations

import dataclasses
import socket
import threading
from typing import Any

import pytest

import rlnb
from rlnb.data import Task, get_task, register_task
from tests.helpers import small_config

served: list[dict[str, Any]] = []  # what the agents' calls got back, for the tests to compare


async def reverse_agent(client: Any, row: dict[str, Any]) -> float:
    r = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=8
    )
    served.append({"prompt_id": row["prompt_id"], **r.model_dump()})
    return float(r.choices[0].message.content == row["answer"])


def sync_agent(client: Any, row: dict[str, Any]) -> float:
    r = client.completions.create(model="policy", prompt=row["prompt"], max_tokens=8)
    return float(r.choices[0].text == row["answer"])


def agent_task(name: str, agent: Any, **fields: Any) -> Task:
    base = get_task("reverse")
    return register_task(dataclasses.replace(base, name=name, agent=agent, reward=None, **fields), replace=True)


@pytest.mark.netns
def test_an_agent_task_trains_on_exactly_the_tokens_the_endpoint_served() -> None:
    served.clear()
    task = agent_task("reverse_agent", reverse_agent)
    with rlnb.Session(small_config(task=task.name), name="agents") as sess:
        endpoint = sess.serve()
        assert endpoint.base_url.startswith("http://127.0.0.1:") and sess.serve() is endpoint
        metrics = sess.step()
        assert sess.version == 1 and "reward_mean" in metrics
        [group] = sess.rollout(1)
        stats = endpoint.statistics().served
    calls = [c for c in served if c["prompt_id"] == group.prompt_id]
    assert len(calls) == 4
    for sample in group.samples:
        call = next(c for c in calls if c["choices"][0]["token_ids"] == list(sample.token_ids))
        assert tuple(call["prompt_token_ids"]) == group.prompt_ids  # BOS and the prompt, as a rollout has them
        assert sample.mask == (1,) * len(sample.token_ids)
        assert sample.versions == tuple(call["choices"][0]["token_versions"]) == (1,) * len(sample.token_ids)
        assert sample.reward == float(call["choices"][0]["message"]["content"] == group.samples[0].prompt[::-1][1:])
    assert stats.failed == 0 and stats.sampled == stats.completions - stats.pending


@pytest.mark.netns
def test_a_plain_def_agent_gets_the_sync_client_and_the_text_endpoint() -> None:
    task = agent_task("reverse_sync_agent", sync_agent)
    with rlnb.Session(small_config(task=task.name), name="agents-sync") as sess:
        [group] = sess.rollout(1)
        assert all(s.token_ids and s.reward in (0.0, 1.0) for s in group.samples)
        assert sess.serve().statistics().served.sampled == 4
    assert not [t.name for t in threading.enumerate() if t.name.startswith("rlnb-agent")]


@pytest.mark.netns
def test_background_training_with_an_abort_pause_mid_episode_loses_no_episode() -> None:
    task = agent_task("reverse_agent_bg", reverse_agent)
    config = small_config(task=task.name, mode="async")
    with rlnb.Session(config, name="agents-bg") as sess:
        sess.training.start(steps=4)
        while sess.version < 1:
            sess.training.wait(timeout=0.05) if not sess.training.running else threading.Event().wait(0.02)
        sess.rollouts.pause("abort")
        paused = sess.statistics().rollout
        sess.rollouts.resume()
        sess.training.wait(timeout=120)
        assert sess.version == 4 and paused.failed == 0
        stats = sess.serve().statistics()
        assert stats.served.failed == 0 and set(stats.by_status) == {200}


@pytest.mark.netns
def test_evaluate_runs_greedy_episodes_and_explore_shows_the_served_calls() -> None:
    task = agent_task("reverse_agent_eval", reverse_agent)
    with rlnb.Session(small_config(task=task.name), name="agents-eval") as sess:
        accuracy = sess.evaluate(6)
        assert 0.0 <= accuracy <= 1.0
        stats = sess.serve().statistics().served
        assert (stats.evaluated, stats.sampled) == (6, 0)
        calls = sess.serve().log()
        assert len(calls) == 6 and {c.fate for c in calls} == {"evaluated"}
        assert {c.request.sampling.temperature for c in calls} == {1.0}  # as asked; served greedy
        explorer = sess.explore(calls)
        html = explorer.html()
        assert "6 calls served by the endpoint" in html and "evaluated · episode " in html
        assert "mean reward" not in html and "zero variance<" not in html  # a call has no reward of its own
        explorer.close()


@pytest.mark.netns
def test_closing_with_episodes_in_flight_cancels_them_and_closes_the_port() -> None:
    started = threading.Event()

    async def slow_agent(client: Any, row: dict[str, Any]) -> float:
        import asyncio

        await client.chat.completions.create(model="p", messages=[{"role": "user", "content": row["prompt"]}])
        started.set()
        await asyncio.sleep(60)
        return 1.0

    task = agent_task("reverse_agent_slow", slow_agent)
    sess = rlnb.Session(small_config(task=task.name, mode="async"), name="agents-close")
    port = sess.serve().port
    sess.rollouts.start()
    assert started.wait(60)
    sess.close(timeout=10)
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    assert not [t.name for t in threading.enumerate() if t.name.startswith("rlnb-agent")]


def test_a_task_takes_an_agent_or_an_environment_and_checks_both() -> None:
    base = get_task("reverse")
    with pytest.raises(rlnb.ConfigError, match=r"Task.agent=.* an agent or an environment, not both"):
        dataclasses.replace(base, name="x", agent=reverse_agent, env=lambda: None)
    with pytest.raises(rlnb.ConfigError, match=r"Task.agent=.*async def agent\(client, row\)"):
        dataclasses.replace(base, name="x", agent=lambda client: 1.0)
    with pytest.raises(rlnb.ConfigError, match=r"Task.agent_timeout"):
        dataclasses.replace(base, name="x", agent=reverse_agent, agent_timeout=0)
    task = dataclasses.replace(base, name="x", agent=reverse_agent, reward=None)
    assert task.rewards.score("x", "y", env_reward=0.5).total == 0.5  # scored with the agent's reward alone


@pytest.mark.netns
def test_statistics_show_the_endpoint_once_it_has_served() -> None:
    with rlnb.Session(small_config(), name="agents-stats") as sess:
        assert sess.statistics().endpoint is None
        with sess.serve().client(sync=True) as client:
            client.completions.create(model="policy", prompt="12+3=", max_tokens=3)
        stats = sess.statistics()
        assert stats.endpoint is not None and stats.endpoint.served.outside == 1
        assert "1 requests (200: 1)" in repr(stats) and "1 outside" in repr(stats)


@pytest.mark.netns
def test_an_agent_task_goes_on_through_an_endpoint_started_again() -> None:
    task = agent_task("reverse_agent_again", reverse_agent)
    with rlnb.Session(small_config(task=task.name), name="agents-again") as sess:
        first = sess.serve()
        sess.rollout(1)
        first.close()
        with pytest.raises(rlnb.RlnbError, match=r"endpoint is closed.*sess.serve\(\) starts it again"):
            sess.rollout(1)
        second = sess.serve()
        assert (second.port, second.api_key) != (first.port, first.api_key)
        [group] = sess.rollout(1)  # the next episodes call the new endpoint with its key
        stats = second.statistics()  # its own requests; what was served is the session's, both endpoints'
        assert len(group.samples) == 4 and stats.requests == 4 and stats.served.sampled == 8

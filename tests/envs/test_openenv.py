"""OpenEnv environments (``rlnb.envs.OpenEnv``) against a real server process on loopback
(``rlnb.envs.OpenEnvServer``) serving the apps of tests/envs/openenv_env.py: turns map onto
reset/step, a group's samples start the same episode, the environment's tokens are masked,
a rejected action is a turn to try again (or an error), the server goes with its owner
(close, a session's close, SIGKILL of the owner), a server that does not start is a clear
error, and the built-in policy learns the calculator game through it."""

from __future__ import annotations

import dataclasses
import random
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import rlnb
from rlnb.envs import EnvError, Episode, OpenEnv, OpenEnvServer, OpenEnvServerError
from tests.helpers import wait_until
from tests.helpers.processes import PythonProcesses

pytest.importorskip("openenv.core", reason="needs openenv-core (scripts/setup-agents.sh installs it)")
from tests.envs.openenv_env import GuessClient, guess_app

pytestmark = [pytest.mark.netns]

ROOT = Path(__file__).resolve().parents[2]  # the server imports tests.envs.openenv_env from here
CALC = "tests.envs.openenv_env:app"


@pytest.fixture(scope="module")
def calc() -> Iterator[OpenEnvServer]:
    with OpenEnvServer(CALC, cwd=ROOT) as server:
        yield server


@pytest.fixture(scope="module")
def guess() -> Iterator[OpenEnvServer]:
    with OpenEnvServer(guess_app, cwd=ROOT) as server:
        yield server


def calc_task(server: OpenEnvServer, name: str = "openenv_calc") -> rlnb.data.Task:
    """rlnb's calculator game, played on the OpenEnv server: the prompts come from its reset."""
    return rlnb.data.register_task(
        dataclasses.replace(rlnb.data.calculator, name=name, reward=None, env=OpenEnv(server)), replace=True
    )


def guess_row(rng: random.Random) -> tuple[str, str]:
    """The guessing game's rows: its prompt is the server's, and its reward the server's."""
    return "?", "1"


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_turns_map_onto_reset_and_step(calc: OpenEnvServer) -> None:
    episode = Episode(OpenEnv(calc))
    try:
        prompt = episode.reset({"prompt_id": 3})
        assert isinstance(prompt, str) and prompt.endswith("=")
        a, b = map(int, prompt[:-1].split("*"))
        assert episode.step(f"mul({a},{b})") == rlnb.envs.Turn(f"={a * b};", None, False)
        assert episode.step(str(a * b)) == rlnb.envs.Turn(None, 1.0, True)
        assert episode.reward == 1.0
        assert episode.reset({"prompt_id": 3}) == prompt  # the same seed: the same episode, on one connection
    finally:
        episode.close()
    episode.close()  # idempotent


def test_a_rejected_action_is_a_turn_to_try_again_or_an_error(guess: OpenEnvServer) -> None:
    # The generic client: the server rejects "x" for the int field (VALIDATION_ERROR), and
    # "5" is converted; the typed client's Action rejects it before sending, naming the field.
    for client, why in ((None, "the server rejected it (VALIDATION_ERROR)"), (GuessClient, "guess: Input should")):
        episode = Episode(OpenEnv(guess, client=client))
        try:
            assert episode.reset({"prompt_id": 1}) == "?"
            turn = episode.step("x")
            assert str(turn.observation).startswith(f"invalid action: {why}") and turn.reward == 0.0 and not turn.done
            assert episode.step("5").observation in ("<", ">", None)  # the episode goes on
        finally:
            episode.close()
    episode = Episode(OpenEnv(guess, invalid=None))
    try:
        episode.reset({"prompt_id": 1})
        with pytest.raises(EnvError, match=r"rejected the action 'x': the server rejected it"):
            episode.step("x")
    finally:
        episode.close()


def test_an_action_it_cannot_make_by_itself_names_the_fields(guess: OpenEnvServer) -> None:
    episode = Episode(OpenEnv(guess, observation=lambda obs: f"[{obs['text']}]", action=lambda text: {"guess": 3}))
    try:
        assert episode.reset({"prompt_id": 1}) == "[?]"
        assert episode.step("anything").observation in ("[<]", "[>]", "[=]")
    finally:
        episode.close()
    with pytest.raises(rlnb.ConfigError, match=r"OpenEnv\.action=3 is invalid"):
        OpenEnv(guess, action=3)  # type: ignore[arg-type]
    with pytest.raises(rlnb.ConfigError, match=r"pass the server's URL"):
        OpenEnv(8000)


def test_a_server_that_is_not_there_is_a_clear_error() -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    episode = Episode(OpenEnv(url))
    try:
        with pytest.raises(EnvError, match=rf"could not connect to the server at {url}.*OpenEnvServer starts one"):
            episode.reset({"prompt_id": 0})
    finally:
        episode.close()


def refuses_connections(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.socket() as sock:
        return sock.connect_ex((host, int(port))) != 0


def test_a_session_rolls_out_conversations_with_the_environment_masked(guess: OpenEnvServer) -> None:
    # The guessing game: every guess but the right one is answered ("<", ">", or "!" for a
    # guess that is not a number), so the untrained policy's samples are conversations.
    rlnb.data.register_task(
        rlnb.data.Task(
            "openenv_guess",
            alphabet="0123456789<>=?!",
            make_prompt=guess_row,
            reward=None,
            max_new_tokens=2,
            env=OpenEnv(guess, invalid="!"),
            max_turns=3,
        ),
        replace=True,
    )
    config = rlnb.Config(task="openenv_guess", seed=0, model=rlnb.ModelConfig(max_len=24))
    with rlnb.Session(config, name="openenv") as sess:
        batch = sess.rollout(4)
    samples = [s for group in batch for s in group.samples]
    assert all(group.prompt == "?" for group in batch)  # the server's first observation
    conversations = [s for s in samples if s.is_conversation]
    assert len(conversations) > len(samples) // 2, [s.completion for s in samples]
    for sample in conversations:
        # the server's answers (one character each) are masked (not trained), the policy's turns are not
        speakers = [(policy, len(ids)) for policy, ids in sample.segments()]
        assert speakers[0][0] and speakers[1] == (False, 1), speakers
        assert all(s[0] for s in speakers[2::2]) and all(s == (False, 1) for s in speakers[1::2]), speakers
        assert len(sample.turns) == (len(speakers) + 1) // 2
        assert sample.reward == sample.env_reward in (0.0, 1.0)  # the server's reward (1.0: a right guess)
    assert rlnb.sessions() == []


def test_the_session_owns_the_server_and_closes_it(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    config = rlnb.Config(task="addition", seed=0)
    with rlnb.Session(config, name="owner") as sess:
        server = OpenEnvServer(CALC, cwd=ROOT, log=log)
        sess.on_close(server.close)
        pid = server.pid
        assert pid is not None and not gone(pid)
    assert server.closed and gone(pid) and refuses_connections(server.url)
    assert log.exists()  # a log it was given is kept
    server.close()  # idempotent
    with pytest.raises(rlnb.ClosedError, match="is closed"):
        server.check()


def test_a_sigkill_of_the_owner_leaves_no_server(start_python: PythonProcesses) -> None:
    owner = start_python(
        "-c",
        "import sys, time; from rlnb.envs import OpenEnvServer\n"
        f"s = OpenEnvServer({CALC!r}, cwd={str(ROOT)!r}); print(s.pid, flush=True); time.sleep(600)",
    )
    assert owner.stdout is not None
    line = owner.stdout.readline()
    assert line.strip().isdigit(), owner.stderr.read() if owner.stderr else line
    server = psutil.Process(int(line))
    owner.send_signal(signal.SIGKILL)
    assert owner.wait(timeout=10) == -signal.SIGKILL
    wait_until(lambda: gone(server.pid), "the server to die with its owner", timeout=10)


def test_a_server_that_fails_to_start_or_stays_unhealthy_is_a_clear_error(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(
        OpenEnvServerError, match=r"(?s)exited with code 1 before GET .*/health answered.*ModuleNotFound"
    ):
        OpenEnvServer("no_such_module:app", cwd=tmp_path)
    with pytest.raises(OpenEnvServerError, match=r'did not answer GET .*/health with \{"status": "healthy"\} within'):
        OpenEnvServer("tests.envs.openenv_env:unhealthy", cwd=ROOT, start_timeout_s=3.0)
    assert time.monotonic() - started < 30
    with pytest.raises(rlnb.ConfigError, match=r"'module:attr'"):
        OpenEnvServer("guess_env")
    with pytest.raises(rlnb.ConfigError, match=r"cannot import what a notebook or script defines"):
        OpenEnvServer(lambda: None)


@pytest.mark.slow
def test_the_policy_learns_the_game_through_the_server(calc: OpenEnvServer) -> None:
    calc_task(calc, "openenv_calc_rl")
    config = rlnb.Config(
        task="openenv_calc_rl",
        seed=0,
        mode="async",
        model=rlnb.ModelConfig(max_len=48),
        warmup=rlnb.WarmupConfig(steps=150, batch_size=128, lr=3e-3, task="calculator_teacher"),
        learn=rlnb.LearnConfig(lr=1e-4),
        rollout=rlnb.RolloutConfig(reward_timeout=60.0),  # each reset connects: give a loaded machine time
    )
    with rlnb.Session(config, name="openenv_rl") as sess:
        sess.warmup(progress=False)
        before = sess.evaluate(100)  # 100 held-out prompts: each an episode on the server
        sess.train(RL_STEPS, progress=False)
        after = sess.evaluate(100)
        print(f"held-out accuracy through OpenEnv: {before:.2f} after the warm-up -> {after:.2f} after RL")
        assert after >= before + 0.15, (before, after)
        last = [s for group in sess.batches[-1].groups for s in group.samples]
        assert sum(s.is_conversation for s in last) > 0.5 * len(last)  # it learnt to call mul() on the server
        assert sess.statistics().rollout.failed == 0


RL_STEPS = 20

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

import rlnb
from rlnb.data import addition, reverse
from rlnb.data._loader import PromptLoader


def take(loader: PromptLoader, n: int) -> list[rlnb.PromptItem]:
    return [next(loader) for _ in range(n)]


@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_the_stream_is_the_tasks_prompts_in_order_whatever_the_worker_count(num_workers: int) -> None:
    loader = PromptLoader(reverse, seed=5, num_workers=num_workers, prefetch_factor=2)
    try:
        assert len(loader.worker_pids()) == num_workers
        assert take(loader, 40) == list(itertools.islice(reverse.prompts(5), 40))
    finally:
        loader.close()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_saved_state_resumes_at_exactly_the_next_prompt_through_json(num_workers: int) -> None:
    loader = PromptLoader(addition, seed=1, num_workers=num_workers)
    try:
        take(loader, 70)  # past one snapshot interval
        state = json.loads(json.dumps(loader.state_dict()))
        expected = take(loader, 25)
    finally:
        loader.close()
    resumed = PromptLoader(addition, seed=1, num_workers=num_workers, state=state)
    try:
        assert take(resumed, 25) == expected
        assert expected[0].prompt_id == 70
    finally:
        resumed.close()


def test_a_state_saved_with_another_worker_count_is_refused_before_workers_start() -> None:
    loader = PromptLoader(addition, seed=0, num_workers=0)
    take(loader, 3)
    state = loader.state_dict()
    loader.close()
    with pytest.raises(rlnb.ConfigError, match=r"num_workers=0"):
        PromptLoader(addition, seed=0, num_workers=2, state=state)
    assert not psutil.Process().children()


def test_workers_ignore_ctrl_c_and_keep_serving() -> None:
    loader = PromptLoader(addition, seed=0, num_workers=2)
    try:
        take(loader, 5)
        for pid in loader.worker_pids():
            os.kill(pid, signal.SIGINT)  # what the notebook's interrupt does to the process group
        assert take(loader, 40)[-1].prompt_id == 44
        assert all(psutil.Process(pid).is_running() for pid in loader.worker_pids())
    finally:
        loader.close()


def test_close_stops_the_workers_and_is_idempotent() -> None:
    loader = PromptLoader(addition, seed=0, num_workers=2)
    take(loader, 3)
    workers = [psutil.Process(pid) for pid in loader.worker_pids()]
    loader.close()
    loader.close()
    _gone, alive = psutil.wait_procs(workers, timeout=5)
    assert not alive
    with pytest.raises(RuntimeError, match="closed"):
        next(loader)


def test_workers_die_when_their_parent_is_killed(tmp_path: object) -> None:
    script = textwrap.dedent(
        """
        import sys
        from rlnb.data import addition
        from rlnb.data._loader import PromptLoader

        loader = PromptLoader(addition, seed=0, num_workers=2)
        next(loader)
        print(*loader.worker_pids(), flush=True)
        sys.stdin.read()  # until killed
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        workers = [psutil.Process(int(pid)) for pid in parent.stdout.readline().split()]
        assert len(workers) == 2
        parent.kill()  # SIGKILL: no atexit, no finally, no chance to clean up
        parent.wait(timeout=10)
        # at once, not after torch's 5 s watchdog interval
        _gone, alive = psutil.wait_procs(workers, timeout=2)
        assert not alive, f"workers outlived their parent: {alive}"
    finally:
        parent.kill()
        parent.wait()
        assert parent.stdin is not None and parent.stdout is not None
        parent.stdin.close()
        parent.stdout.close()


def test_a_session_serves_its_prompts_through_worker_processes() -> None:
    config = rlnb.Config(data=rlnb.DataConfig(num_workers=2), rollout=rlnb.RolloutConfig(group_size=2))
    with rlnb.Session(config, name="loader") as sess:
        assert len(psutil.Process().children()) == 2
        batch = sess.rollout(3)
        assert [g.prompt for g in batch] == [item.prompt for item in itertools.islice(addition.prompts(0), 3)]
    assert not psutil.Process().children()


def test_data_config_errors_name_the_field() -> None:
    with pytest.raises(rlnb.ConfigError, match=r"DataConfig\.num_workers=-1"):
        rlnb.DataConfig(num_workers=-1)
    with pytest.raises(rlnb.ConfigError, match=r"DataConfig\.multiprocessing_context='threads'"):
        rlnb.DataConfig(multiprocessing_context="threads")

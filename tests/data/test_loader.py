from __future__ import annotations

import itertools
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
from multiprocessing.reduction import ForkingPickler
from typing import Any

import psutil
import pytest
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import rlnb
from rlnb.data import PromptLoaderError, Task, addition, reverse, warm_up_workers
from rlnb.data._loader import PromptLoader, PromptStream, _keep
from tests.helpers import cause_chain, exited, wait_until
from tests.helpers.processes import PythonProcesses

# Kernel-like: torch has run OpenMP work on the main thread, and another thread
# keeps drawing from torch's default generator (holding its mutex most of the time).
KERNEL_LIKE = """
import sys, threading
import torch
from rlnb.data import DataConfig, addition
from rlnb.data._loader import PromptLoader

torch.randn(1_000_000).exp().sum()
stop = threading.Event()
def engine():
    while not stop.is_set():
        torch.randn(2_000_000)
thread = threading.Thread(target=engine)
thread.start()
"""


# A session whose prompts come from one forkserver worker.
CONFIG = rlnb.Config(
    model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2),
    rollout=rlnb.RolloutConfig(group_size=2, groups_per_step=2),
    data=rlnb.DataConfig(num_workers=1, multiprocessing_context="forkserver"),
)


def _never(rng: random.Random) -> tuple[str, str]:
    threading.Event().wait()  # a worker busy making a prompt when it is killed
    raise AssertionError("unreachable")


STUCK = Task("stuck", "0123456789+=", _never, addition.reward, 3)


def kill_and_wait(worker: psutil.Process) -> None:
    worker.send_signal(signal.SIGKILL)
    wait_until(lambda: exited(worker), f"worker {worker.pid} to exit")


def says_worker_died(error: BaseException, pid: int) -> bool:
    return any(f"worker process {pid} died (SIGKILL)" in str(e) for e in cause_chain(error))


@pytest.fixture(autouse=True, scope="module")
def _workers_warm() -> None:
    """The forkserver and multiprocessing's resource tracker live as long as the
    process: start them before any test's leak check takes its first snapshot."""
    warm_up_workers()


def new_descendants(before: set[int]) -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.pid not in before]


def take(loader: PromptLoader, n: int) -> list[rlnb.PromptItem]:
    return [next(loader) for _ in range(n)]


def run_script(start_python: PythonProcesses, script: str, timeout: float = 120) -> str:
    """Run ``script`` in a fresh interpreter; its stdout. Killed (and the test failed) if it hangs."""
    child = start_python("-c", script)
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
        pytest.fail(f"hung for {timeout} s; output so far: {out!r} {err[-2000:]!r}")
    assert child.returncode == 0, err[-2000:]
    return out


@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_the_stream_is_the_tasks_prompts_in_order_whatever_the_worker_count(num_workers: int) -> None:
    loader = PromptLoader(reverse, rlnb.DataConfig(num_workers=num_workers, prefetch_factor=2), seed=5)
    try:
        assert len(loader.worker_pids()) == num_workers
        assert take(loader, 40) == list(itertools.islice(reverse.prompts(5), 40))
    finally:
        loader.close()


@pytest.mark.parametrize("start_method", ["forkserver", "fork", "spawn", None])
def test_every_start_method_serves_the_same_stream(start_method: str | None, loader_workers: set[int]) -> None:
    loader = PromptLoader(addition, rlnb.DataConfig(num_workers=2, multiprocessing_context=start_method), seed=2)
    try:
        assert sorted(p.pid for p in new_descendants(loader_workers)) == sorted(loader.worker_pids())
        assert take(loader, 20) == list(itertools.islice(addition.prompts(2), 20))
    finally:
        loader.close()


def test_the_default_start_method_is_forkserver_where_the_platform_has_it() -> None:
    assert rlnb.data.DEFAULT_START_METHOD == "forkserver"  # this suite runs on Linux
    loader = PromptLoader(addition, seed=0)
    try:
        assert loader.start_method == "forkserver"
        (worker,) = (psutil.Process(pid) for pid in loader.worker_pids())
        # forked from a server that runs nothing else, not from this process
        assert worker.ppid() != os.getpid()
        assert "multiprocessing.forkserver" in " ".join(worker.parent().cmdline())
    finally:
        loader.close()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_saved_state_resumes_at_exactly_the_next_prompt_through_json(num_workers: int) -> None:
    loader = PromptLoader(addition, rlnb.DataConfig(num_workers=num_workers), seed=1)
    try:
        take(loader, 70)  # past one snapshot interval
        state = json.loads(json.dumps(loader.state_dict()))
        expected = take(loader, 25)
    finally:
        loader.close()
    resumed = PromptLoader(addition, rlnb.DataConfig(num_workers=num_workers), seed=1, state=state)
    try:
        assert take(resumed, 25) == expected
        assert expected[0].prompt_id == 70
    finally:
        resumed.close()


def test_a_state_saved_with_another_worker_count_is_refused_before_workers_start(loader_workers: set[int]) -> None:
    loader = PromptLoader(addition, rlnb.DataConfig(num_workers=0), seed=0)
    take(loader, 3)
    state = loader.state_dict()
    loader.close()
    with pytest.raises(rlnb.ConfigError, match=r"num_workers=0"):
        PromptLoader(addition, rlnb.DataConfig(num_workers=2), seed=0, state=state)
    assert not new_descendants(loader_workers)


def test_what_runs_in_a_worker_is_plain_python_and_no_tensor_crosses() -> None:
    """Our part of a worker (the stream, the task, the collate function) makes no
    torch call, and what it sends back (items and stream state) holds no tensor."""
    calls: list[str] = []

    class Functions(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            calls.append(str(func))
            return func(*args, **(kwargs or {}))

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            calls.append(str(func))
            return func(*args, **(kwargs or {}))

    stream = PromptStream(addition, seed=4)
    with Functions(), Ops():
        items = [_keep(item) for item in itertools.islice(stream, 100)]
        state = stream.state_dict()
    assert calls == []
    assert items == list(itertools.islice(addition.prompts(4), 100))
    sent = bytes(ForkingPickler.dumps((items, state)))  # as a worker's queue pickles it
    assert b"torch" not in sent

    loader = PromptLoader(addition, rlnb.DataConfig(num_workers=2), seed=4)
    try:
        got = take(loader, 10)
        assert all(type(i) is rlnb.PromptItem and type(i.prompt) is str and type(i.answer) is str for i in got)
        assert b"torch" not in bytes(ForkingPickler.dumps(loader.state_dict()))
    finally:
        loader.close()


def test_a_loader_starts_in_a_kernel_like_process_where_a_forked_worker_would_deadlock(
    start_python: PythonProcesses,
) -> None:
    # torch's worker loop calls torch.manual_seed before any of our code: forked
    # from this process, a worker would wait on the generator's mutex, held by the
    # engine thread at the moment of the fork, forever.
    script = KERNEL_LIKE + textwrap.dedent(
        """
        try:
            loader = PromptLoader(addition, DataConfig(num_workers=2), seed=0)
            print(*(item.prompt for item in (next(loader) for _ in range(6))))
            loader.close()
        finally:
            stop.set()
            thread.join()
        """
    )
    expected = [item.prompt for item in itertools.islice(addition.prompts(0), 6)]
    assert run_script(start_python, script).split() == expected


def test_a_task_made_in_a_notebook_cell_is_refused_before_any_worker_starts(loader_workers: set[int]) -> None:
    in_a_cell = Task("in-a-cell", "0123456789+=", lambda rng: ("1+1=", "2"), addition.reward, 3)
    with pytest.raises(rlnb.ConfigError, match=r"cannot be sent to a 'forkserver'.*DataConfig\(num_workers=0\)"):
        PromptLoader(in_a_cell, rlnb.DataConfig(num_workers=1), seed=0)
    assert not new_descendants(loader_workers)
    loader = PromptLoader(in_a_cell, rlnb.DataConfig(num_workers=0), seed=0)  # what the message says works
    try:
        assert next(loader).prompt == "1+1="
    finally:
        loader.close()


def test_a_task_made_where_workers_cannot_import_it_makes_its_prompts_here_and_says_so_once(
    start_python: PythonProcesses,
) -> None:
    """``python -c`` has a __main__ that a worker cannot import, as a notebook kernel's:
    a make_prompt defined there makes its prompts in this process, with one line on
    stdout; a task made from records there keeps its workers, whatever its reward."""
    script = textwrap.dedent(
        """
        from rlnb.data import DataConfig, Task, addition
        from rlnb.data._loader import PromptLoader

        def make_prompt(rng):
            return "1+1=", "2"

        task = Task("top-level", "0123456789+=", make_prompt, addition.reward, 3)
        loader = PromptLoader(task, DataConfig(num_workers=1), seed=0)
        print("generated:", loader.num_workers, next(loader).prompt, flush=True)
        loader.close()

        rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(5)]
        data = Task.from_records("cell-data", rows, reward=lambda completion, answer: 1.0, eval_size=0)
        loader = PromptLoader(data, DataConfig(num_workers=1), seed=0)
        print("records:", loader.num_workers, len(loader.worker_pids()), sorted(next(loader).prompt for _ in range(5)))
        loader.close()
        """
    )
    lines = run_script(start_python, script).splitlines()
    notes = [line for line in lines if line.startswith("rlnb:")]
    assert notes == [
        "rlnb: task 'top-level' makes its prompts in this process, not in loader workers: its make_prompt is "
        "defined in this notebook, which a worker cannot import (define them in a .py module to use workers)"
    ]
    assert "generated: 0 1+1=" in lines
    assert "records: 1 1 ['0+1=', '1+1=', '2+1=', '3+1=', '4+1=']" in lines


def test_a_task_from_the_main_script_makes_its_prompts_here_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, loader_workers: set[int]
) -> None:
    # Workers do not run the main script (pytest's __main__ here, a module like a
    # script), so they could not import these: tests/data/test_scripts.py runs real scripts.
    def make_prompt(rng: random.Random) -> tuple[str, str]:
        return "1+1=", "2"

    class Reward:
        def __call__(self, completion: str, answer: str) -> float:
            return 1.0

    # pytest's own __main__ is a module, but a pytest-xdist worker's is neither a module
    # nor a file: give it the file a script's __main__ has.
    monkeypatch.setattr(sys.modules["__main__"], "__file__", __file__, raising=False)
    for obj in (make_prompt, Reward):  # made here, as if defined at the top of the main script
        obj.__module__, obj.__qualname__ = "__main__", obj.__name__
        monkeypatch.setattr(sys.modules["__main__"], obj.__name__, obj, raising=False)
    task = Task("from-main", "0123456789+=", make_prompt, Reward(), 3)
    with pytest.warns(UserWarning, match=r"its make_prompt is defined in the main script") as caught:
        loader = PromptLoader(task, rlnb.DataConfig(num_workers=2), seed=0)
    try:
        assert caught[0].filename == __file__  # the caller's line, not rlnb's
        assert loader.num_workers == 0 and loader.worker_pids() == []
        assert next(loader).prompt == "1+1="
    finally:
        loader.close()
    assert not new_descendants(loader_workers)


def test_workers_ignore_ctrl_c_and_keep_serving() -> None:
    loader = PromptLoader(addition, rlnb.DataConfig(num_workers=2), seed=0)
    try:
        take(loader, 5)
        for pid in loader.worker_pids():
            os.kill(pid, signal.SIGINT)  # what the notebook's interrupt does to the process group
        assert take(loader, 40)[-1].prompt_id == 44
        assert all(psutil.Process(pid).is_running() for pid in loader.worker_pids())
    finally:
        loader.close()


def test_close_stops_the_workers_and_is_idempotent() -> None:
    loader = PromptLoader(addition, rlnb.DataConfig(num_workers=2), seed=0)
    take(loader, 3)
    workers = [psutil.Process(pid) for pid in loader.worker_pids()]
    loader.close()
    loader.close()
    _gone, alive = psutil.wait_procs(workers, timeout=5)
    assert not alive
    with pytest.raises(RuntimeError, match="closed"):
        next(loader)


@pytest.mark.parametrize(
    ("start_method", "thread"),
    [("forkserver", "main"), ("forkserver", "other"), ("fork", "main")],
    ids=["forkserver", "forkserver-from-a-thread", "fork"],
)
def test_nothing_outlives_a_killed_parent(start_method: str, thread: str, start_python: PythonProcesses) -> None:
    script = textwrap.dedent(
        f"""
        import sys, threading
        from rlnb.data import DataConfig, addition
        from rlnb.data._loader import PromptLoader

        made = []
        def build():
            config = DataConfig(num_workers=2, multiprocessing_context={start_method!r})
            made.append(PromptLoader(addition, config, seed=0))
        if {thread!r} == "main":
            build()
        else:
            builder = threading.Thread(target=build)
            builder.start()
            builder.join()  # the thread that started the workers is gone
        next(made[0])
        print(*made[0].worker_pids(), flush=True)
        sys.stdin.read()  # until killed
        """
    )
    parent = start_python("-c", script, stdin=subprocess.PIPE, stderr=None)
    assert parent.stdout is not None
    workers = [psutil.Process(int(pid)) for pid in parent.stdout.readline().split()]
    assert len(workers) == 2
    everything = psutil.Process(parent.pid).children(recursive=True)  # workers, forkserver, tracker
    assert {w.pid for w in workers} <= {p.pid for p in everything}
    parent.kill()  # SIGKILL: no atexit, no finally, no chance to clean up
    parent.wait(timeout=10)
    # Gone within about 0.1 s here (the PDEATHSIG and the forkserver's "alive" pipe);
    # the wait allows for a loaded CI machine, where the resource tracker's cleanup lags.
    _gone, alive = psutil.wait_procs(everything, timeout=10)
    assert not alive, f"outlived their parent: {alive}"


@pytest.mark.parametrize("start_method", ["forkserver", None])
def test_a_session_serves_its_prompts_through_worker_processes(
    start_method: str | None, loader_workers: set[int]
) -> None:
    data = rlnb.DataConfig(num_workers=2, multiprocessing_context=start_method)
    config = rlnb.Config(data=data, rollout=rlnb.RolloutConfig(group_size=2))
    with rlnb.Session(config, name="loader") as sess:
        assert len(new_descendants(loader_workers)) == 2
        batch = sess.rollout(3)
        assert [g.prompt for g in batch] == [item.prompt for item in itertools.islice(addition.prompts(0), 3)]
    assert not new_descendants(loader_workers)


def test_a_worker_killed_while_a_session_rolls_out_fails_the_next_call_clearly(loader_workers: set[int]) -> None:
    with rlnb.Session(CONFIG, name="worker-killed") as sess:
        sess.rollout(2)
        (worker,) = new_descendants(loader_workers)
        sess.rollouts.start()
        wait_until(lambda: sess.statistics().buffer.sizes["train"] > 0, "a group rolled out in the background")

        kill_and_wait(worker)
        with pytest.raises(rlnb.RlnbError) as first:
            sess.rollout(2)
        assert says_worker_died(first.value, worker.pid), first.value
        with pytest.raises(rlnb.RlnbError) as again:  # it stays failed, and says the same
            sess.rollout(1)
        assert says_worker_died(again.value, worker.pid), again.value
    # nothing the session started is alive anywhere: no orphan, no process left under the forkserver
    assert not new_descendants(loader_workers)
    assert not psutil.pid_exists(worker.pid)
    assert all(not p.children() for p in psutil.Process().children())


def test_a_worker_killed_while_the_loader_waits_for_it_ends_the_wait_with_the_error(loader_workers: set[int]) -> None:
    loader = PromptLoader(STUCK, rlnb.DataConfig(num_workers=1), seed=0)
    try:
        (worker,) = new_descendants(loader_workers)
        got: list[BaseException] = []

        def wait_for_a_prompt() -> None:
            try:
                next(loader)
            except BaseException as exc:
                got.append(exc)

        waiter = threading.Thread(target=wait_for_a_prompt, daemon=True)
        waiter.start()
        kill_and_wait(worker)
        waiter.join(timeout=60)  # torch looks at its workers every 5 s while it waits
        assert not waiter.is_alive(), "next() still waits for a dead worker"
        (error,) = got
        assert isinstance(error, PromptLoaderError) and says_worker_died(error, worker.pid), error
        with pytest.raises(PromptLoaderError, match=f"worker process {worker.pid} died"):
            next(loader)
    finally:
        loader.close()
    assert not new_descendants(loader_workers)


def test_data_config_errors_name_the_field() -> None:
    with pytest.raises(rlnb.ConfigError, match=r"DataConfig\.num_workers=-1"):
        rlnb.DataConfig(num_workers=-1)
    with pytest.raises(rlnb.ConfigError, match=r"DataConfig\.multiprocessing_context='threads'"):
        rlnb.DataConfig(multiprocessing_context="threads")

"""Plain scripts run as users write them: no ``if __name__ == "__main__":`` guard,
``python file.py``, ``python -m module`` and ``python -c``, with the prompt loader's
workers started from the forkserver (the default)."""

from __future__ import annotations

import multiprocessing.spawn
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from rlnb.runtime import spawn_without_main

SESSION = """
import rlnb

config = rlnb.Config(
    task=TASK,
    model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2),
    rollout=rlnb.RolloutConfig(group_size=2, groups_per_step=2),
    data=rlnb.DataConfig(num_workers=1, multiprocessing_context="forkserver"),
)
sess = rlnb.Session(config, name="script")
print("workers", len(sess._prompts.worker_pids()), flush=True)
sess.train(2)
print("prompts", *(g.prompt for g in sess.rollout(2)))
sess.close()
print("done")
"""

TASK_FUNCTIONS = """
import random


def make_prompt(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(1, 9)
    return f"{n}*2=", str(2 * n)


def reward(completion: str, answer: str) -> float:
    return float(completion.strip() == answer)
"""

DOUBLE = """
from rlnb.data import Task, register_task

register_task(Task("double", "0123456789*=", make_prompt, reward, 3), replace=True)
"""


def guarded(source: str) -> str:
    return 'if __name__ == "__main__":\n' + textwrap.indent(source, "    ")


def run(args: list[str], cwd: Path, timeout: float = 120) -> tuple[str, str]:
    """Run ``python *args`` in ``cwd``; its stdout and stderr. Fails the test if it
    exits with an error or hangs (then it is killed)."""
    child = subprocess.Popen(
        [sys.executable, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
        pytest.fail(f"hung for {timeout} s; output so far: {out!r} {err[-3000:]!r}")
    assert child.returncode == 0, f"exit code {child.returncode}:\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    return out, err


def lines(out: str) -> dict[str, str]:
    """The script's printed lines by their first word."""
    return {line.split(" ", 1)[0]: line.partition(" ")[2] for line in out.splitlines() if line}


@pytest.mark.slow  # each runs a fresh interpreter, which imports torch
@pytest.mark.parametrize("how", ["file", "module", "-c", "guarded file"])
def test_a_script_without_a_main_guard_trains_with_its_workers(how: str, tmp_path: Path) -> None:
    # Before: each forkserver worker ran the script again as __mp_main__, built another
    # session there, and died ("DataLoader worker (pid(s) ...) exited unexpectedly").
    source = SESSION.replace("TASK", '"addition"')
    if how == "guarded file":
        source = "import rlnb\n" + guarded(source)
    (tmp_path / "train.py").write_text(source)
    args = {"file": ["train.py"], "module": ["-m", "train"], "-c": ["-c", source], "guarded file": ["train.py"]}
    out, _err = run(args[how], tmp_path)
    printed = lines(out)
    assert printed["workers"] == "1"
    assert len(printed["prompts"].split()) == 2
    assert "done" in printed


@pytest.mark.slow
@pytest.mark.parametrize("how", ["file", "guarded file"])
def test_a_task_defined_in_the_main_script_makes_its_prompts_in_this_process(how: str, tmp_path: Path) -> None:
    # A worker could import the task's functions only by running the script again.
    source = TASK_FUNCTIONS + DOUBLE + SESSION.replace("TASK", '"double"')
    if how == "guarded file":
        source = TASK_FUNCTIONS + guarded(DOUBLE + SESSION.replace("TASK", '"double"'))
    (tmp_path / "train.py").write_text(source)
    out, err = run(["train.py"], tmp_path)
    printed = lines(out)
    assert printed["workers"] == "0"
    assert all(p.endswith("*2=") for p in printed["prompts"].split())
    assert "done" in printed
    warning = [line for line in err.splitlines() if "UserWarning" in line]
    assert len(warning) == 1, err
    assert warning[0].startswith(f"{tmp_path / 'train.py'}:")  # it points at the user's line, not rlnb's
    assert "task 'double' makes its prompts in this process" in warning[0]
    assert "its make_prompt is defined in the main script" in warning[0]  # the reward stays here
    assert "DataConfig(num_workers=0)" in warning[0]


@pytest.mark.slow
def test_a_task_from_a_module_next_to_the_script_keeps_its_workers(tmp_path: Path) -> None:
    (tmp_path / "mytasks.py").write_text(TASK_FUNCTIONS)
    source = "from mytasks import make_prompt, reward\n" + DOUBLE + SESSION.replace("TASK", '"double"')
    (tmp_path / "train.py").write_text(source)
    out, err = run(["train.py"], tmp_path)
    printed = lines(out)
    assert printed["workers"] == "1"
    assert all(p.endswith("*2=") for p in printed["prompts"].split())
    assert "Warning" not in err, err


def test_only_the_thread_that_starts_workers_leaves_the_main_script_out(monkeypatch: pytest.MonkeyPatch) -> None:
    # pytest's own __main__ is a module, but a pytest-xdist worker's is neither a module
    # nor a file: give it the file a script's __main__ has.
    monkeypatch.setattr(sys.modules["__main__"], "__file__", __file__, raising=False)
    keys = {"init_main_from_path", "init_main_from_name"}
    seen: dict[str, set[str]] = {}

    def other_thread() -> None:
        seen["other"] = keys & set(multiprocessing.spawn.get_preparation_data("x"))

    with spawn_without_main():
        seen["inside"] = keys & set(multiprocessing.spawn.get_preparation_data("x"))
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    seen["after"] = keys & set(multiprocessing.spawn.get_preparation_data("x"))
    assert seen["after"], "__main__ is a module or a file: its processes would run it"
    assert seen == {"inside": set(), "other": seen["after"], "after": seen["after"]}

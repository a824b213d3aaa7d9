"""The faults a run must survive, and where each is tested.

The targets for every fault: a clear error at the next call on the session,
nothing already saved is damaged, and no process outlives a killed one by more
than 2 s.

| fault | tested in |
|---|---|
| a reward that raises, hangs or returns garbage | ``tests/rollout/test_reward.py`` |
| an engine thread that dies: every waiter and every later request fails | ``tests/engines/test_tiny.py`` |
| ... during ``rollout()`` | ``tests/session/test_session_rollout.py`` |
| ... mid-generation while training in the background (``start()``) | here |
| a loader worker killed with SIGKILL | ``tests/data/test_loader.py`` |
| a full disk during ``save()`` (a write that fails with ENOSPC; a rename that fails) | ``tests/test_bad_input.py`` |
| ... and during ``save_pretrained()``, simulated | ``tests/test_files.py`` |
| ... on a real full disk (a small tmpfs, where the tests may mount one) | here |
| a kill while ``save()`` replaces a checkpoint | here (the swap is one atomic step) |
| kill -9 at random moments of ``save()`` and ``save_pretrained()``, 30 each | here |
| SIGTERM to ``rlnb train`` (foreground training, wandb) | ``tests/track/test_tracker.py`` |
| SIGTERM and SIGKILL of a process training in the background, with loader workers and an offline wandb run | here |
| a ``make_prompt`` raising at random: raised once or skipped, capacity intact | ``tests/data/test_bad_prompts.py`` |
| any pause x full or empty buffer x weight sync x foreground or background training | ``tests/test_pause_matrix.py`` |
| a callback that stops the run it is part of, or calls back into the session | ``tests/test_pause_matrix.py`` |
| ``close()`` from another thread during a call | ``tests/session/test_session_rollout.py`` |
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

import rlnb
from rlnb.track import EXIT_SIGTERM, read_run
from tests.helpers import HookedEngine, Hooks, cause_chain, exited, small_config, wait_until

CONFIG = small_config()


def engine_death(error: BaseException) -> rlnb.EngineError | None:
    """The engine's death in ``error``'s chain of causes, if it is there."""
    deaths = [e for e in cause_chain(error) if isinstance(e, rlnb.EngineError)]
    return deaths[0] if deaths else None


# -- an engine that dies mid-generation ----------------------------------------------


def break_engine(engine: HookedEngine) -> RuntimeError:
    """Kill ``engine``'s thread at its next turn: ``_apply_updates`` runs there on every
    turn, outside decode and prefill, so its failure ends the thread."""
    broken = RuntimeError("the engine broke")

    def apply_updates(updates: object) -> None:
        raise broken

    engine.inner._apply_updates = apply_updates  # type: ignore[method-assign,assignment]
    return broken


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_engine_that_dies_mid_generation_during_background_training_fails_the_next_call(mode: str) -> None:
    config = CONFIG.replace(mode=mode)
    engine = HookedEngine(config, name="rlnb-dying-engine")
    sess = rlnb.Session(config, name="dying-engine", engine=engine)
    try:
        sess.training.start()
        wait_until(lambda: sess.version >= 1 and engine.statistics().running > 0, "a trained step, then decoding")
        broken = break_engine(engine)

        def settled() -> bool:
            stats = sess.statistics(raise_errors=False)
            r = stats.rollout
            # every sample has settled and every group has ended (a group's failure is
            # stored as it ends, a moment after its last sample settled)
            ended = r.groups_finished + r.groups_failed + r.groups_cancelled
            return not stats.training.running and r.in_flight == 0 and ended == r.groups_dispatched

        # a deadline against a hang only: on a loaded 2-core machine this took over 20 s once
        wait_until(settled, "the background run to fail and every sample to settle", timeout=60.0)
        with pytest.raises(rlnb.RlnbError) as raised:
            sess.statistics()
        death = engine_death(raised.value)
        assert death is not None, cause_chain(raised.value)
        assert "engine thread died" in str(death) and death.__cause__ is broken
        # In async mode the background rollouts and the background run fail apart
        # (two errors, each raised once); every one of them leads to the death.
        for _ in range(2):
            try:
                sess.statistics()
            except rlnb.RlnbError as later:
                assert engine_death(later) is not None, cause_chain(later)
            else:
                break
        assert "the engine broke" in str(engine.statistics().extra["died"])
    finally:
        sess.close()  # every failure was raised: closing raises nothing
    sess.close()


def test_after_the_engine_died_errors_say_to_make_a_new_session_and_save_still_works(tmp_path: Path) -> None:
    hooks = Hooks()
    engine = HookedEngine(CONFIG, name="rlnb-dying-engine")
    with rlnb.Session(CONFIG, name="dying-engine", engine=engine, callbacks=[hooks]) as sess:
        hooks.batch = lambda groups: break_engine(engine)  # it dies while the step's weights are sent
        with pytest.raises(rlnb.RlnbError) as first:
            sess.step(timeout=30)
        with pytest.raises(rlnb.RlnbError) as later:
            sess.rollout(1, timeout=30)
        for raised in (first.value, later.value):
            assert engine_death(raised) is not None, cause_chain(raised)
            assert not [str(e) for e in cause_chain(raised) if "resume()" in str(e)]
            assert "make a new one" in str(raised)
        sess.save(tmp_path / "ckpt")  # what was learnt is kept
    with rlnb.Session.load(tmp_path / "ckpt", name="dying-engine") as sess:
        assert sess.version == 1  # the step was trained before its sync found the engine dead
        sess.step()


# -- SIGTERM and SIGKILL of a process training in the background ------------------------

# Trains in the background with two loader workers and an offline wandb run, after
# saving a checkpoint at step 1; once two more steps are logged it prints a line of
# JSON (its version, run id and wandb's flush interval), then waits to be signalled.
SCRIPT = textwrap.dedent(
    """
    import json, logging, os, sys, threading, time
    import rlnb
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    run_dir = sys.argv[1]
    config = rlnb.Config(
        model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2),
        rollout=rlnb.RolloutConfig(group_size=4, groups_per_step=4),
        data=rlnb.DataConfig(num_workers=2),
        track=rlnb.TrackConfig(backends=("wandb",), run_dir=run_dir, wandb_mode="offline"),
    )
    sess = rlnb.Session(config, name="faults")
    sess.step()
    sess.save(os.path.join(run_dir, "ckpt"))
    sess.training.start()
    deadline = time.monotonic() + 60
    while sess.version < 3 and time.monotonic() < deadline:
        threading.Event().wait(0.01)
    flush = sess.tracker.backend("wandb").run.settings.x_transaction_log_flush_interval
    print(json.dumps({"ready": sess.version, "run_id": sess.tracker.run_id, "flush_interval": flush}), flush=True)
    threading.Event().wait(120)
    """
)

# A killed process's children must be gone within this long.
ORPHAN_DEADLINE = 2.0


@pytest.fixture
def training_script(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], dict[str, Any]]]:
    """The script, started and trained past step 1; killed and reaped afterwards."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            proc.kill()
            pytest.fail(f"the script died before it was ready:\n{proc.communicate()[1]}")
        ready = json.loads(line)
        assert ready["ready"] >= 3, ready
        yield proc, ready
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def descendants(pid: int) -> dict[psutil.Process, str]:
    """Every process below ``pid`` (loader workers, wandb-core, whatever they started), named."""
    found = {p: f"{p.name()}[{p.pid}]" for p in psutil.Process(pid).children(recursive=True)}
    names = sorted(found.values())
    assert any(n.startswith("wandb-core") for n in names) and len(found) >= 3, f"no wandb-core or workers: {names}"
    return found


def wait_dead(procs: dict[psutil.Process, str], since: float, deadline: float) -> dict[str, float]:
    """Poll ``procs`` until each has died; how long after ``since`` each took, by name.
    Fails naming those still alive ``deadline`` s after ``since``."""
    left, took = dict(procs), {}
    tick = threading.Event()
    while left:
        now = time.monotonic()
        for proc in [p for p in left if exited(p)]:
            took[left.pop(proc)] = round(now - since, 3)
        if left and now - since > deadline:
            pytest.fail(f"{sorted(left.values())} outlived their parent by {deadline} s (the rest took {took})")
        tick.wait(0.005)
    return took


def wandb_run_file(run_dir: Path) -> rlnb.track.WandbRunFile:
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    return read_run(files[0])


def logged_steps(run_dir: Path) -> list[int]:
    """The training steps in the run file so far."""
    return [h["_step"] for h in wandb_run_file(run_dir).history if "reward_mean" in h]


@pytest.mark.slow
def test_sigterm_closes_the_session_finishes_the_run_with_143_and_leaves_no_process(
    training_script: tuple[subprocess.Popen[str], dict[str, Any]], tmp_path: Path
) -> None:
    proc, ready = training_script
    children = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM, err  # it still dies by SIGTERM, after closing
    assert "closed 1 session(s) ['faults'] on SIGTERM" in err
    wait_dead(children, time.monotonic(), ORPHAN_DEADLINE)  # closed with the session: none is left
    run = wandb_run_file(tmp_path)
    assert run.run_id == ready["run_id"] and run.exit_code == EXIT_SIGTERM
    steps = logged_steps(tmp_path)
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= ready["ready"]
    manifest, _ = rlnb.checkpoint.read(tmp_path / "ckpt")  # every file's SHA-256 checks out
    assert manifest["step"] == 1


@pytest.mark.slow
def test_after_sigkill_no_process_is_left_and_what_was_saved_is_intact(
    training_script: tuple[subprocess.Popen[str], dict[str, Any]], tmp_path: Path
) -> None:
    proc, ready = training_script
    # wandb-core writes the run file every second, not every 15 s (its default), so
    # a SIGKILL loses at most the last second of metrics.
    assert ready["flush_interval"] <= 1.0
    wait_until(lambda: len(logged_steps(tmp_path)) >= ready["ready"], "the logged steps to reach the run file")
    written = logged_steps(tmp_path)
    children = descendants(proc.pid)
    killed = time.monotonic()
    proc.kill()  # no handler, no atexit, no finally runs
    proc.wait(timeout=10)
    took = wait_dead(children, killed, ORPHAN_DEADLINE)
    print(f"after SIGKILL, seconds until each descendant died: {took}")
    run = wandb_run_file(tmp_path)
    assert run.run_id == ready["run_id"] and run.exit_code is None  # it never finished
    steps = logged_steps(tmp_path)
    assert steps[: len(written)] == written == list(range(1, len(written) + 1)), (steps, written)
    with rlnb.Session.load(tmp_path / "ckpt", name="after-kill") as sess:  # every file's SHA-256 checks out
        assert sess.version == 1 and sess.tracker.run_id == ready["run_id"]
        sess.step()
        assert sess.version == 2


# Saves a checkpoint at step 1 to argv[1], trains a step and saves there again, but
# is killed the moment the new checkpoint has been swapped in, before the old one,
# swapped out beside it, is removed.
SAVE_KILLED_SCRIPT = textwrap.dedent(
    """
    import os, pathlib, shutil, signal, sys
    import rlnb
    config = rlnb.Config(
        model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2),
        rollout=rlnb.RolloutConfig(group_size=4, groups_per_step=4),
        data=rlnb.DataConfig(num_workers=0),
    )
    path = pathlib.Path(sys.argv[1])
    sess = rlnb.Session(config, name="save")
    sess.step()
    sess.save(path)
    sess.step()
    rmtree = shutil.rmtree

    def killed_right_after_the_swap(target, *args, **kwargs):
        target = pathlib.Path(target)
        if target.name.startswith(f".{path.name}.") and (target / "checkpoint.json").is_file():
            os.kill(os.getpid(), signal.SIGKILL)  # the old checkpoint, swapped out
        return rmtree(target, *args, **kwargs)

    shutil.rmtree = killed_right_after_the_swap
    sess.save(path)
    """
)


@pytest.mark.slow
def test_a_kill_while_save_replaces_a_checkpoint_leaves_a_whole_one_that_loads(tmp_path: Path) -> None:
    """The new checkpoint replaces the old in one atomic step (renameat2 RENAME_EXCHANGE):
    there is no moment at which the path holds neither."""
    path = tmp_path / "ckpt"
    done = subprocess.run(
        [sys.executable, "-c", SAVE_KILLED_SCRIPT, str(path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    with rlnb.Session.load(path, name="after-kill") as sess:
        assert sess.version == 2  # the new one was in place when the kill came
        sess.step()


# -- kill -9 at random points of save() and save_pretrained() ---------------------------

# Imports rlnb once, then forks a writer for each line it reads: the writer builds two
# sessions (two seeds, or two Hugging Face models) and saves them in turn to one path,
# without end, until it is killed. Forking spares each kill the imports (~3 s); no torch
# work runs before the fork (a fork after it can hang in libgomp). Each writer prints
# one line of JSON once it has saved a few times; one told "once" then exits.
WRITERS = textwrap.dedent(
    """
    import importlib, itertools, json, os, signal, sys, time, traceback
    import rlnb

    # what building a session imports lazily (torch._dynamo alone takes a second)
    for name in ("rlnb.learn", "rlnb.models", "rlnb.rollout", "rlnb.data", "torch._dynamo",
                 "torchdata.stateful_dataloader", "uvloop", "transformers.models.llama.modeling_llama"):
        try:
            importlib.import_module(name)
        except ImportError:  # an optional one
            pass

    def write(kind, path, models, once):
        config = rlnb.Config(
            model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2),
            rollout=rlnb.RolloutConfig(group_size=2, groups_per_step=2),
            data=rlnb.DataConfig(num_workers=0),
        )
        if kind == "save":
            sessions = [rlnb.Session(config.replace(seed=i), name=f"writer-{i}") for i in range(2)]
        else:
            sessions = [
                rlnb.Session(config.replace(model=rlnb.ModelConfig(path=m, max_len=32)), name=f"writer-{i}")
                for i, m in enumerate(models)
            ]
        times = []
        for n in itertools.count():
            started = time.perf_counter()
            sessions[n % 2].save(path) if kind == "save" else sessions[n % 2].save_pretrained(path)
            times.append(time.perf_counter() - started)
            if n == (1 if once else 5):
                print(json.dumps({"ready": os.getpid(), "save_s": sorted(times)[len(times) // 2]}), flush=True)
                if once:
                    return

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the system reaps the writers
    for line in sys.stdin:
        if os.fork() == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                write(*json.loads(line))
                os._exit(0)
            except BaseException:
                print(json.dumps({"failed": traceback.format_exc()}), flush=True)
                os._exit(1)
    """
)

KILLS = 30


@contextlib.contextmanager
def writers(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """The process that forks writers; its stderr goes to ``writers.log``."""
    with (tmp_path / "writers.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITERS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
        )
        with proc:  # closes its pipes and waits for it, which ends once its stdin is closed
            yield proc


def start_writer(
    proc: subprocess.Popen[str], kind: str, path: Path, models: list[str], *, once: bool
) -> dict[str, Any]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps([kind, str(path), models, once]) + "\n")
    proc.stdin.flush()
    line = json.loads(proc.stdout.readline() or '{"failed": "the writers\' process died"}')
    assert "failed" not in line, line["failed"]
    return line


def beside(path: Path) -> dict[str, int]:
    """What is beside ``path`` in its directory (a killed save's staging), with its size in bytes."""
    return {
        p.name: sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        for p in path.parent.iterdir()
        if p.name != path.name
    }


def whole(path: Path, listing: str) -> str:
    """Check that ``path`` holds exactly the files ``listing`` (the checkpoint's manifest, the
    export's rlnb.json) names, each with the SHA-256 recorded there; return the model file's."""
    files = json.loads((path / listing).read_text())["files"]
    assert {p.name for p in path.iterdir()} == {listing, *files}, sorted(p.name for p in path.iterdir())
    for name, digest in files.items():
        assert hashlib.sha256((path / name).read_bytes()).hexdigest() == digest, f"{name} is not the one saved"
    return str(files["model.safetensors"])


def kill_saves_at_random(tmp_path: Path, kind: str, models: list[str]) -> dict[str, Any]:
    """Kill ``KILLS`` writers at random moments of their saves; after each kill the path
    holds one of the two saved states, whole, and only that kill's staging is beside it.
    A last writer saves without being killed and must leave nothing beside the path."""
    path, listing = tmp_path / "out" / "target", "checkpoint.json" if kind == "save" else "rlnb.json"
    rng = random.Random(os.environ.get("RLNB_KILL_SEED", "0"))
    states: set[str] = set()
    previous: set[str] = set()
    left = left_bytes = 0
    with writers(tmp_path) as proc:
        for _ in range(KILLS):
            ready = start_writer(proc, kind, path, models, once=False)
            threading.Event().wait(rng.uniform(0, 20 * ready["save_s"]))  # ~20 saves: any moment of one
            writer = psutil.Process(ready["ready"])
            writer.kill()
            wait_until(functools.partial(exited, writer), "the killed writer to be gone")
            states.add(whole(path, listing))
            now = beside(path)
            assert len(now) <= 1 and not set(now) & previous, (now, previous)  # the last kill's were removed
            left, left_bytes, previous = left + len(now), left_bytes + sum(now.values()), set(now)
        start_writer(proc, kind, path, models, once=True)
        wait_until(lambda: not beside(path), "the last writer to finish")
    assert len(states) == 2, states  # the kills landed on both sessions' saves
    assert whole(path, listing) in states
    return {
        "kills": KILLS,
        "left_a_staging_directory": left,
        "bytes_left": left_bytes,
        "save_ms": ready["save_s"] * 1e3,
    }


@pytest.mark.slow
def test_kill_9_at_random_points_of_save_leaves_a_whole_checkpoint_and_the_next_save_cleans_up(
    tmp_path: Path,
) -> None:
    figures = kill_saves_at_random(tmp_path, "save", [])
    print(f"save(): {figures}")
    with rlnb.Session.load(tmp_path / "out" / "target", name="after-kills") as sess:
        assert sess.version == 0
        sess.step()


@pytest.mark.slow
def test_kill_9_at_random_points_of_save_pretrained_leaves_a_whole_model_and_the_next_save_cleans_up(
    tmp_path: Path,
) -> None:
    pytest.importorskip("transformers", reason="the 'hf' extra (transformers) is not installed")
    from rlnb.models import tiny_llama

    models = [str(tiny_llama(tmp_path / "models" / f"seed-{seed}", seed=seed)) for seed in (0, 1)]
    figures = kill_saves_at_random(tmp_path, "save_pretrained", models)
    print(f"save_pretrained(): {figures}")
    import transformers

    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "target", local_files_only=True)


# -- a full disk: a small tmpfs -----------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """``small_disk(kib)``: a tmpfs of that size, mounted for the test (as root; skipped
    where mounting is not allowed: the simulated full disks in tests/test_bad_input.py
    and tests/test_files.py stand in)."""
    mounted: list[Path] = []

    def mount(kib: int) -> Path:
        where = tmp_path / f"disk-{len(mounted)}"
        where.mkdir()
        try:
            done = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(where)], capture_output=True, text=True
            )
        except FileNotFoundError as exc:
            pytest.skip(f"cannot mount a tmpfs here: {exc}")
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(where)
        return where

    try:
        yield mount
    finally:
        gc.collect()  # tensors loaded from a checkpoint there may map its files until collected
        for where in mounted:
            subprocess.run(["umount", str(where)], check=True)


def fill(disk: Path, leave: int) -> Path:
    """Fill ``disk`` but ``leave`` bytes with one file; returns it."""
    filler = disk / "filler"
    with filler.open("wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 4096)
    filler.write_bytes(b"\0" * max(0, filler.stat().st_size - leave))
    return filler


def digests(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


@pytest.mark.slow
def test_a_full_disk_during_save_is_a_checkpoint_error_and_the_previous_checkpoint_stays(
    small_disk: Callable[[int], Path],
) -> None:
    disk = small_disk(1024)
    path = disk / "ckpt"
    config = CONFIG.replace(learn=rlnb.LearnConfig(kl_coef=0.05))  # a reference model too: five files
    with rlnb.Session(config, name="full-disk") as sess:
        sess.step()
        sess.save(path)
        before = digests(path)
        sess.step()
        for leave in (0, 64 * 1024, 160 * 1024):  # fails at the first file, the second, the third
            filler = fill(disk, leave)
            with pytest.raises(rlnb.CheckpointError) as info:
                sess.save(path)
            message = str(info.value)
            assert f"cannot save a checkpoint to {path}: [Errno 28] No space left on device" in message, message
            assert "free some space" in message
            assert digests(path) == before, "the previous checkpoint was changed"
            assert sorted(p.name for p in disk.iterdir()) == ["ckpt", "filler"], "a staging directory was left"
            filler.unlink()
        sess.save(path)
    with rlnb.Session.load(path, name="full-disk") as sess:
        assert sess.version == 2


@pytest.mark.slow
def test_a_full_disk_during_save_pretrained_is_a_checkpoint_error_and_the_previous_model_stays(
    small_disk: Callable[[int], Path], tmp_path: Path
) -> None:
    pytest.importorskip("transformers", reason="the 'hf' extra (transformers) is not installed")
    from rlnb.models import tiny_llama

    model = tiny_llama(tmp_path / "tiny-llama", seed=0)
    disk = small_disk(2048)  # room for one export (1.3 MB), not for a second beside it
    path = disk / "export"
    config = CONFIG.replace(model=rlnb.ModelConfig(path=str(model), max_len=32))
    with rlnb.Session(config, name="full-disk-export") as sess:
        sess.save_pretrained(path)
        before = digests(path)
        sess.step()
        for leave in (0, 600 * 1024, None):  # nothing, part of the weights, all but the last files
            filler = fill(disk, leave) if leave is not None else None
            with pytest.raises(rlnb.CheckpointError) as info:
                sess.save_pretrained(path)
            message = str(info.value)
            assert f"cannot save the model to {path}: [Errno 28] No space left on device" in message, message
            assert digests(path) == before, "the previous model was changed"
            assert sorted(p.name for p in disk.iterdir()) == sorted(["export", *(["filler"] if filler else [])])
            if filler is not None:
                filler.unlink()

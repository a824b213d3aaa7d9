"""``rlnb.Session``: the composition root that owns every part of a training run.

Each part registers its close on one LIFO exit stack the moment it exists, so a
failure half-way through construction releases exactly what was acquired, and
``close()`` releases everything in reverse order even if one part fails to stop.
The parts do the work: the :class:`~rlnb.learn.Trainer` runs the steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlnb import checkpoint
from rlnb._errors import ClosedError, public_call
from rlnb.buffer import ReplayBuffer
from rlnb.config import Config
from rlnb.data import Task, get_task
from rlnb.engines import Engine
from rlnb.rollout import Rollouter
from rlnb.runtime import (
    AsyncBridge,
    Snapshot,
    defer_interrupts,
    make_view,
    register_session,
    replace_session,
    snapshot,
    unregister_session,
    warm_up_kernel_messages,
    warm_up_loop_backend,
)
from rlnb.session import _assembly as parts
from rlnb.session._diagnose import DiagnoseCells
from rlnb.session._experiment_cells import ExperimentCells
from rlnb.session._explore_cells import ExploreCells
from rlnb.session._rollout_cells import RolloutCells
from rlnb.session._stall import Stacks, StallWatch, stacks
from rlnb.session._statistics import SessionStatistics
from rlnb.session._training_cells import TrainingCells
from rlnb.track import EXIT_FAILURE, EXIT_SIGINT, Tracker, exit_code_for

if TYPE_CHECKING:
    from rlnb.learn import Callback


class Session(RolloutCells, TrainingCells, ExperimentCells, ExploreCells, DiagnoseCells):
    """A training run you can drive one notebook cell at a time.

    ``Session(config, name=...)`` closes a live session of the same name first (so
    re-running the cell that made it is safe) and says so on stderr. Use it as a
    context manager or call :meth:`close`; ``rlnb.close_all()`` and a kernel
    restart close it too. Raises :class:`~rlnb.ConfigError` for bad input before
    anything is built or closed, a ``TrackConfig.run_dir`` that another live session
    writes to included (an earlier run's files there are kept beside this one's:
    :class:`~rlnb.Tracker`).

    ``engine``: any object that keeps the :class:`~rlnb.engines.Engine` protocol,
    instead of the one ``config.engine`` describes; the session syncs the policy's
    weights into it and owns it from then on (it is closed with the session, or
    if construction fails). ``callbacks``: :class:`~rlnb.learn.Callback` objects
    called at each training step (``sess.callbacks`` is the live list).
    """

    # Construction stages, in order; each ``_build_<stage>`` puts its part's close on
    # the LIFO stack as soon as the part exists. The prompt loader forks its workers
    # before this session starts any thread (wandb's included); the tracker finishes
    # after every later part.
    _STAGES = (
        "bridge",
        "data",
        "tracker",
        "buffer",
        "learner",
        "engine",
        "rollouter",
        "trainer",
        "stall_watch",
        "registry",
    )

    def __init__(
        self,
        config: Config | None = None,
        *,
        name: str = "default",
        engine: Engine | None = None,
        callbacks: Sequence[Callback] = (),
        _restore: tuple[dict[str, Any], dict[str, Any], Path] | None = None,
    ) -> None:
        self._stack = contextlib.ExitStack()
        self._closed, self._exit_code = False, 0
        self._deadline: float | None = None
        self._on_close: list[tuple[Callable[..., object], tuple[Any, ...]]] = []
        self._stack.callback(self._closed_callbacks)  # registered first: runs after every part is closed
        try:
            self._config = parts.check_session_args(config, name, engine, callbacks)
            self._engine: Any = engine
            self._engine_given = engine is not None
            if engine is not None:  # a caller's engine is ours from now on, closed last
                self._own(engine)
            self._name, self._callbacks, self._restore = name, callbacks, _restore
            self._lock = threading.Lock()
            self._settings_lock = threading.Lock()  # one set() at a time
            self._task: Task = get_task(self._config.task)
            from rlnb.models import model_shape  # torch: not at `import rlnb`

            self._tokenizer, self._model = model_shape(self._config, self._task)
            replace_session(name)
            warm_up_loop_backend()  # its process-long FDs are not this session's
            warm_up_kernel_messages()  # nor pyzmq's garbage collector, in a kernel
            self._baseline = snapshot()  # what the process held before this session built anything
            for stage in self._STAGES:
                getattr(self, f"_build_{stage}")()
        except BaseException as exc:
            self._closed, self._exit_code = True, exit_code_for(exc)  # a tracker already made says it failed
            self._stack.close()
            raise
        finally:
            self._restore = None  # a checkpoint's (manifest, tensors, path), while loading

    def _own(self, part: Any) -> Any:
        self._stack.callback(self._close_part, part)
        return part

    def _build_bridge(self) -> None:
        self._bridge = self._own(AsyncBridge(name=f"rlnb-{self._name}"))

    def _build_data(self) -> None:
        state = None if self._restore is None else self._restore[0]["loader"]
        self._prompts = self._own(parts.make_loader(self._config, self._task, state))

    def _build_tracker(self) -> None:
        run_id = self._config.track.run_id if self._restore is None else self._restore[0]["tracker"]["run_id"]
        self._tracker = tracker = parts.make_tracker(self._config, name=self._name, run_id=run_id)
        self._stack.callback(lambda: tracker.finish(self._exit_code))

    def _build_buffer(self) -> None:
        self._buffer = self._own(parts.make_buffer(self._config))

    def _build_learner(self) -> None:
        self._learner = parts.make_learner(self._config, self._model, self._tokenizer)

    def _build_engine(self) -> None:
        if self._engine is None:
            name = f"rlnb-{self._name}-engine"
            engine = parts.make_engine(self._config, self._learner, self._tokenizer, name=name, bridge=self._bridge)
            self._engine = self._own(engine)

    def _build_rollouter(self) -> None:
        self._rollouter = parts.make_rollouter(
            self._config, self._task, self._tokenizer, engine=self._engine, prompts=self._prompts, buffer=self._buffer
        )
        self._stack.callback(self._close_rollouter, self._rollouter)

    def _build_trainer(self) -> None:
        self._trainer = parts.make_trainer(
            self._config,
            self._task,
            self._learner,
            self._rollouter,
            self._buffer,
            self._bridge,
            self._tracker,
            name=self._name,
            callbacks=self._callbacks,
            restore=self._restore,
            sync=self._engine_given,
        )
        self._own(self._trainer)  # closed first: a background run stops before its parts

    def _build_stall_watch(self) -> None:
        self._stall_watch = StallWatch(
            name=self._name,
            trainer=self._trainer,
            rollouter=self._rollouter,
            buffer=self._buffer,
            engine=self._engine,
            config=lambda: self._config,
            loop_where=self._bridge.where,
        )

    def _watch_stalls(self) -> None:
        """Start the stall watch on the bridge loop, once (training calls do this)."""
        if self._stall_watch.running:
            return

        async def start() -> None:
            self._stall_watch.ensure_running(asyncio.get_running_loop())

        self._bridge.run(start())

    def stacks(self) -> Stacks:
        """Where each of this session's threads is (its event loop's, the engine's, the
        background run's, the reward threads', and the main thread, which runs a cell's
        blocking call) and each task of its event loop: their innermost frames, as
        text. For a step that hangs: ``statistics().stall`` says where it waits, this
        says on which line."""
        self._check_open()
        reward_threads = {call.thread for call in self._rollouter.reward_calls()}
        reward_threads |= {t.name for t in threading.enumerate() if t.name.startswith("rlnb-reward-")}
        return stacks(self._name, self._bridge.loop, reward_threads)

    def _build_registry(self) -> None:
        register_session(self)
        self._stack.callback(unregister_session, self)

    def _close_rollouter(self, rollouter: Rollouter) -> None:
        if not self._bridge.started:  # it never ran anything otherwise: nothing to cancel
            return
        # Half the time left at most: on a blocked loop the later parts still get theirs, and
        # the bridge's close cancels what is left and warns, naming where its loop is stuck.
        with contextlib.suppress(TimeoutError):
            self._bridge.run(rollouter.aclose(), timeout=None if (left := self._remaining()) is None else left / 2)

    def _remaining(self) -> float | None:
        return None if self._deadline is None else max(0.01, self._deadline - time.monotonic())

    def _close_part(self, part: Any) -> None:
        part.close(timeout=self._remaining())

    # -- public API ---------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def config(self) -> Config:
        """The config with the live settings in force (:meth:`set` changes them)."""
        return self._config

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def bridge(self) -> AsyncBridge:
        """The session's event-loop bridge: ``sess.bridge.run(coro)`` from any thread."""
        self._check_open()
        return self._bridge

    @property
    def buffer(self) -> ReplayBuffer:
        """The session's replay buffer."""
        self._check_open()
        return self._buffer

    @property
    def tracker(self) -> Tracker:
        """The session's :class:`~rlnb.Tracker` (``Config.track``); it finishes on close."""
        return self._tracker

    @property
    def task(self) -> Task:
        """The task this session trains on."""
        return self._task

    @property
    def callbacks(self) -> list[Callback]:
        """The :class:`~rlnb.learn.Callback` objects called at each step; add or remove freely."""
        return self._trainer.callbacks

    @property
    def exit_code(self) -> int | None:
        """The exit code the tracker's run got when the session closed (None while open)."""
        return self._exit_code if self._closed else None

    @property
    def baseline(self) -> Snapshot:
        """The process's :func:`rlnb.probe.snapshot` from before this session built anything."""
        return self._baseline

    def dashboard(self) -> Any:
        """This session's dashboard widget (one per session; :mod:`rlnb.notebook`)."""
        self._check_open()
        return make_view("dashboard", self)

    def on_close(self, fn: Callable[..., object], *args: Any) -> None:
        """Call ``fn(*args)`` once this session has closed every part (at once if it is
        closed already); a failure there is warned about, never raised."""
        if self._closed:
            fn(*args)
        else:
            self._on_close.append((fn, args))

    def _closed_callbacks(self) -> None:
        for fn, args in self._on_close:
            try:
                fn(*args)
            except Exception as exc:
                warnings.warn(f"rlnb: a close callback of session {self._name!r} failed: {exc!r}", stacklevel=1)

    def statistics(self, *, raise_errors: bool = True) -> SessionStatistics:
        """A frozen snapshot of the session's figures: training, rollouts, buffer, engine.

        Like every public call, raises a background failure not yet reported (once);
        ``raise_errors=False`` leaves it for the next call, and once closed gives the
        figures the session closed with (for gauges and a dashboard's last frame)."""
        if raise_errors:
            self._check()
        rollouter = self._rollouter
        parts = (self._buffer.statistics(), rollouter.statistics(), self._engine.statistics())
        stall = None if self._closed else self._stall_watch.stall()
        return SessionStatistics(self._name, self._closed, *parts, self._trainer.statistics(), stall)

    # -- checkpoints ------------------------------------------------------------------

    @public_call("a checkpoint already at that path was left as it was", waits_for_rollouts=True)
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Save everything needed to go on exactly where this session stands into the
        directory ``path`` (see :mod:`rlnb.checkpoint`); returns it.

        Generations in flight are finished into the buffer first, so nothing is lost
        and the buffer holds only whole groups; rollouts are then left as they were
        (running, dispatching or paused). Blocks.
        """
        self._check()
        return checkpoint.save(
            self._trainer,
            path,
            prompts=self._prompts,
            name=self._name,
            run_id=self._tracker.run_id,
            reward=self.reward_name,
        )

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        name: str = "default",
        reward: Callable[[str, Any], float] | None = None,
        model_path: str | os.PathLike[str] | None = None,
        device: str | None = None,
    ) -> Session:
        """A new session that goes on exactly where the one saved at ``path`` stopped.

        ``reward``: the function given to :meth:`set_reward` before saving (code is
        not saved; a checkpoint that had one refuses to load without it). For a Hugging
        Face model, ``model_path`` and ``device`` replace its saved directory and device
        (on another machine, say). Raises :class:`~rlnb.CheckpointError` for a missing,
        damaged or mismatched checkpoint before anything is built. Replaces a live
        session called ``name``. Restores the process's Python and torch random states too."""
        config, restore = parts.load_checkpoint(path, reward=reward, model_path=model_path, device=device)
        sess = cls(config, name=name, _restore=restore)
        if reward is not None:
            sess.set_reward(reward)
        return sess

    # -- lifecycle --------------------------------------------------------------------

    def _check(self) -> Rollouter:
        """Every public call starts here: closed sessions and background errors raise."""
        self._check_open()
        self._rollouter.raise_pending()
        self._trainer.raise_pending()
        return self._rollouter

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(
                f"session {self._name!r} is closed; make a new one with rlnb.Session(..., name={self._name!r})"
            )

    def close(self, timeout: float | None = None, *, exit_code: int = 0) -> None:
        """Close every part, newest first; idempotent and thread-safe.

        Blocks for at most about ``timeout`` seconds (``Config.close_timeout`` by
        default); a part that will not stop in time is abandoned with a warning.
        If a part fails to close, the others are still closed and the error raised.
        ``exit_code`` is what the tracker's run reports: 0 success, 1 failure,
        130 interrupted (SIGINT), 143 terminated (SIGTERM). A background failure
        not yet raised (of rollouts or of training started with :meth:`start`) makes
        it 1, and is raised once everything is closed.
        """
        # A Ctrl-C waits until every part is closed (close() is bounded by its timeout):
        # one that cut it short would leave parts open that close() again skips.
        with defer_interrupts("close()"):
            with self._lock:
                if self._closed:
                    return
                self._closed = True
            unreported = self._trainer.take_unreported()
            if exit_code == 0 and unreported is not None:
                exit_code = EXIT_FAILURE
            elif exit_code == 0 and self._trainer.training:
                exit_code = EXIT_SIGINT  # the run was cut short, as by Ctrl-C
            self._exit_code = exit_code
            self._deadline = time.monotonic() + (self._config.close_timeout if timeout is None else timeout)
            try:
                self._stack.close()
            finally:
                if unreported is not None:
                    raise unreported

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.close(exit_code=exit_code_for(exc))

    def __repr__(self) -> str:
        if self._closed:
            return f"<rlnb.Session {self._name!r} closed (tracker exit code {self._exit_code})>"
        state = "training in the background" if self._trainer.training else "idle"
        return f"<rlnb.Session {self._name!r} open: step {self.version}, {self._config.mode} mode, {state}>"

    def __getstate__(self) -> Any:
        raise TypeError("a Session owns threads, loops and files and cannot be pickled")

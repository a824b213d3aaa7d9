"""``rlnb.Session``: the composition root that owns every part of a training run,
and the cell-sized API on it.

Each part registers its close on one LIFO exit stack the moment it exists, so a
failure half-way through construction releases exactly what was acquired, and
``close()`` releases everything in reverse order even if one part fails to stop.
Every public call is a short delegation to the part that owns the work: the
:class:`~rlnb.learn.Trainer` runs the steps, ``sess.training``
(:class:`~rlnb.session.Training`) trains in the background, ``sess.rollouts``
(:class:`~rlnb.session.Rollouts`) drives the rollouter; the longer bodies are
functions of their own modules taking the parts they use (``_live``, ``_fork``,
``_batches``, ``_diagnose``, ``_export``).
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
from rlnb._errors import ClosedError, ConfigError, InvalidTypeError, StateError, public_call
from rlnb._samples import RolloutBatch
from rlnb.buffer import ReplayBuffer
from rlnb.config import Change, Config
from rlnb.data import Task, get_task
from rlnb.engines import Engine, PauseMode, SamplingParams
from rlnb.rollout import Rollouter
from rlnb.runtime import (
    AsyncBridge,
    Snapshot,
    defer_interrupts,
    register_session,
    replace_session,
    snapshot,
    unregister_session,
    warm_up_kernel_messages,
    warm_up_loop_backend,
)
from rlnb.serve import Endpoint, ServeConfig
from rlnb.session import _assembly as parts
from rlnb.session import _export, _fork, _live
from rlnb.session._batches import BatchQuestions
from rlnb.session._diagnose import Findings, diagnose_session
from rlnb.session._rollouts import Reward, Rollouts
from rlnb.session._stall import Stacks, StallWatch, stacks
from rlnb.session._statistics import SessionStatistics
from rlnb.session._training import Training
from rlnb.track import EXIT_FAILURE, EXIT_SIGINT, Tracker, exit_code_for

if TYPE_CHECKING:
    from rlnb.algorithms import Algorithm
    from rlnb.learn import Callback, KeptBatch, LearnerStatistics, WhatIf
    from rlnb.models import HFPolicy, TinyPolicy
    from rlnb.notebook import Dashboard, Explorer


class Session:
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

    The cells: :meth:`step`, :meth:`train`, :meth:`warmup` and :meth:`evaluate` in
    the foreground; :attr:`training` in the background (``sess.training.start()``,
    ``stop()``, ``wait()``); :meth:`rollout` and :meth:`complete` to look at rollouts,
    :attr:`rollouts` to generate in the background, pause and resume
    (``sess.rollouts.pause()``...); :meth:`set`, :meth:`fork`, :meth:`what_if`,
    :meth:`rescore` and :meth:`diagnose` to experiment; :meth:`save` and :meth:`load`.
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
        "endpoint",
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
        self._learner = parts.make_learner(self._config, self._model, self._tokenizer, name=self._name)
        if self._config.learn.ranks > 1:  # its ranks (Ray actors): closed after everything that drives them
            self._own(self._learner)

    def _build_engine(self) -> None:
        if self._engine is None:
            name = f"rlnb-{self._name}-engine"
            engine = parts.make_engine(self._config, self._learner, self._tokenizer, name=name, bridge=self._bridge)
            self._engine = self._own(engine)

    def _build_rollouter(self) -> None:
        # The endpoint closes after the rollouts (their agents are cancelled first, not
        # failed by a closed endpoint), and before the engine that serves it.
        self._endpoint: Endpoint | None = None
        self._stack.callback(self._close_endpoint)
        self._rollouter = parts.make_rollouter(
            self._config,
            self._task,
            self._tokenizer,
            engine=self._engine,
            prompts=self._prompts,
            buffer=self._buffer,
            agent_client=self._agent_client,
            agent_address=self._agent_address,
        )
        self._stack.callback(self._close_rollouter, self._rollouter)

    def _build_endpoint(self) -> None:
        if self._task.agent is not None:  # its episodes call the policy through it
            self._serve(None)

    def _agent_endpoint(self) -> Endpoint:
        endpoint = self._endpoint
        if endpoint is None or endpoint.closed:
            raise ClosedError(
                f"session {self._name!r}'s endpoint is closed: its agents cannot call the policy; "
                "sess.serve() starts it again"
            )
        return endpoint

    def _agent_client(self, sync: bool) -> tuple[Any, Callable[[], Any]]:
        return self._agent_endpoint().agent_client(sync=sync)

    def _agent_address(self, episode: str) -> tuple[str, str]:
        endpoint = self._agent_endpoint()
        return endpoint.episode_url(episode), endpoint.api_key

    def _close_endpoint(self) -> None:
        if self._endpoint is not None:
            self._endpoint.close(timeout=min(5.0, self._remaining() or 5.0))

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
        self._training = Training(
            trainer=self._trainer, check=self._check, check_open=self._check_open, watch_stalls=self._watch_stalls
        )
        self._rollouts = Rollouts(
            check=self._check, bridge=self._bridge, trainer=self._trainer, config=lambda: self._config
        )
        self._questions = BatchQuestions(
            name=self._name,
            trainer=self._trainer,
            task=self._task,
            tokenizer=self._tokenizer,
            model=self._model,
            seed=self._config.seed,
        )

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
        """The session's name: ``Session(name=...)`` replaces a live session of the same one."""
        return self._name

    @property
    def config(self) -> Config:
        """The config with the live settings in force (:meth:`set` changes them)."""
        return self._config

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run; calls that need its parts then raise
        :class:`~rlnb.ClosedError`."""
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

    def dashboard(self) -> Dashboard:
        """This session's dashboard widget (one per session; :mod:`rlnb.notebook`)."""
        from rlnb.notebook import dashboard  # ipywidgets: loaded when a view is asked for

        self._check_open()
        return dashboard(self)

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
        """A frozen snapshot of the session's figures: training, rollouts, buffer, engine
        and, once it has served, the endpoint.

        Like every public call, raises a background failure not yet reported (once);
        ``raise_errors=False`` leaves it for the next call, and once closed gives the
        figures the session closed with (for gauges and a dashboard's last frame)."""
        if raise_errors:
            self._check()
        rollouter = self._rollouter
        parts = (self._buffer.statistics(), rollouter.statistics(), self._engine.statistics())
        stall = None if self._closed else self._stall_watch.stall()
        endpoint = None if self._endpoint is None else self._endpoint.statistics()
        learner = self._learner.statistics() if self._config.learn.ranks > 1 else None  # type: ignore[attr-defined]
        return SessionStatistics(self._name, self._closed, *parts, self._trainer.statistics(), stall, endpoint, learner)

    # -- the parts users drive by name -----------------------------------------------------

    @property
    def training(self) -> Training:
        """Training in the background: ``sess.training.start(steps)``, ``stop()``,
        ``wait()``, and ``sess.training.running``."""
        return self._training

    @property
    def rollouts(self) -> Rollouts:
        """Rollouts in the background: ``sess.rollouts.start()``, ``stop()``,
        ``pause(mode)``, ``resume()``, ``wait_paused()``, ``set_reward(fn)``."""
        return self._rollouts

    # -- training cells -------------------------------------------------------------------

    @public_call("nothing was trained", waits_for_rollouts=True)
    def step(self, *, timeout: float | None = None) -> dict[str, float]:
        """One training step; returns its metrics. Blocks.

        ``mode="sync"``: roll out ``groups_per_step`` fresh groups with the current
        policy, update on them and sync the new weights to the engine. ``"async"``:
        take them from the buffer (background rollouts start on the first call),
        waiting at most ``timeout`` s (``Config.step_timeout``), then update and sync.
        Ctrl-C is safe at any point (see :class:`~rlnb.learn.Trainer`): before the
        update nothing changes; once it has started, the update and the weight sync
        finish first and the interrupt is raised after.
        """
        self._check()
        self._watch_stalls()
        return self._trainer.step(timeout=timeout)

    @public_call("call train() again to go on", waits_for_rollouts=True)
    def train(
        self, n_steps: int | None = None, *, until: int | None = None, progress: bool = True
    ) -> list[dict[str, float]]:
        """Run ``n_steps`` more steps, or steps until the policy version is ``until``,
        with a progress bar (terminal or notebook); returns each step's metrics.

        Ctrl-C stops once the step in progress is consistent and says so in one line
        (:class:`~rlnb.TrainingInterrupted`); ``train(until=N)`` again goes on to N.
        Every completed step is in :attr:`history`, an interrupted call's too.
        """
        self._check()
        self._watch_stalls()
        return self._trainer.train(n_steps, until=until, progress=progress)

    @public_call("call warmup() again to go on", waits_for_rollouts=True)
    def warmup(self, n_steps: int | None = None, *, progress: bool = True) -> list[dict[str, float]]:
        """Supervised warm-up: ``n_steps`` (``Config.warmup.steps`` by default) of
        teacher-forced cross-entropy on the task's answers, then the weights go to the
        engine. It is a stage of its own, before RL; the policy version stays put.

        The task's answers must be the completion text (true of the built-in tasks).
        Ctrl-C stops after the current step and the engine still gets the weights.
        """
        self._check()
        return self._trainer.warmup(n_steps, progress=progress)

    @public_call("nothing was recorded", waits_for_rollouts=True)
    def evaluate(self, n_prompts: int = 200, *, seed: int = 12345) -> float:
        """Greedy exact-match accuracy on ``n_prompts`` held-out prompts of the task. Blocks."""
        self._check()
        return self._trainer.evaluate(n_prompts, seed=seed)

    @property
    def version(self) -> int:
        """The learner's policy version: the number of steps taken."""
        return self._trainer.version

    @property
    def history(self) -> list[dict[str, float]]:
        """Every completed step's metrics, oldest first (a copy)."""
        return list(self._trainer.history)

    @property
    def evaluations(self) -> list[tuple[int, float]]:
        """Every :meth:`evaluate` so far as ``(policy version, accuracy)``, oldest first (a copy)."""
        return list(self._trainer.evaluations)

    # -- the model --------------------------------------------------------------------------

    @property
    def policy(self) -> TinyPolicy | HFPolicy:
        """The model being trained: the learner's (the engine serves a copy, synced each
        step). Look, evaluate, save; change it only through training."""
        self._check_open()
        return self._trainer.learner.policy

    @property
    def tokenizer(self) -> Any:
        """The session's tokenizer: ``encode(text)``, ``decode(ids)`` (the task's
        characters, or the Hugging Face model's own)."""
        return self._tokenizer

    @property
    def model_description(self) -> str:
        """The model, where it learns and what serves it, in words
        (:func:`rlnb.config.describe_model`); for a LoRA model with its counts, e.g.
        "LoRA r=8 on all-linear, 34,816 trainable of 367,232 parameters"."""
        from rlnb.config import describe_model
        from rlnb.models import HFPolicy

        self._check_open()
        policy = self._trainer.learner.policy
        counts = policy.parameter_counts() if isinstance(policy, HFPolicy) else None
        return describe_model(self._trainer.config, counts)

    @public_call("the directory was left as it was", waits_for_rollouts=True)
    def save_pretrained(self, directory: str | os.PathLike[str], *, adapter_only: bool = False) -> Path:
        """Write the trained model as a Hugging Face model directory: safetensors weights,
        config.json and the tokenizer, which ``AutoModelForCausalLM.from_pretrained`` and
        vLLM load, and ``rlnb.json``, the SHA-256 of each file written. For a
        ``ModelConfig.path`` model; with LoRA (``ModelConfig.lora``) the weights are
        merged, and ``adapter_only=True`` writes the PEFT adapter instead
        (adapter_config.json, adapter_model.safetensors and the tokenizer), which
        ``peft.PeftModel.from_pretrained(base_model, directory)`` loads. Use :meth:`save`
        to go on training later.

        ``directory`` (``~`` expanded, missing parents made) must be new, empty, or hold
        a model saved so and nothing else, unchanged: that is replaced whole (a kill at
        any moment leaves the old or the new one). Any other non-empty directory (a
        project folder, a model from elsewhere, the current one) is refused, so a file
        rlnb did not write is never removed; so is what a live session reads or writes
        (its base model, records file or run dir, or a directory holding one), even
        where rlnb wrote it. Returns it, absolute. Raises
        :class:`~rlnb.CheckpointError` naming the path and the cause (a full disk too),
        and :class:`~rlnb.ConfigError` for an ``adapter_only`` that is not a bool."""
        self._check()
        return _export.save_pretrained(self._trainer, self._tokenizer, directory, adapter_only=adapter_only)

    # -- looking at rollouts ----------------------------------------------------------------

    @public_call("nothing was lost: its prompts are rolled out first next time", waits_for_rollouts=True)
    def rollout(self, n_groups: int = 1, *, timeout: float | None = None) -> RolloutBatch:
        """Roll out ``n_groups`` new prompts now and return them (they do not go to the buffer).

        Blocks until they finish (or ``timeout``). Raises :class:`~rlnb.RolloutError`
        if rollouts are paused or a generation or reward failed after its retries.
        """
        collect = self._check().collect(n_groups, paused_timeout=self._config.step_timeout)
        return RolloutBatch(self._bridge.run(collect, timeout=timeout))

    def serve(self, config: ServeConfig | None = None, **fields: Any) -> Endpoint:
        """The session's OpenAI-compatible endpoint, started on first call: any agent
        or client that takes a ``base_url`` and an API key talks to the policy through
        it (``.base_url``, ``.api_key``; ``.client()`` makes an ``openai.AsyncOpenAI``).
        It serves ``/v1/chat/completions`` and ``/v1/completions`` (streamed or not,
        ``n``, tools, log-probs and token ids) with the session's engine, as the
        rollouts do: a pause holds its calls, a weight sync is waited out, and each
        reply says its policy version. ``config`` (:class:`rlnb.serve.ServeConfig`) or
        its ``fields`` say how (loopback and a random key by default); a call with
        other settings than the running endpoint's is refused. The session closes it;
        ``.close()`` stops it earlier."""
        self._check()
        if config is not None and fields:
            raise ConfigError("serve() takes a ServeConfig or its fields, not both")
        if fields:
            config = ServeConfig(**fields)
        endpoint = self._endpoint
        if endpoint is not None and not endpoint.closed:
            if config is not None and config != endpoint.config:
                raise StateError(
                    f"session {self._name!r} serves at {endpoint.base_url} with {endpoint.config}: "
                    "close it first (sess.serve().close()), then serve() with the new settings"
                )
            return endpoint
        return self._serve(config)

    def _serve(self, config: ServeConfig | None) -> Endpoint:
        served = self._rollouter.served
        assert served is not None
        self._endpoint = Endpoint(
            served,
            config or ServeConfig(),
            bridge=self._bridge,
            name=self._name,
            defaults=lambda: self._rollouter.sampling,
            decode=self._tokenizer.decode,
        )
        return self._endpoint

    @public_call("nothing was changed", waits_for_rollouts=True)
    def complete(
        self, prompts: str | list[str], *, temperature: float = 0.0, max_new_tokens: int = 16, seed: int = 0
    ) -> str | list[str]:
        """What the engine's model writes after ``prompts`` (one text or a list): greedy
        by default. Nothing is rewarded, buffered or trained. Blocks."""
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not all(isinstance(t, str) for t in texts):
            raise InvalidTypeError(f"complete(prompts={prompts!r}): pass a string or a list of strings")
        sampling = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
        out = self._bridge.run(
            self._check().complete(texts, sampling, seed=seed, paused_timeout=self._config.step_timeout)
        )
        return out[0] if isinstance(prompts, str) else out

    # -- experiments -------------------------------------------------------------------------

    @property
    def changes(self) -> list[Change]:
        """Every live setting changed in this run (:meth:`set`), oldest first: a record
        ``(step, field, old, new, time)`` each. A checkpoint keeps them, and a fork
        starts with its parent's."""
        return list(self._trainer.changes)

    @public_call("nothing was changed, or every change was made: sess.config says which")
    def set(self, **changes: Any) -> list[Change]:
        """Change live settings of this session, in the foreground or while it trains in
        the background, e.g. ``sess.set(lr=1e-3, temperature=0.7)``; returns a
        :class:`~rlnb.config.Change` for each value that differs (logged by the tracker).

        The live settings are :data:`rlnb.config.LIVE_FIELDS`: the learner's ``lr``,
        ``lr_decay_steps``, ``kl_coef``, ``clip_eps``, ``is_cap`` and ``max_grad_norm``
        (from the next update; a step under way takes a new ``lr`` unless it has stepped
        already), and rollouts' ``temperature``, ``top_p``, ``top_k``,
        ``max_new_tokens``, ``max_policy_lag``, ``groups_per_step``, ``group_size`` and
        ``reward_weights`` (for groups dispatched from now on; groups in flight keep
        theirs). Raises :class:`~rlnb.ConfigError` for another field or a value
        ``Config`` refuses, before anything changes."""
        rollouter = self._check()
        with self._settings_lock:
            config, diff = self._live_config(changes, call="set")
            if not diff:
                return []
            _live.apply(
                self._config,
                config,
                {field for field, _, _ in diff},
                trainer=self._trainer,
                rollouter=rollouter,
                bridge=self._bridge,
                task=self._task,
            )
            self._config = config
            return _live.record(config, diff, trainer=self._trainer, tracker=self._tracker)

    def _live_config(self, changes: dict[str, Any], *, call: str) -> tuple[Config, _live.Diff]:
        return _live.live_config(
            self._config,
            changes,
            trainer=self._trainer,
            task=self._task,
            tokenizer=self._tokenizer,
            reward_name=self._rollouts.reward_name,
            call=call,
        )

    @public_call("nothing was made; this session is as it was", waits_for_rollouts=True)
    def fork(self, name: str, **changes: Any) -> Session:
        """A new, independent session called ``name`` that starts where this one stands:
        weights, optimiser, scheduler, prompt stream position, random streams, buffer,
        history and change log, with the live settings ``changes`` (:meth:`set`'s)
        applied. Without changes, in sync mode, its next ``step()`` gives the same
        metrics as this one's.

        Generations in flight are finished into the buffer first (nothing is lost, as
        in :meth:`save`). The fork builds its own engine, loader and tracker from the
        config (an ``engine=`` object given to this session is not shared); with a
        run dir, its tracker writes to ``<run_dir>-<name>`` (``name`` with each
        character other than letters, digits, ``_``, ``.`` and ``-`` made ``_`` and,
        where any was, a hash of ``name`` added, so two names never share a
        directory); where that directory already holds another run's files, or is a
        live session's run dir, the first free ``<run_dir>-<name>-2``, ``-3``... is
        taken instead, and a line says so. Callbacks are not copied; a reward from
        ``sess.rollouts.set_reward()`` is. Each session trains and closes on its own.

        A fork never replaces a session: ``name`` must not be a live session's
        (unlike ``Session(name=...)``, which closes the one its cell made before).
        Raises :class:`~rlnb.ConfigError` for a bad or live name or a bad change, and
        ``RuntimeError`` while this session trains in the background
        (``sess.training.stop()`` it first), before anything is made."""
        self._check()
        _fork.check_name(name, self._name)
        config, diff = self._live_config(changes, call="fork")
        config = _fork.fork_config(config, name)
        restore = _fork.capture(
            self._trainer, prompts=self._prompts, parent=self._name, reward=self._rollouts.reward_name
        )
        history, evaluations = [dict(m) for m in self._trainer.history], list(self._trainer.evaluations)
        fork = Session(config, name=name, _restore=restore)
        try:
            fork._trainer.history[:0] = history
            fork._trainer.evaluations[:0] = evaluations  # the change log came with the checkpoint
            if (reward := self._rollouts.reward) is not None:
                fork.rollouts.set_reward(reward)
            _live.record(config, diff, trainer=fork._trainer, tracker=fork._tracker)
        except BaseException:
            fork.close()
            raise
        return fork

    @property
    def batches(self) -> list[KeptBatch]:
        """The last ``LearnConfig.keep_batches`` batches trained on, oldest first, frozen
        (:class:`~rlnb.learn.KeptBatch`): token ids, behaviour log-probs, versions,
        rewards by function, advantages, the step's metrics, and their ``origin``
        (this session, its task and vocabulary)."""
        return self._questions.kept_batches()

    @public_call("nothing was changed")
    def what_if(self, batch: KeptBatch | int | None = None, **changes: Any) -> WhatIf:
        """One learner step on a kept batch (None: the last; an int indexes
        :attr:`batches`) with the learner settings ``changes`` (any
        :class:`~rlnb.LearnConfig` field), run on twins of the **current** policy and
        optimiser: once with the settings in force and once with the changes, so the
        two differ by the change alone. Returns a :class:`~rlnb.learn.WhatIf` with
        both, beside the step's recorded metrics (loss, KL, clip fraction, grad norm,
        entropy...). The session is not changed: its weights, optimiser, version and
        random state are as they were, so its next step is the same as without the
        question. Works while it trains in the background (the twins are taken
        between two steps).

        A batch kept by another session is read where it has this session's task,
        seed and vocabulary (a fork's parent's, say); one of another task, seed or
        vocabulary is refused with :class:`~rlnb.ConfigError` naming both sessions
        (its token ids would be read as other tokens)."""
        self._check()
        return self._questions.what_if(batch, changes)

    @public_call("nothing was changed")
    def logprobs(self, groups: Any) -> list[list[list[float]]]:
        """The **current** policy's log-prob of each completion token of ``groups`` (a
        kept batch, a :meth:`rollout`'s result, or a list of groups): one list per
        group, of one list per sample, as long as its ``token_ids``. Beside a sample's
        behaviour log-probs (``Sample.logprobs``, the engine's as it sampled) they give
        the importance ratio of each token. Taken between two steps (also while
        training runs in the background); the session is not changed. Raises
        :class:`~rlnb.ConfigError` for a batch kept by a session of another task,
        seed or vocabulary, or groups holding a token id this model does not have
        (see :meth:`what_if`)."""
        self._check()
        return self._questions.logprobs(groups)

    @public_call("nothing was changed")
    def rescore(
        self,
        batch: KeptBatch | int | None = None,
        *,
        reward: Any,
        reward_weights: list[float] | None = None,
    ) -> dict[str, Any]:
        """A kept batch's rewards and GRPO advantages under another reward: ``reward``
        is a function ``(completion, answer) -> float`` or a list of them (as
        ``Task(reward=...)`` takes, with ``reward_weights``). Returns ``{"rewards":
        ..., "advantages": ..., "recorded_rewards": ..., "recorded_advantages": ...}``,
        each a list per group of a value per sample. Nothing in the session changes;
        the reward runs on this thread.

        Each sample is scored as its rollout scored it: a conversation's function gets
        its last policy turn and ``env_reward=`` the environment's reward (a batched
        function the group's samples' text, as in the rollout), so the task's own
        rewards give the recorded ones. A batch of another session is read where it
        has this session's task, seed and vocabulary (see :meth:`what_if`). Raises
        :class:`~rlnb.RolloutError` naming the function, the sample and the fix where a
        reward raises (chained) or returns something other than a finite number, and
        :class:`~rlnb.ConfigError` where a group's prompt is not the task's prompt of
        its id."""
        self._check()
        return self._questions.rescore(batch, reward, reward_weights)

    @public_call("nothing was changed")
    def diagnose(self, *, track: bool = True, raise_errors: bool = True) -> Findings:
        """Why is nothing learning? :class:`~rlnb.session.Findings` (most severe first),
        each with what was seen and what to try, from what the session has already: the
        last steps' metrics, the last kept batches, ``statistics()``, the config and the
        reward functions' timings. Nothing is rolled out or trained; it does not block.

        ``track``: log how many findings of each severity to the tracker as
        ``diagnose/critical``, ``diagnose/warning`` and ``diagnose/info`` at the
        current step. ``raise_errors``: as ``statistics()``'s (False leaves a
        background failure for the next call, and works on a closed session; a
        dashboard passes False to both)."""
        if raise_errors:
            self._check()
        return diagnose_session(
            self._trainer,
            self.statistics(raise_errors=False),
            self._config,
            self._task,
            custom_reward=self._rollouts.reward_name is not None,
            tracker=self._tracker if track else None,
        )

    @public_call("nothing was changed")
    def explore(self, batch: Any = None) -> Explorer:
        """A widget to look into a batch of rollouts (:class:`rlnb.notebook.Explorer`):
        its groups side by side, each sample's reward, advantage, finish reason,
        length and version lag, and every completion token coloured by its behaviour
        log-prob, the current policy's log-prob, their importance ratio, its policy
        version or the sample's advantage (hover a token for its numbers); sort,
        filter, and page through :attr:`batches`. Leave it last in a cell.

        ``batch``: None for the last of :attr:`batches`; an int indexes them; one of
        them (a :class:`~rlnb.learn.KeptBatch`); or groups that were not trained on,
        such as ``sess.rollout(4)``. Raises ``RuntimeError`` when ``batch`` is None and
        no step has been trained, ``IndexError`` for an index outside
        :attr:`batches`, ``TypeError`` for anything else, and
        :class:`~rlnb.ConfigError` for a batch kept by a session of another task, seed
        or vocabulary, or groups holding a token id this model does not have (see
        :meth:`what_if`). Blocks while it computes the current policy's log-probs of
        the batch (between two steps, also while training runs in the background);
        the session is not changed."""
        from rlnb.notebook import Explorer  # ipywidgets: loaded when a view is asked for

        self._check_open()
        if batch is not None and not isinstance(batch, int):
            self._questions.check_readable(batch, "explore")
        return Explorer(self, batch=batch)

    def _check_readable(self, batch: Any, call: str, argument: str = "batch") -> None:
        """Raise ConfigError unless this session can read ``batch`` (the explorer asks)."""
        self._questions.check_readable(batch, call, argument)

    def _kept(self, batch: KeptBatch | int | None, call: str) -> KeptBatch:
        """The kept batch ``batch`` names (the explorer asks)."""
        return self._questions.kept(batch, call)

    def _paths_in_use(self) -> list[tuple[Path, str]]:
        """What this session reads or writes while it lives (``rlnb._files.check_not_in_use``)."""
        return _fork.paths_in_use(self._config, self._task)

    # -- old names, for one release ---------------------------------------------------------

    def start(self, steps: int | None = None) -> None:
        """Deprecated: ``sess.training.start(steps)``."""
        _renamed("start()", "training.start()")
        self._training.start(steps)

    def stop(self, timeout: float | None = None) -> None:
        """Deprecated: ``sess.training.stop(timeout)``."""
        _renamed("stop()", "training.stop()")
        self._training.stop(timeout)

    def wait(self, timeout: float | None = None) -> None:
        """Deprecated: ``sess.training.wait(timeout)``."""
        _renamed("wait()", "training.wait()")
        self._training.wait(timeout)

    def start_rollouts(self) -> None:
        """Deprecated: ``sess.rollouts.start()``."""
        _renamed("start_rollouts()", "rollouts.start()")
        self._rollouts.start()

    def stop_rollouts(self) -> None:
        """Deprecated: ``sess.rollouts.stop()``."""
        _renamed("stop_rollouts()", "rollouts.stop()")
        self._rollouts.stop()

    def pause(self, mode: PauseMode | str = PauseMode.ABORT) -> None:
        """Deprecated: ``sess.rollouts.pause(mode)``."""
        _renamed("pause()", "rollouts.pause()")
        self._rollouts.pause(mode)

    def resume(self) -> None:
        """Deprecated: ``sess.rollouts.resume()``."""
        _renamed("resume()", "rollouts.resume()")
        self._rollouts.resume()

    def wait_paused(self, timeout: float | None = None) -> None:
        """Deprecated: ``sess.rollouts.wait_paused(timeout)``."""
        _renamed("wait_paused()", "rollouts.wait_paused()")
        self._rollouts.wait_paused(timeout)

    def set_reward(self, reward_fn: Reward) -> None:
        """Deprecated: ``sess.rollouts.set_reward(reward_fn)``."""
        _renamed("set_reward()", "rollouts.set_reward()")
        self._rollouts.set_reward(reward_fn)

    @property
    def reward_name(self) -> str | None:
        """Deprecated: ``sess.rollouts.reward_name``."""
        _renamed("reward_name", "rollouts.reward_name")
        return self._rollouts.reward_name

    @public_call("the learner's ranks were left as they were")
    def restart_learner(self) -> LearnerStatistics:
        """Start the learner's ranks (``LearnConfig.ranks`` > 1) anew, after one died:
        the old ones are closed and new ones take this process's copy of the weights
        of the last step taken (a step a rank died in was not taken), the KL
        reference, and the optimiser's moments where rank 0 gave them since that step
        (a checkpoint saved then, ``what_if``), else new moments. The version and
        everything else of the session go on. Returns the new ranks' statistics.
        Blocks until every rank has joined; not while training runs
        (:class:`~rlnb.StateError`)."""
        self._check()
        if self._config.learn.ranks == 1:
            raise StateError(
                "restart_learner() restarts a learner's ranks; this session's learner runs in its own process "
                "(LearnConfig.ranks=1): there is nothing to restart"
            )
        self._trainer.check_idle("restart_learner()")
        learner = self._learner
        learner.restart()  # type: ignore[attr-defined]
        stats: LearnerStatistics = learner.statistics()  # type: ignore[attr-defined]
        return stats

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
            reward=self._rollouts.reward_name,
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
        algorithm: str | Algorithm | None = None,
        ranks: int | None = None,
    ) -> Session:
        """A new session that goes on exactly where the one saved at ``path`` stopped.

        ``reward``: the function given to ``sess.rollouts.set_reward()`` before saving (code is
        not saved; a checkpoint that had one refuses to load without it). For a Hugging
        Face model, ``model_path`` and ``device`` replace its saved directory and device
        (on another machine, say). ``algorithm``: the one to go on with in place of the
        saved one (a preset's name or an :class:`~rlnb.algorithms.Algorithm`); needed where
        the saved one had function parts, whose code a checkpoint does not hold (it names
        them). ``ranks``: the learner's processes to go on with (``LearnConfig.ranks``;
        None: the saved number): a checkpoint holds whole weights and optimiser state,
        so a run saved on 2 ranks goes on exactly on 1, and the other way round.
        Raises :class:`~rlnb.CheckpointError` for a missing,
        damaged or mismatched checkpoint before anything is built. Replaces a live
        session called ``name``. Restores the process's Python and torch random states too."""
        config, restore = parts.load_checkpoint(
            path, reward=reward, model_path=model_path, device=device, algorithm=algorithm, ranks=ranks
        )
        sess = cls(config, name=name, _restore=restore)
        if reward is not None:
            sess.rollouts.set_reward(reward)
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
        raise InvalidTypeError("a Session owns threads, loops and files and cannot be pickled")


# What each old name became: the warning names the new one, and docs/api-changes.md lists them.
RENAMED = {
    "start()": "training.start()",
    "stop()": "training.stop()",
    "wait()": "training.wait()",
    "training (a bool)": "training.running",
    "start_rollouts()": "rollouts.start()",
    "stop_rollouts()": "rollouts.stop()",
    "pause()": "rollouts.pause()",
    "resume()": "rollouts.resume()",
    "wait_paused()": "rollouts.wait_paused()",
    "set_reward()": "rollouts.set_reward()",
    "reward_name": "rollouts.reward_name",
}


def _renamed(old: str, new: str) -> None:
    warnings.warn(
        f"Session.{old} is deprecated: use sess.{new} (the old name goes in the next release)",
        DeprecationWarning,
        stacklevel=3,  # the caller of the old name
    )

"""``rlnb.Session``: the composition root that owns every part of a training run.

Each part registers its close on one LIFO exit stack the moment it exists, so a
failure half-way through construction releases exactly what was acquired, and
``close()`` releases everything in reverse order even if one part fails to stop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rlnb._errors import CheckpointError, ClosedError, ConfigError
from rlnb.buffer import BufferStatistics, ReplayBuffer
from rlnb.config import Config
from rlnb.data import Task, get_task
from rlnb.notebook import RolloutBatch
from rlnb.rollout import EngineStatistics, PauseMode, Rollouter, RolloutStatistics, SamplingParams
from rlnb.runtime import AsyncBridge, _registry

__all__ = ["Session", "SessionStatistics"]

log = logging.getLogger("rlnb")

# The warm-up draws its prompts from a stream of its own, apart from training's.
WARMUP_SEED_OFFSET = 1_000_000


@dataclasses.dataclass(frozen=True)
class SessionStatistics:
    """A snapshot of a session and its parts."""

    name: str
    closed: bool
    buffer: BufferStatistics
    rollout: RolloutStatistics
    engine: EngineStatistics


class Session:
    """A training run you can drive one notebook cell at a time.

    ``Session(config, name=...)`` closes a live session of the same name first (so
    re-running the cell that made it is safe) and says so on stderr. Use it as a
    context manager or call :meth:`close`; ``rlnb.close_all()`` and a kernel
    restart close it too. Raises :class:`~rlnb.ConfigError` for bad input before
    anything is built or closed.
    """

    # Construction stages, in order; each ``_build_<stage>`` registers its own close.
    # The prompt loader forks its workers first, before this session starts any
    # thread (wandb's included); the tracker finishes after every later part.
    _STAGES = ("bridge", "data", "tracker", "buffer", "policy", "learner", "engine", "rollouter", "registry")

    def __init__(
        self,
        config: Config | None = None,
        *,
        name: str = "default",
        _restore: tuple[dict[str, Any], dict[str, Any], Path] | None = None,
    ) -> None:
        if config is None:
            config = Config()
        if not isinstance(config, Config):
            raise ConfigError(
                f"Session(config=...) takes a rlnb.Config, got {type(config).__name__}: build one with rlnb.Config(...)"
            )
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"Session(name={name!r}) is invalid: use a non-empty string, e.g. name='demo'")
        self._config = config
        self._name = name
        self._lock = threading.Lock()
        self._closed = False
        self._deadline: float | None = None
        self._exit_code = 0
        self._stack = contextlib.ExitStack()
        self._bridge: AsyncBridge | None = None
        self._buffer: ReplayBuffer | None = None
        self._task: Task = get_task(config.task)
        self._engine: Any = None
        self._rollouter: Rollouter | None = None
        self._restore = _restore  # a checkpoint's (manifest, tensors), while loading
        self._replace_previous()
        try:
            for stage in self._STAGES:
                getattr(self, f"_build_{stage}")()
            if _restore is not None:
                self._apply_checkpoint(*_restore)
        except BaseException:
            self._closed = True
            self._stack.close()
            raise

    # -- construction stages ----------------------------------------------------

    def _build_bridge(self) -> None:
        bridge = AsyncBridge(name=f"rlnb-{self._name}")
        self._stack.callback(self._close_part, bridge)
        self._bridge = bridge

    def _build_tracker(self) -> None:
        from rlnb import checkpoint
        from rlnb.track import Tracker

        t = self._config.track
        run_id = t.run_id if self._restore is None else self._restore[0]["tracker"]["run_id"]
        tracker = Tracker(
            t.backends,
            run_dir=t.run_dir,
            run_id=run_id,
            name=self._name,
            config=checkpoint.config_to_dict(self._config),
            wandb_mode=t.wandb_mode,
            wandb_project=t.wandb_project,
            console_every=t.console_every,
        )
        # closed last but one (the stack is LIFO): the run records everything before it
        self._stack.callback(self._finish_tracker, tracker)
        self._tracker = tracker

    def _finish_tracker(self, tracker: Any) -> None:
        tracker.finish(self._exit_code)

    def _build_buffer(self) -> None:
        cfg = self._config.buffer
        buffer = ReplayBuffer(cfg.capacity, partitions=cfg.partitions, max_staleness=cfg.max_staleness)
        self._stack.callback(self._close_part, buffer)
        self._buffer = buffer

    def _build_data(self) -> None:
        from rlnb.data._loader import PromptLoader

        d = self._config.data
        loader = PromptLoader(
            self._task,
            seed=self._config.seed,
            num_workers=d.num_workers,
            prefetch_factor=d.prefetch_factor,
            multiprocessing_context=d.multiprocessing_context,
            state=None if self._restore is None else self._restore[0]["loader"],
        )
        self._stack.callback(self._close_part, loader)
        self._prompts = loader

    def _build_policy(self) -> None:
        # torch is imported here, not at `import rlnb`
        from rlnb.models import CharTokenizer, PolicyConfig, TinyPolicy

        m = self._config.model
        self._tokenizer = CharTokenizer(self._task.alphabet)
        policy_config = PolicyConfig(
            vocab_size=self._tokenizer.vocab_size,
            d_model=m.d_model,
            n_layers=m.n_layers,
            n_heads=m.n_heads,
            max_len=m.max_len,
            seed=self._config.seed,
        )
        self._policy = TinyPolicy(policy_config)

    def _build_learner(self) -> None:
        from rlnb.learn import Learner

        tokenizer = self._tokenizer
        self._learner = Learner(
            self._policy,
            encode=lambda text: tokenizer.encode(text, bos=True),
            pad_id=tokenizer.PAD,
            eos_id=tokenizer.EOS,
            config=self._config.learn,
        )
        self._warmup_steps = 0
        self._warmup_prompts = self._warmup_stream()
        self._warmup_optimizer: Any = None

    def _warmup_stream(self) -> Iterator[Any]:
        """The warm-up's own prompt stream, from where ``_warmup_steps`` steps left it."""
        start = self._warmup_steps * self._config.warmup.batch_size
        return self._task.prompts(self._config.seed + WARMUP_SEED_OFFSET, start=start)

    def _build_engine(self) -> None:
        from rlnb.rollout._tiny import TinyEngine

        engine = TinyEngine(
            self._policy,
            eos_id=self._tokenizer.EOS,
            max_batch=self._config.engine.max_batch,
            threads=self._config.engine.threads,
            name=f"rlnb-{self._name}-engine",
        )
        self._stack.callback(self._close_part, engine)
        self._engine = engine

    def _build_rollouter(self) -> None:
        r = self._config.rollout
        assert self._buffer is not None and self._bridge is not None
        task, tokenizer = self._task, self._tokenizer
        rollouter = Rollouter(
            self._engine,
            prompts=self._prompts,
            encode=lambda text: tokenizer.encode(text, bos=True),
            decode=tokenizer.decode,
            reward_fn=lambda item, completion: task.reward(completion, item.answer),
            buffer=self._buffer,
            group_size=r.group_size,
            max_inflight=r.max_inflight,
            max_staleness=r.max_staleness,
            groups_per_step=r.groups_per_step,
            sampling=SamplingParams(
                temperature=r.temperature,
                top_p=r.top_p,
                top_k=r.top_k,
                max_new_tokens=r.max_new_tokens or task.max_new_tokens,
            ),
            max_continuations=r.max_continuations,
            max_retries=r.max_retries,
            seed=self._config.seed,
        )
        self._stack.callback(self._close_rollouter, rollouter)
        self._rollouter = rollouter

    def _close_rollouter(self, rollouter: Rollouter) -> None:
        assert self._bridge is not None
        if self._bridge.started:  # it never ran anything otherwise: nothing to cancel
            self._bridge.run(rollouter.aclose(), timeout=self._remaining())

    def _build_registry(self) -> None:
        _registry.register(self)
        self._stack.callback(_registry.unregister, self)

    def _replace_previous(self) -> None:
        previous = _registry.lookup(self._name)
        if previous is None or previous is self:
            return
        previous.close()
        print(
            f"rlnb: closed the earlier session {self._name!r} before making its replacement",
            file=sys.stderr,
        )

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
        return self._config

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def bridge(self) -> AsyncBridge:
        """The session's event-loop bridge: ``sess.bridge.run(coro)`` from any thread."""
        self._check_open()
        assert self._bridge is not None
        return self._bridge

    @property
    def buffer(self) -> ReplayBuffer:
        """The session's replay buffer."""
        self._check_open()
        assert self._buffer is not None
        return self._buffer

    @property
    def tracker(self) -> Any:
        """The session's :class:`~rlnb.Tracker` (``Config.track``); it finishes on close."""
        return self._tracker

    @property
    def task(self) -> Task:
        """The task this session trains on."""
        return self._task

    def statistics(self) -> SessionStatistics:
        """A frozen snapshot of the session's figures: buffer, rollouter and engine.

        Like every public call, raises a background failure not yet reported (once)."""
        self._check()
        assert self._buffer is not None and self._rollouter is not None
        return SessionStatistics(
            name=self._name,
            closed=self._closed,
            buffer=self._buffer.statistics(),
            rollout=self._rollouter.statistics(),
            engine=self._engine.statistics(),
        )

    # -- rollouts ---------------------------------------------------------------------

    def rollout(self, n_groups: int = 1, *, timeout: float | None = None) -> RolloutBatch:
        """Roll out ``n_groups`` new prompts now and return them (they do not go to the buffer).

        Blocks until they finish (or ``timeout``). Raises :class:`~rlnb.RolloutError`
        if rollouts are paused or a generation or reward failed after its retries.
        """
        rollouter = self._check()
        if not isinstance(n_groups, int) or n_groups < 1:
            raise ValueError(f"rollout(n_groups={n_groups!r}): use a positive int")
        return RolloutBatch(self.bridge.run(rollouter.collect(n_groups), timeout=timeout))

    def start_rollouts(self) -> None:
        """Generate in the background into the buffer, within the staleness bound. Idempotent."""
        self.bridge.run(self._check().start())

    def stop_rollouts(self) -> None:
        """Stop dispatching new prompts; those in flight still finish into the buffer."""
        self.bridge.run(self._check().stop())

    def pause(self, mode: PauseMode | str = PauseMode.ABORT) -> None:
        """Pause generation. ``"abort"`` (default) keeps every in-flight sample as a
        partial rollout and continues it after :meth:`resume`; ``"keep"`` freezes the
        engine in place; ``"wait"`` lets in-flight samples finish (:meth:`wait_paused`
        waits for that). Blocks until paused, except in ``"wait"`` mode."""
        try:
            mode = PauseMode(mode)
        except ValueError:
            raise ValueError(f"pause(mode={mode!r}): use one of 'abort', 'keep', 'wait'") from None
        self.bridge.run(self._check().pause(mode))

    def resume(self) -> None:
        """Leave a pause: partial rollouts continue with their prefixes and dispatch goes on."""
        self.bridge.run(self._check().resume())

    def wait_paused(self, timeout: float | None = None) -> None:
        """Block until a pause has taken effect; :class:`TimeoutError` after ``timeout`` s."""
        self.bridge.run(self._check().wait_paused(), timeout=timeout)

    def set_reward(self, reward_fn: Callable[[str, Any], float]) -> None:
        """Use ``reward_fn(completion, answer) -> float`` from the next rollout on.

        Completions already scored keep their rewards. Raises ``TypeError`` if it is
        not callable.
        """
        if not callable(reward_fn):
            raise TypeError(
                f"set_reward() takes a callable (completion, answer) -> float, got {type(reward_fn).__name__}"
            )
        self.bridge.run(self._check().set_reward_fn(lambda item, completion: reward_fn(completion, item.answer)))

    # -- learning ---------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The learner's policy version: the number of steps taken."""
        return int(self._learner.version)

    def step(self, *, timeout: float | None = None) -> dict[str, float]:
        """One training step; returns its metrics. Blocks.

        ``mode="sync"``: roll out ``groups_per_step`` fresh groups with the current
        policy, update on them and sync the new weights to the engine. ``"async"``:
        take ``groups_per_step`` groups from the buffer (background rollouts start
        on the first call and run within the staleness bound), waiting at most
        ``timeout`` s (``Config.step_timeout``), then update and sync.

        Ctrl-C is safe at any point: before the update starts nothing changes (an
        interrupted rollout's prompts go first next time, and a batch already
        taken goes back to the buffer); once it has started, the update and the
        weight sync finish first and the interrupt is raised after.
        """
        from rlnb.runtime._interrupts import defer_interrupts

        rollouter = self._check()
        before = self._learner.version
        if self._config.mode == "sync":
            groups: list[Any] = []
            try:
                self.bridge.run(rollouter.collect(self._config.rollout.groups_per_step, into=groups), timeout=timeout)
                with defer_interrupts():
                    return self._update(rollouter, groups)
            except BaseException:
                # The rollout finished but was not trained on (Ctrl-C landed just as it
                # returned, or the update failed): its prompts go first next time.
                if groups and self._learner.version == before:
                    self.bridge.run(rollouter.give_back_collected())
                raise
        self.bridge.run(rollouter.start())
        with defer_interrupts() as deferred:
            groups = self._take_batch(rollouter, deferred, self._config.step_timeout if timeout is None else timeout)
            try:
                return self._update(rollouter, groups)
            except Exception:
                if self._learner.version == before:  # not trained: not lost either
                    self.buffer.put_back(groups)
                raise

    def _take_batch(self, rollouter: Rollouter, deferred: Any, timeout: float) -> list[Any]:
        """The async step's batch, waited for with SIGINT held back: a Ctrl-C while
        waiting raises at once with nothing taken; once taken, the step completes."""
        n = self._config.rollout.groups_per_step
        deadline = time.monotonic() + timeout
        while True:
            if deferred.interrupted:
                raise KeyboardInterrupt("interrupted while waiting for a batch; nothing was taken")
            rollouter.raise_pending()
            remaining = deadline - time.monotonic()
            try:
                return self.buffer.get(n, timeout=max(0.0, min(0.05, remaining)))
            except TimeoutError as exc:
                if remaining <= 0.05:
                    stats = rollouter.statistics()
                    raise TimeoutError(
                        f"step() waited {timeout} s for {n} groups from the buffer; it holds {len(self.buffer)}, "
                        f"{stats.in_flight} samples are in flight and rollouts are {stats.state.lower()}"
                        f"{'' if stats.dispatching else ' (not dispatching)'}: resume() paused rollouts, or raise "
                        "Config.step_timeout"
                    ) from exc

    def _update(self, rollouter: Rollouter, groups: list[Any]) -> dict[str, float]:
        """Update on ``groups``, then the weight-sync transaction (callers defer SIGINT)."""
        metrics = self._learner.step(groups)
        version = self._learner.version
        self.bridge.run(rollouter.sync_weights(self._learner.export_weights(), version))
        self.bridge.run(rollouter.set_version(version))
        self.buffer.set_version(version)
        self._tracker.log(metrics, step=version)
        return metrics

    def train(self, n_steps: int, *, progress: bool = True) -> list[dict[str, float]]:
        """Run ``n_steps`` of :meth:`step` with a progress bar (terminal or notebook).

        Ctrl-C stops after the current step is consistent; call ``train()`` again to
        go on. Returns each step's metrics.
        """
        if not isinstance(n_steps, int) or n_steps < 1:
            raise ValueError(f"train(n_steps={n_steps!r}): use a positive int")
        history: list[dict[str, float]] = []
        with _progress_bar(n_steps, f"rlnb {self._name}", progress) as bar:
            for _ in range(n_steps):
                metrics = self.step()
                history.append(metrics)
                bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", acc=f"{metrics['accuracy']:.2f}")
                bar.update(1)
        return history

    def warmup(self, n_steps: int | None = None, *, progress: bool = True) -> list[dict[str, float]]:
        """Supervised warm-up: ``n_steps`` (``Config.warmup.steps`` by default) of
        teacher-forced cross-entropy on the task's answers, then the weights go to the
        engine. It is a stage of its own, before RL; the policy version stays put.

        The task's answers must be the completion text (true of the built-in tasks).
        Ctrl-C stops after the current step and the engine still gets the weights.
        """
        import torch

        from rlnb.runtime._interrupts import defer_interrupts

        cfg = self._config.warmup
        n_steps = cfg.steps if n_steps is None else n_steps
        if not isinstance(n_steps, int) or n_steps < 0:
            raise ValueError(f"warmup(n_steps={n_steps!r}): use an int >= 0")
        rollouter = self._check()
        if self._warmup_optimizer is None:
            self._warmup_optimizer = torch.optim.AdamW(self._learner.policy.parameters(), lr=cfg.lr)
        history: list[dict[str, float]] = []
        try:
            with _progress_bar(n_steps, f"rlnb {self._name} warm-up", progress) as bar:
                for _ in range(n_steps):
                    items = [next(self._warmup_prompts) for _ in range(cfg.batch_size)]
                    with defer_interrupts():
                        metrics = self._learner.supervised_step(
                            [(item.prompt, str(item.answer)) for item in items], self._warmup_optimizer
                        )
                        self._warmup_steps += 1
                    history.append(metrics)
                    bar.set_postfix(loss=f"{metrics['sft_loss']:.3f}")
                    bar.update(1)
        finally:
            if history:
                with defer_interrupts():
                    version = self._learner.version
                    self.bridge.run(rollouter.sync_weights(self._learner.export_weights(), version))
                    self._tracker.log(
                        {"warmup/steps": float(self._warmup_steps), "warmup/sft_loss": history[-1]["sft_loss"]},
                        step=version,
                    )
        return history

    def evaluate(self, n_prompts: int = 200, *, seed: int = 12345) -> float:
        """Greedy exact-match accuracy on ``n_prompts`` held-out prompts of the task. Blocks."""
        rollouter = self._check()
        items = self._task.eval_set(n_prompts, seed=seed)
        max_new = self._config.rollout.max_new_tokens or self._task.max_new_tokens
        results = self.bridge.run(rollouter.evaluate(items, max_new_tokens=max_new))
        accuracy = sum(reward >= 1.0 for _, reward in results) / len(results)
        self._tracker.log({"eval_accuracy": accuracy}, step=self._learner.version)
        return accuracy

    # -- checkpoints ------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Save everything needed to go on exactly where this session stands into the
        directory ``path`` (see :mod:`rlnb.checkpoint`); returns it.

        Generations in flight are finished into the buffer first, so nothing is lost
        and the buffer holds only whole groups; rollouts are then left as they were
        (running, dispatching or paused). Blocks.
        """
        import torch

        from rlnb import __version__, checkpoint

        rollouter = self._check()
        with self._quiesced(rollouter):
            loader_state = self.bridge.run(_call(self._prompts.state_dict))
            returned = [[i.prompt_id, i.prompt, i.answer] for i in rollouter.returned_prompts]
            manifest: dict[str, Any] = {
                "rlnb": __version__,
                "name": self._name,
                "config": checkpoint.config_to_dict(self._config),
                "step": self._learner.version,
                "warmup_steps": self._warmup_steps,
                "loader": loader_state,
                "returned_prompts": returned,
                "buffer": self.buffer.state_dict(),
                "python_rng": checkpoint.python_rng_state(),
                "tracker": {"run_id": self._tracker.run_id},
            }
            tensors: dict[str, dict[str, Any]] = {
                "model": self._learner.policy.state_dict(),
                "rng": {"torch": torch.get_rng_state()},
            }
            tensors["optimizer"], manifest["optimizer"] = checkpoint.flatten_optimizer(
                self._learner.optimizer.state_dict()
            )
            if self._warmup_optimizer is not None:
                tensors["warmup_optimizer"], manifest["warmup_optimizer"] = checkpoint.flatten_optimizer(
                    self._warmup_optimizer.state_dict()
                )
            if self._learner.reference is not None:
                tensors["reference"] = self._learner.reference.state_dict()
            try:
                json.dumps(manifest)
            except TypeError as exc:
                raise CheckpointError(
                    f"cannot save: a prompt's answer or a sample is not JSON-serialisable ({exc}); "
                    "make the task's answers JSON data (str, int, list, dict)"
                ) from exc
            return checkpoint.write(path, manifest, tensors)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, name: str = "default") -> Session:
        """A new session that goes on exactly where the one saved at ``path`` stopped.

        Raises :class:`~rlnb.CheckpointError` for a missing, damaged or mismatched
        checkpoint before anything is built. Replaces a live session called ``name``.
        Restores the process's Python and torch random states too.
        """
        from rlnb import checkpoint

        manifest, tensors = checkpoint.read(path)
        try:
            config = checkpoint.config_from_dict(manifest["config"])
        except (ConfigError, TypeError, KeyError) as exc:
            raise CheckpointError(f"{path}: the saved config does not fit this rlnb ({exc})") from exc
        return cls(config, name=name, _restore=(manifest, tensors, Path(path)))

    def _apply_checkpoint(self, manifest: dict[str, Any], tensors: dict[str, Any], root: Path) -> None:
        import torch

        from rlnb import checkpoint
        from rlnb._samples import PromptItem

        learner, rollouter = self._learner, self._check()
        with checkpoint.mismatch("model", root):
            learner.policy.load_state_dict(tensors["model"])
        with checkpoint.mismatch("optimizer", root):
            learner.optimizer.load_state_dict(
                checkpoint.unflatten_optimizer(tensors["optimizer"], manifest["optimizer"])
            )
        if "warmup_optimizer" in tensors:
            self._warmup_optimizer = torch.optim.AdamW(learner.policy.parameters(), lr=self._config.warmup.lr)
            with checkpoint.mismatch("warm-up optimizer", root):
                self._warmup_optimizer.load_state_dict(
                    checkpoint.unflatten_optimizer(tensors["warmup_optimizer"], manifest["warmup_optimizer"])
                )
        if learner.reference is not None:
            with checkpoint.mismatch("reference model", root):
                learner.reference.load_state_dict(tensors["reference"])
        with checkpoint.mismatch("buffer", root):
            self.buffer.load_state_dict(manifest["buffer"])
        learner.version = int(manifest["step"])
        self._warmup_steps = int(manifest["warmup_steps"])
        self._warmup_prompts = self._warmup_stream()
        rollouter.give_back([PromptItem(*item) for item in manifest["returned_prompts"]])
        self.bridge.run(rollouter.sync_weights(learner.export_weights(), learner.version))
        self.bridge.run(rollouter.set_version(learner.version))
        torch.set_rng_state(tensors["rng"]["torch"])
        checkpoint.set_python_rng_state(manifest["python_rng"])
        self._restore = None

    @contextlib.contextmanager
    def _quiesced(self, rollouter: Rollouter) -> Iterator[None]:
        """Nothing generating inside: dispatch stopped and in-flight groups finished
        into the buffer; afterwards rollouts are as they were."""
        was_dispatching, was_state = rollouter.dispatching, rollouter.state
        self.bridge.run(rollouter.stop())
        self.bridge.run(rollouter.resume())  # kept partial rollouts finish too
        self.bridge.run(rollouter.pause(PauseMode.WAIT))
        self.bridge.run(rollouter.wait_paused(), timeout=self._config.step_timeout)
        try:
            yield
        finally:
            if was_state.value == "running":
                self.bridge.run(rollouter.resume())
            if was_dispatching:
                self.bridge.run(rollouter.start())

    def _check(self) -> Rollouter:
        """Every public call starts here: closed sessions and background errors raise."""
        self._check_open()
        assert self._rollouter is not None
        self._rollouter.raise_pending()
        return self._rollouter

    def close(self, timeout: float | None = None, *, exit_code: int = 0) -> None:
        """Close every part, newest first; idempotent and thread-safe.

        Blocks for at most about ``timeout`` seconds (``Config.close_timeout`` by
        default); a part that will not stop in time is abandoned with a warning.
        If a part fails to close, the others are still closed and the error raised.
        ``exit_code`` is what the tracker's run reports: 0 success, 1 failure,
        130 interrupted (SIGINT), 143 terminated (SIGTERM).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._exit_code = exit_code
        if timeout is None:
            timeout = self._config.close_timeout
        self._deadline = time.monotonic() + timeout
        self._stack.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        from rlnb.track import exit_code_for

        self.close(exit_code=exit_code_for(exc))

    def __repr__(self) -> str:
        return f"<rlnb.Session {self._name!r} {'closed' if self._closed else 'open'}>"

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(
                f"session {self._name!r} is closed; make a new one with rlnb.Session(..., name={self._name!r})"
            )

    def __getstate__(self) -> Any:
        raise TypeError("a Session owns threads, loops and files and cannot be pickled")


async def _call(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on the bridge loop (for objects only that loop's thread touches)."""
    return fn()


def _progress_bar(total: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar that renders in a notebook or a terminal and starts no monitor thread."""
    from tqdm.auto import tqdm

    class Bar(tqdm):
        monitor_interval = 0  # tqdm's monitor thread would outlive the session

    return Bar(total=total, desc=desc, disable=not enabled, leave=True)

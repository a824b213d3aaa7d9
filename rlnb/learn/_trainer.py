"""The ``Trainer``: the step loop, and the transaction around update and weight sync.

It drives parts it is given (a learner, a rollouter, a buffer, the bridge their
coroutines run on and a tracker) and owns none of them: the session builds and
closes them. It is the one place where training happens, from a cell (``step``,
``train``, ``warmup``, ``evaluate``) or, later, from a background thread.

A step has two phases. Before the update, nothing has changed: an exception or a
Ctrl-C there keeps the batch (in sync mode its prompts go first next time, rolled
out again with the same seeds; in async mode it goes back to the buffer). From the
update on, the optimizer step and the weight sync are all-or-nothing with respect
to Ctrl-C: the interrupt is held back and raised once both are done.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

from rlnb._samples import Group
from rlnb.buffer import ReplayBuffer
from rlnb.config import Config
from rlnb.data import Task
from rlnb.learn._learner import Learner
from rlnb.learn._progress import progress_bar
from rlnb.rollout import PauseMode, Rollouter
from rlnb.runtime import AsyncBridge, Deferred, defer_interrupts

__all__ = ["Callback", "Trainer"]

# The warm-up draws its prompts from a stream of its own, apart from training's.
WARMUP_SEED_OFFSET = 1_000_000


class _Tracker(Protocol):
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...


class Callback:
    """Hooks into every training step; override the ones you need (each does nothing).

    They run on the thread that runs the step, inside its phases (see
    :class:`Trainer`): ``on_batch`` before the update, ``on_step_end`` inside the
    all-or-nothing part, after the update and the weight sync. An exception raised
    in ``on_batch`` ends the step with nothing trained and the batch kept; one
    raised in ``on_step_end`` reaches the caller after the step is complete.
    """

    def on_batch(self, groups: Sequence[Group]) -> None:
        """The step has its batch (rolled out, or taken from the buffer) and has not updated."""

    def on_step_end(self, metrics: Mapping[str, float]) -> None:
        """The step is complete: updated, synced to the engine and logged."""


class Trainer:
    """Runs training steps on the parts it is given; see the module docstring.

    ``config`` supplies the mode, the batch size (``rollout.groups_per_step``), the
    async step timeout and the warm-up settings; ``task`` the warm-up and held-out
    prompts. ``callbacks`` is a list you may change between calls. Not thread-safe:
    one caller at a time.
    """

    def __init__(
        self,
        *,
        learner: Learner,
        rollouter: Rollouter,
        buffer: ReplayBuffer,
        bridge: AsyncBridge,
        tracker: _Tracker,
        task: Task,
        config: Config,
        name: str = "rlnb",
        callbacks: Sequence[Callback] = (),
    ) -> None:
        self.learner = learner
        self.rollouter = rollouter
        self.buffer = buffer
        self.bridge = bridge
        self.tracker = tracker
        self.task = task
        self.config = config
        self.name = name
        self.callbacks: list[Callback] = list(callbacks)
        self._warmup_opt: Any = None  # made by the first warm-up step
        self._warmup_steps = 0
        self._warmup_prompts = self._warmup_stream()

    @property
    def version(self) -> int:
        """The learner's policy version: the number of RL steps taken."""
        return int(self.learner.version)

    # -- one step -----------------------------------------------------------------------

    def step(self, *, timeout: float | None = None) -> dict[str, float]:
        """One training step in the config's mode; returns its metrics. Blocks.

        ``timeout`` bounds the sync rollout, or the async wait for a batch
        (``Config.step_timeout`` when None)."""
        if self.config.mode == "sync":
            return self._sync_step(timeout)
        return self._async_step(self.config.step_timeout if timeout is None else timeout)

    def _sync_step(self, timeout: float | None) -> dict[str, float]:
        rollouter, before = self.rollouter, self.learner.version
        groups: list[Group] = []
        try:
            self.bridge.run(rollouter.collect(self.config.rollout.groups_per_step, into=groups), timeout=timeout)
            self._call("on_batch", groups)
            with defer_interrupts():
                return self._update(groups)
        except BaseException:
            # The rollout finished but was not trained on (Ctrl-C landed just as it
            # returned, or the update failed): its prompts go first next time.
            if groups and self.learner.version == before:
                self.bridge.run(rollouter.give_back_collected())
            raise

    def _async_step(self, timeout: float) -> dict[str, float]:
        before = self.learner.version
        self.bridge.run(self.rollouter.start())
        with defer_interrupts() as deferred:
            groups = self._take_batch(deferred, timeout)
            try:
                self._call("on_batch", groups)
                return self._update(groups)
            except Exception:
                if self.learner.version == before:  # not trained: not lost either
                    self.buffer.put_back(groups)
                raise

    def _take_batch(self, deferred: Deferred, timeout: float) -> list[Group]:
        """The async step's batch, waited for with SIGINT held back: a Ctrl-C while
        waiting raises at once with nothing taken; once taken, the step completes."""
        n, rollouter = self.config.rollout.groups_per_step, self.rollouter
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

    def _update(self, groups: list[Group]) -> dict[str, float]:
        """Update on ``groups``, then the weight-sync transaction (callers defer SIGINT)."""
        metrics = self.learner.step(groups)
        self.sync_weights()
        self.buffer.set_version(self.learner.version)
        self.tracker.log(metrics, step=self.learner.version)
        self._call("on_step_end", metrics)
        return metrics

    def sync_weights(self) -> None:
        """Send the learner's weights and version to the engine, through the rollouter's
        all-or-nothing weight-sync transaction."""
        version = self.learner.version
        self.bridge.run(self.rollouter.sync_weights(self.learner.export_weights(), version))
        self.bridge.run(self.rollouter.set_version(version))

    def _call(self, hook: str, arg: Any) -> None:
        for callback in list(self.callbacks):
            getattr(callback, hook)(arg)

    # -- loops and stages -------------------------------------------------------------------

    def train(self, n_steps: int, *, progress: bool = True) -> list[dict[str, float]]:
        """``n_steps`` of :meth:`step` with a progress bar; returns each step's metrics."""
        if not isinstance(n_steps, int) or isinstance(n_steps, bool) or n_steps < 1:
            raise ValueError(f"train(n_steps={n_steps!r}): use a positive int")
        history: list[dict[str, float]] = []
        with progress_bar(n_steps, f"rlnb {self.name}", progress) as bar:
            for _ in range(n_steps):
                metrics = self.step()
                history.append(metrics)
                bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", acc=f"{metrics['accuracy']:.2f}")
                bar.update(1)
        return history

    @property
    def warmup_steps(self) -> int:
        """Supervised warm-up steps taken so far."""
        return self._warmup_steps

    def restore_warmup(self, steps: int, optimizer_state: dict[str, Any] | None) -> None:
        """Go on from a checkpoint's warm-up: its step count and its optimiser's state."""
        self._warmup_steps = steps
        self._warmup_prompts = self._warmup_stream()
        if optimizer_state is not None:
            self._warmup_optimizer().load_state_dict(optimizer_state)

    def _warmup_stream(self) -> Iterator[Any]:
        """The warm-up's own prompt stream, from where ``warmup_steps`` steps left it."""
        start = self._warmup_steps * self.config.warmup.batch_size
        return self.task.prompts(self.config.seed + WARMUP_SEED_OFFSET, start=start)

    @property
    def warmup_optimizer(self) -> Any:
        """The warm-up's own AdamW, or None before the first warm-up."""
        return self._warmup_opt

    def _warmup_optimizer(self) -> Any:
        import torch

        if self._warmup_opt is None:
            self._warmup_opt = torch.optim.AdamW(self.learner.policy.parameters(), lr=self.config.warmup.lr)
        return self._warmup_opt

    def warmup(self, n_steps: int | None = None, *, progress: bool = True) -> list[dict[str, float]]:
        """Supervised warm-up (see ``Session.warmup``); the weights go to the engine after."""
        cfg = self.config.warmup
        n_steps = cfg.steps if n_steps is None else n_steps
        if not isinstance(n_steps, int) or isinstance(n_steps, bool) or n_steps < 0:
            raise ValueError(f"warmup(n_steps={n_steps!r}): use an int >= 0")
        optimizer = self._warmup_optimizer()
        history: list[dict[str, float]] = []
        try:
            with progress_bar(n_steps, f"rlnb {self.name} warm-up", progress) as bar:
                for _ in range(n_steps):
                    items = [next(self._warmup_prompts) for _ in range(cfg.batch_size)]
                    with defer_interrupts():
                        metrics = self.learner.supervised_step(
                            [(item.prompt, str(item.answer)) for item in items], optimizer
                        )
                        self._warmup_steps += 1
                    history.append(metrics)
                    bar.set_postfix(loss=f"{metrics['sft_loss']:.3f}")
                    bar.update(1)
        finally:
            if history:
                with defer_interrupts():
                    self.sync_weights()
                    self.tracker.log(
                        {"warmup/steps": float(self._warmup_steps), "warmup/sft_loss": history[-1]["sft_loss"]},
                        step=self.learner.version,
                    )
        return history

    def evaluate(self, n_prompts: int = 200, *, seed: int = 12345) -> float:
        """Greedy exact-match accuracy on ``n_prompts`` held-out prompts of the task. Blocks."""
        items = self.task.eval_set(n_prompts, seed=seed)
        max_new = self.config.rollout.max_new_tokens or self.task.max_new_tokens
        results = self.bridge.run(self.rollouter.evaluate(items, max_new_tokens=max_new))
        accuracy = sum(reward >= 1.0 for _, reward in results) / len(results)
        self.tracker.log({"eval_accuracy": accuracy}, step=self.learner.version)
        return accuracy

    @contextlib.contextmanager
    def quiesced(self) -> Iterator[None]:
        """Nothing generating inside: dispatch stopped and in-flight groups finished
        into the buffer (kept partial rollouts too); afterwards rollouts are as they were."""
        rollouter, run = self.rollouter, self.bridge.run
        was_dispatching, was_state = rollouter.dispatching, rollouter.state
        run(rollouter.stop())
        run(rollouter.resume())  # kept partial rollouts finish too
        run(rollouter.pause(PauseMode.WAIT))
        run(rollouter.wait_paused(), timeout=self.config.step_timeout)
        try:
            yield
        finally:
            if was_state.value == "running":
                run(rollouter.resume())
            if was_dispatching:
                run(rollouter.start())

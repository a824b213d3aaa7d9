"""``Warmup``: the supervised stage before RL, with its own optimiser and prompts.

Teacher-forced cross-entropy on demonstrations: the answers of the session's task,
or of ``config.warmup.task`` (another teacher) when set. Answers must be the
completion text, as in the built-in tasks. It has an AdamW of its own, so the RL optimiser's
moments start clean, and a prompt stream of its own, apart from training's. The
policy version stays put.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from rlnb._errors import InvalidValueError
from rlnb.config import Config
from rlnb.data import Task, get_task
from rlnb.envs import Demonstration
from rlnb.learn._learner import Learner
from rlnb.learn._progress import progress_bar
from rlnb.runtime import defer_interrupts

__all__ = ["Warmup"]


def _target(answer: Any) -> str | Demonstration:
    """What the warm-up imitates for a prompt: its answer's text, or a demonstrated conversation."""
    return answer if isinstance(answer, Demonstration) else str(answer)


# The warm-up draws its prompts from a stream of its own, apart from training's.
WARMUP_SEED_OFFSET = 1_000_000


class Warmup:
    """The warm-up stage of ``learner`` on ``task``'s answers, or those of
    ``config.warmup.task`` when set (``config.warmup``)."""

    def __init__(self, learner: Learner, task: Task, config: Config) -> None:
        if config.warmup.task is not None:
            task = get_task(config.warmup.task)
        self._learner, self._task, self._config = learner, task, config
        self._optimizer: Any = None  # made by the first step
        self.steps = 0
        self._prompts = self._stream()

    @property
    def optimizer(self) -> Any:
        """The warm-up's own AdamW, or None before the first warm-up step."""
        return self._optimizer

    def restore(self, steps: int, optimizer_state: dict[str, Any] | None) -> None:
        """Go on from a checkpoint's warm-up: its step count and its optimiser's state."""
        self.steps = steps
        self._prompts = self._stream()
        if optimizer_state is not None:
            self._make_optimizer().load_state_dict(optimizer_state)

    def _stream(self) -> Iterator[Any]:
        """The warm-up's prompt stream, from where ``steps`` steps left it."""
        start = self.steps * self._config.warmup.batch_size
        return self._task.prompts(self._config.seed + WARMUP_SEED_OFFSET, start=start)

    def _make_optimizer(self) -> Any:
        import torch

        if self._optimizer is None:
            self._optimizer = torch.optim.AdamW(self._learner.trainable_parameters(), lr=self._config.warmup.lr)
        return self._optimizer

    def run(
        self,
        n_steps: int | None,
        *,
        sync: Callable[[], None],
        log: Callable[[Mapping[str, float]], None],
        progress: bool,
        name: str,
    ) -> list[dict[str, float]]:
        """``n_steps`` (``config.warmup.steps`` when None) warm-up steps; then ``sync()``
        sends the weights to the engine and ``log`` records the stage, even after a
        Ctrl-C (which stops after the current step)."""
        cfg = self._config.warmup
        n_steps = cfg.steps if n_steps is None else n_steps
        if not isinstance(n_steps, int) or isinstance(n_steps, bool) or n_steps < 0:
            raise InvalidValueError(f"warmup(n_steps={n_steps!r}): use an int >= 0")
        optimizer = self._make_optimizer()
        history: list[dict[str, float]] = []
        try:
            with progress_bar(n_steps, f"rlnb {name} warm-up", progress) as bar:
                for _ in range(n_steps):
                    items = [next(self._prompts) for _ in range(cfg.batch_size)]
                    with defer_interrupts():
                        metrics = self._learner.supervised_step(
                            [(item.encodable, _target(item.answer)) for item in items], optimizer
                        )
                        self.steps += 1
                    history.append(metrics)
                    bar.set_postfix(loss=f"{metrics['sft_loss']:.3f}")
                    bar.update(1)
        finally:
            if history:
                with defer_interrupts():
                    sync()
                    log({"warmup/steps": float(self.steps), "warmup/sft_loss": history[-1]["sft_loss"]})
        return history

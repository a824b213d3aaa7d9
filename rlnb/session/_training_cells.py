"""The session's training cells: step, train, warm up, evaluate, and train in the
background. A part of :class:`~rlnb.Session`, which delegates them to its
:class:`~rlnb.learn.Trainer`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlnb._errors import ConfigError, public_call
from rlnb._files import write_model_dir
from rlnb.rollout import Rollouter

if TYPE_CHECKING:
    from rlnb.learn import Trainer
    from rlnb.models import HFPolicy, TinyPolicy

__all__ = ["TrainingCells"]


class TrainingCells:
    """Training methods of :class:`~rlnb.Session`, which provides ``_trainer``,
    ``_tokenizer``, ``_check()`` and ``_check_open()``."""

    _trainer: Trainer
    _tokenizer: Any

    def _check(self) -> Rollouter:
        raise NotImplementedError  # the session's

    def _check_open(self) -> None:
        raise NotImplementedError  # the session's

    def _watch_stalls(self) -> None:
        raise NotImplementedError  # the session's: starts its stall watch (idempotent)

    @property
    def policy(self) -> TinyPolicy | HFPolicy:
        """The model being trained: the learner's (the engine serves a copy, synced each
        step). Look, evaluate, save; change it only through training."""
        self._check_open()
        return self._trainer.learner.policy

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
        if not isinstance(adapter_only, bool):
            raise ConfigError(
                f"save_pretrained(adapter_only={adapter_only!r}) is invalid: pass True (the LoRA adapter alone) or "
                "False (the whole model)"
            )
        self._trainer.check_idle("save_pretrained()")
        policy: Any = self._trainer.learner.policy
        if not hasattr(policy, "write_pretrained"):
            raise ConfigError(
                "save_pretrained() writes a Hugging Face model, and this session trains the built-in policy: "
                "use save() (a checkpoint), or train a Hugging Face model with ModelConfig(path=...)"
            )

        if adapter_only and getattr(policy, "lora", None) is None:
            raise ConfigError(
                "save_pretrained(adapter_only=True) writes a LoRA adapter, and this session trains every weight "
                "of its model: use save_pretrained(directory), or train an adapter with "
                "ModelConfig(path=..., lora=rlnb.LoraConfig())"
            )

        def fill(staging: Path) -> None:
            policy.write_pretrained(staging, adapter_only=adapter_only)
            self._tokenizer.tokenizer.save_pretrained(staging)  # transformers' own: into the new directory

        return write_model_dir(directory, fill, call="Session.save_pretrained", argument="directory")

    @property
    def version(self) -> int:
        """The learner's policy version: the number of steps taken."""
        return self._trainer.version

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

    @property
    def history(self) -> list[dict[str, float]]:
        """Every completed step's metrics, oldest first (a copy)."""
        return list(self._trainer.history)

    @property
    def evaluations(self) -> list[tuple[int, float]]:
        """Every :meth:`evaluate` so far as ``(policy version, accuracy)``, oldest first (a copy)."""
        return list(self._trainer.evaluations)

    @property
    def training(self) -> bool:
        """Whether training runs in the background (:meth:`start`)."""
        return self._trainer.training

    @public_call("statistics().training says whether it runs")
    def start(self, steps: int | None = None) -> None:
        """Train on the session's own thread and return at once: ``steps`` more steps,
        or until :meth:`stop` (None). The kernel stays free: widgets, :meth:`pause`,
        :meth:`resume` and other cells work meanwhile, and Ctrl-C in another cell does
        not touch the run. A failure is raised, chained, at the next call on the
        session. :meth:`step`, :meth:`train`, :meth:`warmup`, :meth:`evaluate` and
        :meth:`save` raise until the run ends."""
        self._check()
        self._watch_stalls()
        self._trainer.start(steps)

    @public_call("the background run still stops after its step; stop() waits again")
    def stop(self, timeout: float | None = None) -> None:
        """End the background run at a step boundary and wait for it (a step that has
        started its update completes; one still waiting trains nothing). Idempotent."""
        self._check_open()
        self._trainer.stop(timeout)
        self._check()

    @public_call("the background run goes on: stop() ends it, wait() waits again", waits_for_rollouts=True)
    def wait(self, timeout: float | None = None) -> None:
        """Block until the background run has taken its ``steps`` (or was stopped);
        raises its failure. :class:`TimeoutError` after ``timeout`` s."""
        self._check()
        self._trainer.wait(timeout)

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

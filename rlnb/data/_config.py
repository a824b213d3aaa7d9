"""``DataConfig``: the prompt pipeline's settings, here beside the :class:`PromptLoader`
that reads them (``rlnb.config`` re-exports it: ``rlnb.DataConfig``)."""

from __future__ import annotations

import dataclasses

from rlnb._checks import check_int, keywords, require

__all__ = ["DataConfig"]


@keywords()
@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The prompt pipeline (torchdata's ``StatefulDataLoader``).

    num_workers: worker processes making prompts (0: in this process). The prompt
        order is the same for any number. With 0, ``make_prompt`` runs on the
        session's event loop, so a slow one (tens of ms) holds up
        ``sess.rollouts.pause()`` and every other call meanwhile: keep workers for a
        slow ``make_prompt``, and enough of them to keep ahead of the learner.
    prefetch_factor: prompts each worker keeps ready.
    multiprocessing_context: how workers start: "forkserver" (the default: a worker
        forked from a process with other threads, as a kernel always is, can hang in
        torch for ever; see docs/processes.md), "fork", "spawn", or ``None`` (the
        platform's default). With "forkserver" and "spawn" a task's functions must be
        importable by the workers (defined in a module, not a notebook cell or a
        lambda; else use ``num_workers=0``).
    on_bad_prompt: what a prompt whose ``make_prompt`` raises does: "raise" (a
        :class:`~rlnb.PromptError` naming the prompt and the exception, once, at the
        call that needed it; the stream goes on with the next prompt) or "skip" (it
        is left out, counted in ``statistics().rollout.bad_prompts``, the last one
        described in ``last_bad_prompt``). A prompt too long for ``ModelConfig.max_len``
        with ``max_new_tokens`` is a bad prompt too: "raise" gives a
        :class:`~rlnb.RolloutError` naming it before anything is generated for it.
    """

    num_workers: int = 1
    prefetch_factor: int = 8
    multiprocessing_context: str | None = "forkserver"
    on_bad_prompt: str = "raise"

    def __post_init__(self) -> None:
        check_int("DataConfig.num_workers", self.num_workers, minimum=0, example="num_workers=1")
        check_int("DataConfig.prefetch_factor", self.prefetch_factor, minimum=1, example="prefetch_factor=8")
        require(
            self.multiprocessing_context in (None, "fork", "forkserver", "spawn"),
            "DataConfig.multiprocessing_context",
            self.multiprocessing_context,
            'use None, "fork", "forkserver" or "spawn"',
        )
        require(
            self.on_bad_prompt in ("raise", "skip"),
            "DataConfig.on_bad_prompt",
            self.on_bad_prompt,
            'use "raise" or "skip"',
        )

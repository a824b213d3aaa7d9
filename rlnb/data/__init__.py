"""Tasks, their prompts, and the prompt loader (torchdata's ``StatefulDataLoader``).

``PromptLoader`` and ``PromptStream`` are imported on first use: they need torch,
and ``import rlnb`` stays light.
"""

from typing import TYPE_CHECKING, Any

from rlnb.data._tasks import Task, addition, get_task, register_task, reverse, sort, task_names

if TYPE_CHECKING:
    from rlnb.data._loader import PromptLoader, PromptStream

__all__ = [
    "PromptLoader",
    "PromptStream",
    "Task",
    "addition",
    "get_task",
    "register_task",
    "reverse",
    "sort",
    "task_names",
]

_LAZY = {"PromptLoader", "PromptStream"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from rlnb.data import _loader

        return getattr(_loader, name)
    raise AttributeError(f"module 'rlnb.data' has no attribute {name!r}")

"""Tasks, their prompts, and the prompt loader (torchdata's ``StatefulDataLoader``)
with its settings, ``DataConfig`` (also ``rlnb.DataConfig``).

``PromptLoader``, ``PromptLoaderError``, ``PromptStream``, ``warm_up_workers`` and
``DEFAULT_START_METHOD`` are imported on first use: they need torch, and
``import rlnb`` stays light.
"""

from typing import TYPE_CHECKING, Any

from rlnb.data._config import DataConfig
from rlnb.data._tasks import (
    Task,
    addition,
    calculator,
    calculator_teacher,
    get_task,
    register_task,
    reverse,
    sloppy_reverse,
    sort,
    task_names,
)

if TYPE_CHECKING:
    from rlnb.data._loader import DEFAULT_START_METHOD, PromptLoader, PromptLoaderError, PromptStream, warm_up_workers

__all__ = [
    "DEFAULT_START_METHOD",
    "DataConfig",
    "PromptLoader",
    "PromptLoaderError",
    "PromptStream",
    "Task",
    "addition",
    "calculator",
    "calculator_teacher",
    "get_task",
    "register_task",
    "reverse",
    "sloppy_reverse",
    "sort",
    "task_names",
    "warm_up_workers",
]

_LAZY = {"DEFAULT_START_METHOD", "PromptLoader", "PromptLoaderError", "PromptStream", "warm_up_workers"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from rlnb.data import _loader

        return getattr(_loader, name)
    raise AttributeError(f"module 'rlnb.data' has no attribute {name!r}")

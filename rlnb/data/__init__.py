"""Tasks and their prompts."""

from rlnb.data._tasks import Task, addition, get_task, register_task, reverse, sort, task_names

__all__ = ["Task", "addition", "get_task", "register_task", "reverse", "sort", "task_names"]

"""The papers' training experiments as tasks (imports the library, never imported by it).

Each module ``attnopt/experiments/<task>.py`` defines ``TASK`` (an
:class:`~attnopt.experiments._task.Task`); :func:`task_names` / :func:`get_task` find them
(modules whose name starts with ``_`` are infrastructure). The engine that runs them on
PyTorch Lightning is :func:`attnopt.experiments._engine.run_task` (needs the ``train`` extra).
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache

from attnopt.experiments._task import DataBundle, RunConfig, Scale, Task

__all__ = ["DataBundle", "RunConfig", "Scale", "Task", "get_task", "task_names"]


@cache
def _tasks() -> dict[str, Task]:
    found: dict[str, Task] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        task = getattr(module, "TASK", None)
        if isinstance(task, Task):
            if task.name in found:
                raise RuntimeError(f"two tasks named {task.name!r}")
            found[task.name] = task
    return dict(sorted(found.items()))


def task_names() -> list[str]:
    """Every task's CLI name, sorted."""
    return list(_tasks())


def get_task(name: str) -> Task:
    """The task called ``name``.

    Raises:
        ValueError: unknown name (the message lists the valid ones).
    """
    tasks = _tasks()
    if name not in tasks:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(tasks) or 'none'}")
    return tasks[name]

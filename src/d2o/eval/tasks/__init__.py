"""Evaluation tasks, registered by name (importing a task's module registers it)."""

from d2o.eval.tasks import coqa, gsm8k, longbench, niah, passkey, perplexity, ruler, squad, truthfulqa  # noqa: F401
from d2o.eval.tasks.base import TASKS, Sample, Task, get_task

__all__ = ["TASKS", "Sample", "Task", "get_task"]

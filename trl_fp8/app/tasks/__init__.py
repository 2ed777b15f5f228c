"""Built-in verifiable tasks for offline demos and tests.

Each one is available by name where a dataset goes: ``--dataset_name trl-fp8:<task>`` (the CLI, YAML recipes),
:func:`load_task` in code. :data:`TASKS` lists them; an unknown ``trl-fp8:`` name raises ``ValueError`` listing them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .arithmetic import correctness_reward, extract_boxed, format_reward, make_arithmetic_dataset

PREFIX = "trl-fp8:"


@dataclass(frozen=True)
class Task:
    summary: str
    build: Callable[[int], dict]  # seed -> {"train": Dataset, "test": Dataset}


def _arithmetic(seed: int) -> dict:
    return {"train": make_arithmetic_dataset(4000, seed=seed), "test": make_arithmetic_dataset(256, seed=seed + 1)}


def _chat_math(seed: int) -> dict:
    from .chat_math import make_chat_math_dataset

    return {"train": make_chat_math_dataset(1000, seed=seed), "test": make_chat_math_dataset(256, seed=seed + 1)}


def _reasoning(seed: int) -> dict:
    from .reasoning import make_reasoning_dataset

    return {"train": make_reasoning_dataset(2000, seed=seed), "test": make_reasoning_dataset(256, seed=seed + 1)}


def _mixed_math(seed: int) -> dict:  # calibrated pools: fixed, the seed does not draw them
    from .mixed_math import make_mixed_math_dataset

    return {"train": make_mixed_math_dataset("train"), "test": make_mixed_math_dataset("heldout")}


TASKS: dict[str, Task] = {
    "arithmetic": Task("two-operand sums and differences, answered as \\boxed{n} (the demo model's task)", _arithmetic),
    "chat_math": Task("arithmetic asked in a chat, one worked exchange first, answered in \\boxed{} (SmolLM2's task)",
                      _chat_math),
    "reasoning": Task("chains of one-digit steps written out, then the answer in \\boxed{} (the reasoning model's "
                      "task)", _reasoning),
    "mixed_math": Task("calibrated chat arithmetic of mixed difficulty, train pool and held-out set (the DUET race's "
                       "task)", _mixed_math),
}


def is_task_name(name) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def task_list() -> str:
    return "; ".join(f"{PREFIX}{name} ({task.summary})" for name, task in TASKS.items())


def load_task(name: str, seed: int = 0):
    """The built-in task ``name`` (``trl-fp8:<task>`` or ``<task>``) as a ``datasets.DatasetDict`` with ``train``
    and ``test`` splits, drawn with ``seed``. An unknown name raises ``ValueError`` listing the built-ins."""
    from datasets import DatasetDict

    key = name[len(PREFIX):] if is_task_name(name) else name
    if key not in TASKS:
        raise ValueError(f"dataset_name: unknown built-in task '{name}'. The built-in tasks are: {task_list()}.")
    return DatasetDict(TASKS[key].build(seed))


__all__ = ["PREFIX", "TASKS", "correctness_reward", "extract_boxed", "format_reward", "is_task_name", "load_task",
           "make_arithmetic_dataset", "task_list"]

"""What the wall-clock budget allocates: its row of the memory plan (``trl-fp8 plan``): nothing on the GPU (a clock,
a deadline and a stop flag; with many processes one scalar all-reduce per check)."""

from __future__ import annotations

from ..memory import PERSISTENT, Row


def memory_rows(spec) -> list[Row]:
    return [Row("time budget (a clock and a flag)", 0, "0 B", PERSISTENT, "time_budget", "time_budget/state")]

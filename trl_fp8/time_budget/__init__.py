"""Wall-clock time budget: save a complete checkpoint and stop cleanly before a session's time runs out (or on
SIGTERM); the time used accumulates across resumes. The pure planner is :mod:`trl_fp8.time_budget.core`; the trainer glue
is :mod:`trl_fp8.time_budget.component`."""

from .core import BudgetPlanner, Decision, format_duration, parse_duration

__all__ = ["BudgetPlanner", "Decision", "format_duration", "parse_duration"]

"""Wall-clock time budget: save a complete checkpoint and stop cleanly before a session's time runs out (or on
SIGTERM); the time used accumulates across resumes. The pure planner is :mod:`trl_fp8.time_budget.core`; the trainer glue
is :mod:`trl_fp8.time_budget.component`."""

from .core import BudgetPlanner, Decision, format_duration, parse_duration

# Set by a launcher that forwards the SIGTERM it gets to the trainer's process (`trl-fp8 grpo`): one SIGTERM sent to
# the process group then arrives twice, and a repeated one is the same request (see component.SigtermHook).
SIGNALS_FORWARDED_ENV = "TRL_FP8_SIGNALS_FORWARDED"

__all__ = ["SIGNALS_FORWARDED_ENV", "BudgetPlanner", "Decision", "format_duration", "parse_duration"]

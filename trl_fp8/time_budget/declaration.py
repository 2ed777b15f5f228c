"""What the time budget declares, read alike by the trainer (:mod:`.component`) and the memory plan (``trl-fp8 plan``):
its ``GRPOConfig`` fields with their defaults, when it is wanted. Pure Python: importable without torch or TRL."""

from __future__ import annotations

from dataclasses import dataclass, field

ENV_VAR = "TRL_FP8_TIME_BUDGET"
SCOPES = ("session", "total")
AFTER = ()
OVERRIDES = ()
DERIVED_STREAM = False


@dataclass
class TimeBudgetArgs:
    time_budget: str | None = field(
        default=None,
        metadata={"help": "trl_fp8: wall-clock budget, e.g. '11h30m', '90m', '45s', '11:30:00' or seconds: save a "
                  "checkpoint and stop before it runs out. A SIGTERM stops the step in flight at its next "
                  "micro-batch or generation boundary and saves the last complete step. Counted from the start of the "
                  "process "
                  f"(a notebook's kernel). Unset: read from ${ENV_VAR}; None/'off': no budget."},
    )
    time_budget_margin: str | None = field(
        default=None,
        metadata={"help": "trl_fp8: time kept free after the final checkpoint is written (same forms as "
                  "time_budget). Default: 5 percent of the budget, at most 1 minute."},
    )
    time_budget_scope: str = field(
        default="session",
        metadata={"help": "trl_fp8: what the budget limits: 'session' (this process, e.g. one Colab session) or "
                  "'total' (the run's time summed over every resumed session).", "choices": list(SCOPES)},
    )


def wanted(args) -> bool:
    return getattr(args, "time_budget", None) is not None

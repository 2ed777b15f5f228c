"""What the weight-sync checks declares, read alike by the trainer (:mod:`.component`) and the memory plan (``trl-fp8 plan``):
its ``GRPOConfig`` fields with their defaults, when it is wanted and what they build on. Pure Python: importable without torch or TRL."""

from __future__ import annotations

from dataclasses import dataclass, field

from .names import resolve_checks

SYNC_CHECK_ACTIONS = ("raise", "warn")
AFTER = ("mxfp8", "fast_qlora", "fair_cast", "duet")  # they observe the samplers the others set up
OVERRIDES = ()
DERIVED_STREAM = False


@dataclass
class SyncChecksArgs:
    sync_checks: str = field(
        default="default",
        metadata={"help": "trl_fp8: weight-sync checks to run: 'default', 'all', 'off' or check names (a list, or "
                  "comma-separated on the command line: recipe_parity, coverage, freshness, quant_parity, "
                  "logprob_agreement, differential_oracle, cache_hygiene)."},
    )
    sync_check_interval: int = field(
        default=1, metadata={"help": "trl_fp8: run the weight-sync checks every N syncs / generations (>= 1)."}
    )
    sync_check_action: str = field(
        default="raise",
        metadata={"help": "trl_fp8: on a failed weight-sync check, 'raise' a WeightSyncError or 'warn'.",
                  "choices": list(SYNC_CHECK_ACTIONS)},
    )

    def resolved_sync_checks(self) -> tuple[str, ...]:
        return resolve_checks(self.sync_checks)


def wanted(args) -> bool:
    return bool(resolve_checks(getattr(args, "sync_checks", "off")))

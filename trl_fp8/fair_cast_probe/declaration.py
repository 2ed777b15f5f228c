"""What the Fair Cast probe declares, read alike by the trainer (:mod:`.component`) and the memory plan
(``trl-fp8 plan``): its ``GRPOConfig`` field and when it is wanted. Pure Python: importable without torch or TRL."""

from __future__ import annotations

from dataclasses import dataclass, field

AFTER = ()
OVERRIDES = ()
DERIVED_STREAM = False
DEFAULT_EVERY = 10


@dataclass
class FairCastProbeArgs:
    fair_cast_probe: int = field(
        default=DEFAULT_EVERY,
        metadata={"help": "trl_fp8: with fair_cast='off', every this many optimizer steps measure on a fixed sample "
                  "of the trained fp32 weights the share of the step's update that round-to-nearest into the served "
                  "dtype drops (metric fair_cast/rtn_dropped_frac; a line at the end of the run when it stays high). "
                  "0 turns the probe off."},
    )


def wanted(args) -> bool:
    return getattr(args, "fair_cast", "off") == "off" and getattr(args, "fair_cast_probe", DEFAULT_EVERY) > 0

"""The capability list: what :class:`trl_fp8.GRPOTrainer` composes and what :class:`trl_fp8.GRPOConfig` takes its
fields from. A new capability is a package plus one entry here.

The set-up order is derived from what each declares it builds on (``after``; :func:`trl_fp8.composition.setup_order`):
MXFP8 and fast QLoRA change the policy's layers before Fair Cast copies it into its served twin; the weight-sync checks
observe the samplers the others set up and compare logprobs on the batches DUET adjusted. Otherwise the order below.
"""

from .capability import register
from .composition import setup_order
from .distributed import Layout, refusal
from .duet.component import Duet
from .fair_cast.component import FairCast
from .fast_qlora.component import FastQLoRA
from .mxfp8.component import MXFP8
from .sync_checks.component import SyncChecks
from .time_budget.component import TimeBudget

CAPABILITIES = setup_order((MXFP8, FastQLoRA, FairCast, Duet, SyncChecks, TimeBudget))
register(CAPABILITIES)


def support_table(capabilities=CAPABILITIES) -> list[tuple[str, dict[str, str]]]:
    """Per capability, per process-layout column: ``"supported"`` or ``"refused: <why>"`` (the README's "Many processes"
    table), from each capability's own layout rules (:func:`trl_fp8.distributed.refusal`)."""
    columns = [("one process", Layout("single")), ("DDP", Layout("ddp", 2)),
               ("ZeRO-1/2", Layout("deepspeed", 2, 2)), ("ZeRO-3", Layout("deepspeed", 2, 3)),
               ("FSDP1", Layout("fsdp", 2, fsdp_version=1)), ("FSDP2", Layout("fsdp", 2, fsdp_version=2))]
    rows = []
    for cap in capabilities:
        row = {}
        for title, layout in columns:
            reason = refusal(cap, layout)
            row[title] = "supported" if reason is None else f"refused: {reason}"
        rows.append((cap.name, row))
    return rows

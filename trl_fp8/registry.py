"""The capability list: what :class:`trl_fp8.GRPOTrainer` composes and what :class:`trl_fp8.GRPOConfig` takes its
fields from. A new capability is a package (its ``declaration``, ``component`` and ``memory`` modules) plus one entry
in :data:`PACKAGES`.

:data:`PACKAGES` is read without importing anything heavy: the memory plan builds its view of the list from each
package's ``declaration`` (:mod:`trl_fp8.plan.capabilities`). :data:`CAPABILITIES`, the classes, is built on first use.

The set-up order is derived from what each declares it builds on (``after``; :func:`trl_fp8.composition.setup_order`):
MXFP8 and fast QLoRA change the policy's layers before Fair Cast copies it into its served twin; the weight-sync checks
observe the samplers the others set up and compare logprobs on the batches DUET adjusted. Otherwise the order below.
"""

from __future__ import annotations

import importlib

# (package, its Capability class in <package>/component.py), in the order set-up falls back to
PACKAGES = (("mxfp8", "MXFP8"), ("fast_qlora", "FastQLoRA"), ("fair_cast", "FairCast"),
            ("fair_cast_probe", "FairCastProbe"), ("duet", "Duet"), ("sync_checks", "SyncChecks"),
            ("time_budget", "TimeBudget"))

_BUILT: list = []


def _capabilities() -> tuple:
    if not _BUILT:
        from .composition import setup_order

        classes = tuple(getattr(importlib.import_module(f"trl_fp8.{package}.component"), name)
                        for package, name in PACKAGES)
        _BUILT.append(setup_order(classes))
    return _BUILT[0]


def __getattr__(name):
    if name == "CAPABILITIES":
        return _capabilities()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def support_table(capabilities=None) -> list[tuple[str, dict[str, str]]]:
    """Per capability, per process-layout column: ``"supported"`` or ``"refused: <why>"`` (the README's "Many processes"
    table), from each capability's own layout rules (:func:`trl_fp8.distributed.refusal`)."""
    from .distributed import Layout, refusal

    columns = [("one process", Layout("single")), ("DDP", Layout("ddp", 2)),
               ("ZeRO-1/2", Layout("deepspeed", 2, 2)), ("ZeRO-3", Layout("deepspeed", 2, 3)),
               ("FSDP1", Layout("fsdp", 2, fsdp_version=1)), ("FSDP2", Layout("fsdp", 2, fsdp_version=2))]
    rows = []
    for cap in capabilities if capabilities is not None else _capabilities():
        row = {}
        for title, layout in columns:
            reason = refusal(cap, layout)
            row[title] = "supported" if reason is None else f"refused: {reason}"
        rows.append((cap.name, row))
    return rows

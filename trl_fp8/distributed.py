"""Many processes: which process layout a run uses, what each capability supports under it, and the few collectives the
capabilities share.

**Layouts.** A run is on one process, on DDP (``torchrun`` / ``accelerate launch --multi_gpu``: every rank holds the
whole model), on DeepSpeed ZeRO-1/2/3 or on FSDP (1 or 2). DeepSpeed and FSDP may be asked for in three places, and
each one counts: the trainer's arguments (``args.deepspeed``, ``args.fsdp``), an accelerate config
(``accelerate launch --config_file zero2.yaml``, ``trl-fp8 grpo --accelerate_config zero2``: it reaches the script
only as ``ACCELERATE_USE_DEEPSPEED`` / ``ACCELERATE_DEEPSPEED_ZERO_STAGE`` / ``ACCELERATE_USE_FSDP`` /
``FSDP_VERSION`` in the environment, never in ``args``), and the trainer itself (``is_deepspeed_enabled``,
``is_fsdp_enabled``). :func:`detect_config` reads the first two at config time; :func:`detect` adds the trainer's
view at trainer start. Where a request and the trainer disagree (accelerate drops FSDP on a CPU-only machine) the
request wins: a guard never lets a capability run in a mode nobody tested because one place forgot to say it.

**Support.** Each capability declares ``layouts``: for ``"ddp"``, ``"deepspeed"`` and ``"fsdp"``, ``None``
(supported) or the reason it is refused. :func:`admit` applies it at config time and at trainer start: a refused
capability raises a ``ValueError`` naming the capability, the layout, where the layout was asked for and how to turn
the capability off — except one that is on by default and was not asked for (``soft_default``, the weight-sync
checks), which says so in one warning line and stays off. :func:`trl_fp8.registry.support_table` is the README's table.

**Collectives.** :func:`gather_objects`, :func:`reduce_floats`: no-ops on one process, one small collective
otherwise; every rank must call them at the same point (the capabilities call them at fixed points of the step).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

logger = logging.getLogger("trl_fp8.distributed")

LAYOUT_KINDS = ("ddp", "deepspeed", "fsdp")  # one process is always supported
_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Layout:
    """How a run spreads over processes. ``backend``: ``"single"``, ``"ddp"``, ``"deepspeed"`` or ``"fsdp"``."""

    backend: str = "single"
    num_processes: int = 1
    zero_stage: int | None = None
    fsdp_version: int | None = None
    source: str = ""  # where it was asked for, for error messages

    @property
    def label(self) -> str:
        if self.backend == "deepspeed":
            return f"DeepSpeed ZeRO-{self.zero_stage}" if self.zero_stage is not None else "DeepSpeed"
        if self.backend == "fsdp":
            return f"FSDP{self.fsdp_version}" if self.fsdp_version else "FSDP"
        if self.backend == "ddp":
            return f"DDP ({self.num_processes} processes)"
        return "one process"

    @property
    def sharded(self) -> bool:
        return self.backend in ("deepspeed", "fsdp")


def _env_true(environ, name: str) -> bool:
    return str(environ.get(name, "false")).strip().lower() in _TRUE


def _int_or_none(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _deepspeed_stage(args) -> int | None:
    config = getattr(getattr(args, "hf_deepspeed_config", None), "config", None)
    if config is None and isinstance(getattr(args, "deepspeed", None), dict):
        config = args.deepspeed
    if isinstance(config, dict):
        return _int_or_none((config.get("zero_optimization") or {}).get("stage"))
    plugin = getattr(args, "deepspeed_plugin", None)
    return _int_or_none(getattr(plugin, "zero_stage", None))


def detect_config(args, environ=None) -> Layout:
    """The layout a configuration asks for: ``args.deepspeed`` / ``args.fsdp``, the DeepSpeed plugin transformers
    builds from the environment, and accelerate's environment variables (set by ``accelerate launch`` from its
    config file). ``WORLD_SIZE`` > 1 without either is DDP."""
    environ = os.environ if environ is None else environ
    processes = max(1, _int_or_none(environ.get("WORLD_SIZE")) or 1)
    if getattr(args, "deepspeed", None):
        return Layout("deepspeed", processes, _deepspeed_stage(args), source="args.deepspeed")
    if _env_true(environ, "ACCELERATE_USE_DEEPSPEED") or getattr(args, "deepspeed_plugin", None) is not None:
        stage = _int_or_none(environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")) or _deepspeed_stage(args)
        return Layout("deepspeed", processes, stage,
                      source="an accelerate config (ACCELERATE_USE_DEEPSPEED in the environment)")
    if getattr(args, "fsdp", None):
        version = _int_or_none((getattr(args, "fsdp_config", None) or {}).get("version")) or 1
        return Layout("fsdp", processes, fsdp_version=version, source="args.fsdp")
    if _env_true(environ, "ACCELERATE_USE_FSDP"):
        version = _int_or_none(environ.get("FSDP_VERSION")) or 1
        return Layout("fsdp", processes, fsdp_version=version,
                      source="an accelerate config (ACCELERATE_USE_FSDP in the environment)")
    if processes > 1:
        return Layout("ddp", processes, source=f"WORLD_SIZE={processes} (torchrun / accelerate launch)")
    return Layout("single", 1)


def detect(trainer) -> Layout:
    """The layout at trainer start: the trainer's own view (``is_deepspeed_enabled``, ``is_fsdp_enabled``, its
    accelerator's process count), with any request of the configuration or environment the trainer did not act on."""
    accelerator = trainer.accelerator
    processes = int(getattr(accelerator, "num_processes", 1) or 1)
    requested = detect_config(trainer.args)
    state = getattr(accelerator, "state", None)
    if getattr(trainer, "is_deepspeed_enabled", False):
        stage = _int_or_none(getattr(getattr(state, "deepspeed_plugin", None), "zero_stage", None))
        return Layout("deepspeed", processes, stage if stage is not None else requested.zero_stage,
                      source=requested.source if requested.backend == "deepspeed" else
                      "the trainer (is_deepspeed_enabled)")
    if getattr(trainer, "is_fsdp_enabled", False):
        version = _int_or_none(getattr(getattr(state, "fsdp_plugin", None), "fsdp_version", None))
        return Layout("fsdp", processes, fsdp_version=version or requested.fsdp_version,
                      source=requested.source if requested.backend == "fsdp" else "the trainer (is_fsdp_enabled)")
    if requested.sharded:  # asked for, but this trainer did not turn it on (e.g. FSDP on a CPU-only machine)
        return Layout(requested.backend, processes, requested.zero_stage, requested.fsdp_version,
                      source=requested.source + ", not active in this trainer")
    if processes > 1:
        return Layout("ddp", processes, source="the trainer's accelerator")
    return Layout("single", 1)


# -- support ----------------------------------------------------------------------------------------------------
def refusal(capability, layout: Layout) -> str | None:
    """Why ``capability`` (a class) does not run under ``layout``; None: it does."""
    if layout.backend == "single":
        return None
    layouts = getattr(capability, "layouts", {}) or {}
    if layout.backend not in layouts:
        return "it has not been made to run with many processes"
    reason = layouts[layout.backend]
    if isinstance(reason, dict):  # per ZeRO stage / FSDP version: {stage: reason or None}
        key = layout.zero_stage if layout.backend == "deepspeed" else layout.fsdp_version
        reason = reason.get(key, reason.get(None, "this stage/version is not supported"))
    return reason


def admit(capability, args, layout: Layout, capabilities=()) -> bool:
    """Whether ``capability`` (a class) runs under ``layout``: True; or, refused, a ``ValueError`` naming the
    capability, the layout, where it was asked for and the field that turns the capability off — or False with one
    warning for a capability that is on by default and was not asked for (``soft_default(args, capabilities)``;
    ``capabilities``: the run's capability list, which it may ask what samples)."""
    reason = refusal(capability, layout)
    if reason is None:
        return True
    where = f" (asked for by {layout.source})" if layout.source else ""
    soft = getattr(capability, "soft_default", None)
    level = soft(args, capabilities) if soft is not None else False
    if level:
        log = logger.info if level == "info" else logger.warning
        log("%s is off with %s%s: %s. Set %s to silence this.", capability.name, layout.label, where, reason,
            capability.off_hint)
        return False
    raise ValueError(f"{capability.name} is not supported with {layout.label}{where}: {reason}. Run it on one process "
                     f"or with DDP, or set {capability.off_hint}.")


# -- collectives ----------------------------------------------------------------------------------------------
def world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


def gather_objects(obj) -> list:
    """``[obj of rank 0, obj of rank 1, ...]`` on every rank (``[obj]`` on one process). A collective."""
    import torch.distributed as dist

    if world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def reduce_floats(values: Sequence[float], ops: Sequence[str], device=None) -> list[float]:
    """Element-wise ``"sum"``, ``"max"`` or ``"min"`` of ``values`` over the ranks (one all-gather of a float64
    vector); the values themselves on one process."""
    if world_size() == 1:
        return [float(v) for v in values]
    import torch.distributed as dist

    local = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local)
    stacked = torch.stack(parts).cpu()
    out = []
    for i, op in enumerate(ops):
        column = stacked[:, i]
        out.append(float(column.sum() if op == "sum" else column.max() if op == "max" else column.min()))
    return out


def collective_device(trainer=None):
    """The device a collective's tensors live on: the accelerator's (CUDA for NCCL), CPU without a trainer."""
    if trainer is not None:
        return trainer.accelerator.device
    return None

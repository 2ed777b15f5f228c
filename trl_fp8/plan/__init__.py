"""The memory plan of a GRPO run (``trl-fp8 plan``): what the model, TRL's trainer and each trl_fp8 capability
allocate, per parameter of what, for a model config, the run's settings and a device — before anything is loaded.

- :func:`memory_plan` → :class:`Plan` (rows, totals per card, whether it fits, the one change that would make it fit);
- :func:`measure` → the bytes the live trainer holds, by the same categories (checks the plan's persistent rows);
- :func:`saved_tensor_bytes` → the bytes of tensors a forward saves for backward (checks the activation rows on CPU).

Arithmetic only at import: no torch, no TRL (the capability list is read when a plan is made).
"""

from ..memory import GENERATION, PERSISTENT, TRAINING, Row
from .activations import Shape, saved_bytes
from .devices import DEVICES, Device, resolve_device
from .models import MODELS, Arch, resolve_model
from .plan import FREE_TIER, Plan, decision_of, make_spec, plan_for, run_args
from .suggest import memory_plan
from .spec import LoraSpec, PlanSpec, QuantSpec, Rollout


def measure(trainer, **kwargs):
    """The bytes the live trainer holds, by category (see :mod:`trl_fp8.plan.held`)."""
    from .held import measure as _measure

    return _measure(trainer, **kwargs)


def saved_tensor_bytes(*args, **kwargs):
    """See :func:`trl_fp8.plan.held.saved_tensor_bytes`."""
    from .held import saved_tensor_bytes as _saved

    return _saved(*args, **kwargs)


__all__ = ["Arch", "DEVICES", "Device", "FREE_TIER", "GENERATION", "LoraSpec", "MODELS", "PERSISTENT", "Plan",
           "PlanSpec", "QuantSpec", "Rollout", "Row", "Shape", "TRAINING", "make_spec", "measure", "memory_plan",
           "plan_for", "resolve_device", "resolve_model", "run_args", "decision_of", "saved_bytes",
           "saved_tensor_bytes"]

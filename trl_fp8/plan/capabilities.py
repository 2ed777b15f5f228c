"""What a plan reads of the capability list and of ``GRPOConfig`` without importing either (they import TRL, which
takes seconds): each capability's name, when it is switched on (its ``wanted``) and its ``memory_rows`` (the pure
``memory`` module of its package), in the set-up order of :data:`trl_fp8.registry.CAPABILITIES`; and the class
defaults of the fields a plan reads. ``tests/plan/test_light.py`` holds both to the real list and the real config:
same names, same order, same ``wanted`` on every setting it tries, the same rows, the same defaults.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from ..memory import Row


def _sync_checks_on(args) -> bool:
    from ..sync_checks.memory import enabled_checks

    return bool(enabled_checks(getattr(args, "sync_checks", "off")))


@dataclass(frozen=True)
class PlannedCapability:
    """A capability as a plan sees it: ``wanted(args)``, ``memory_rows(spec)`` (its package's ``memory`` module), and
    for the sampling decision its ``overrides`` and ``serves(args, facts)`` (its package's ``serves`` module, the very
    declaration the capability class reads)."""

    name: str
    on: Callable[[object], bool]
    overrides: tuple[str, ...] = ()
    declares_serving: bool = False

    def wanted(self, args) -> bool:
        return bool(self.on(args))

    def serves(self, args, facts) -> str | None:
        if not self.declares_serving:
            return None
        return importlib.import_module(f"trl_fp8.{self.name}.serves").serves(args, facts)

    @property
    def __name__(self) -> str:  # noqa: A003 - read by composition's messages, as a class's name would be
        return self.name

    def memory_rows(self, spec) -> list[Row]:
        return list(importlib.import_module(f"trl_fp8.{self.name}.memory").memory_rows(spec))


# The order of trl_fp8.registry.CAPABILITIES (a test checks it).
CAPABILITIES = (
    PlannedCapability("mxfp8", lambda a: getattr(a, "mxfp8", False)),
    PlannedCapability("fast_qlora", lambda a: getattr(a, "fast_qlora", "off") != "off", declares_serving=True),
    PlannedCapability("fair_cast", lambda a: getattr(a, "fair_cast", "off") != "off", ("fast_qlora",),
                      declares_serving=True),
    PlannedCapability("duet", lambda a: getattr(a, "duet", False)),
    PlannedCapability("sync_checks", _sync_checks_on),
    PlannedCapability("time_budget", lambda a: getattr(a, "time_budget", None) is not None),
)

# The class defaults of the GRPOConfig fields the plan and the capabilities' memory rows read (a test checks them).
DEFAULTS = {
    "beta": 0.0, "duet": False, "fair_cast": "off", "fast_qlora": "off", "gradient_accumulation_steps": 1,
    "gradient_checkpointing": True, "lora_serving": "auto", "max_completion_length": 512, "model_init_kwargs": None,
    "optim": "adamw_torch_fused", "per_device_train_batch_size": 8, "precision": None, "qlora_keep_budget_gb": 0.25,
    "qlora_rollout_cache_gb": None, "served_dtype": "bfloat16", "steps_per_generation": None,
    "sync_checks": "default", "use_vllm": False, "vllm_gpu_memory_utilization": 0.3, "vllm_mode": "colocate",
    "mxfp8": False, "time_budget": None, "num_generations": 8,
}

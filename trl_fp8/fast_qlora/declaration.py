"""What fast QLoRA declares, read alike by the trainer (:mod:`.component`) and the memory plan (``trl-fp8 plan``):
its ``GRPOConfig`` fields with their defaults, when it is wanted, and what it serves the sampler. Pure Python: importable without torch or TRL."""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import sampling, serving

FAST_QLORA_MODES = ("off", "auto", "on")
CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_KEEP_BUDGET_GB = 0.25
AFTER = ()
OVERRIDES = ()
DERIVED_STREAM = True  # its dense stream to vLLM computes dequant(W) + ΔW at each sync


@dataclass
class FastQLoRAArgs:
    fast_qlora: str = field(
        default="off",
        metadata={"help": "trl_fp8: fast QLoRA for a 4-bit (bitsandbytes) base with LoRA adapters: 'off' (TRL), "
                  "'auto' (on when the policy has 4-bit LoRA layers) or 'on' (refuse to start without them).",
                  "choices": list(FAST_QLORA_MODES)},
    )
    qlora_keep_budget_gb: float = field(
        default=DEFAULT_KEEP_BUDGET_GB,
        metadata={"help": "trl_fp8: GiB of dense copies of the 4-bit layers with the highest estimated NF4 error; "
                  "those never dequantize again (0 = none)."},
    )
    qlora_rollout_cache_gb: float | None = field(
        default=None,
        metadata={"help": "trl_fp8: GiB of dense dequant(W)+ΔW weights kept for one in-process generation call "
                  "(0 = no cache; default: the free memory minus a margin, at most 8 GiB)."},
    )
    qlora_cache_dtype: str = field(
        default="auto",
        metadata={"help": "trl_fp8: dtype of the rollout cache: 'auto' (GPU: the layers' compute dtype; CPU: "
                  "bfloat16 where the CPU computes it natively, else the compute dtype), 'float32', 'bfloat16' or "
                  "'float16'.", "choices": list(CACHE_DTYPES)},
    )
    qlora_adapter_layers: str = field(
        default="all",
        metadata={"help": "trl_fp8: 'all', or k: train the adapters of the top k transformer blocks only (speed "
                  "mode: the blocks below are frozen and backward stops above them)."},
    )

    def resolved_adapter_layers(self) -> int | None:
        """None for 'all', else the number of top blocks whose adapters train."""
        value = self.qlora_adapter_layers
        if isinstance(value, str) and value.strip().lower() == "all":
            return None
        return int(value)


def wanted(args) -> bool:
    return getattr(args, "fast_qlora", "off") != "off"


def serves(args, facts) -> str | None:
    """Over a 4-bit LoRA policy: in-process, the rollout cache; to vLLM with ``lora_serving='merged'``, the dense
    ``dequant(W) + ΔW`` stream (a 16-bit engine). To vLLM as adapters it has nothing to add: the engine serves base +
    adapters (the sampling decision's own adapter serving)."""
    if not (facts.four_bit and facts.lora is not None):
        return None
    if sampling.vllm_mode(args) == "off":
        return sampling.ROLLOUT_CACHE
    return None if serving.resolved(args) == "adapters" else sampling.DENSE_STREAM

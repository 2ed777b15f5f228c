"""What Fair Cast declares, read alike by the trainer (:mod:`.component`) and the memory plan (``trl-fp8 plan``):
its ``GRPOConfig`` fields with their defaults, when it is wanted, what it builds on and overrides, and what it serves the sampler. Pure Python: importable without torch or TRL."""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import sampling, serving

EXPORT_MODES = ("rtn", "stochastic", "error_feedback", "rtn_noise")
FAIR_CAST_MODES = ("off",) + EXPORT_MODES
SERVED_DTYPES = ("bfloat16", "float16")
AFTER = ("mxfp8", "fast_qlora")  # they change the policy's layers before the twin copies it
OVERRIDES = ("fast_qlora",)  # over a 4-bit base, Fair Cast's served copy (W + ΔW) is what the sampler gets
DERIVED_STREAM = False


@dataclass
class FairCastArgs:
    fair_cast: str = field(
        default="off",
        metadata={
            "help": "trl_fp8: export rule of the fp32 master into the served copy: 'off' (TRL), 'rtn' "
            "(round-to-nearest baseline), 'stochastic' or 'error_feedback'; 'rtn_noise' is an experimental "
            "control for studies (round-to-nearest plus stochastic rounding's noise: the lag kept, the noise added), "
            "not a rule to train with. When on, the loss runs on the served copy and gradients update the fp32 "
            "master.",
            "choices": list(FAIR_CAST_MODES),
        },
    )
    served_dtype: str = field(
        default="bfloat16",
        metadata={
            "help": "trl_fp8: dtype of the served copy with Fair Cast: 'bfloat16' or 'float16' (e.g. T4).",
            "choices": list(SERVED_DTYPES),
        },
    )
    fair_cast_seed: int | None = field(
        default=None,
        metadata={"help": "trl_fp8: seed of Fair Cast's stochastic rounding; default: derived from `seed`."},
    )

    @property
    def fair_cast_on(self) -> bool:
        return self.fair_cast != "off"

    def resolved_fair_cast_seed(self) -> int:
        """The SR seed: `fair_cast_seed`, or a fixed function of `seed` (so runs are reproducible)."""
        if self.fair_cast_seed is not None:
            return int(self.fair_cast_seed)
        return (int(self.seed) * 0x9E3779B1 + 0xFA1C) & 0x7FFFFFFF


def wanted(args) -> bool:
    return getattr(args, "fair_cast", "off") != "off"


def serves(args, facts) -> str | None:
    """A full model (or a LoRA served merged): its served copy, as a dense stream to vLLM or to an in-process twin.
    A LoRA served as adapters: its served factors as LoRA versions to vLLM; in-process, nothing (the policy itself,
    its factors holding the served values, generates)."""
    use_vllm = sampling.vllm_mode(args) != "off"
    if facts.lora is not None and serving.resolved(args) == "adapters":
        return sampling.LORA_VERSIONS if use_vllm else None
    return sampling.DENSE_STREAM if use_vllm else sampling.TWIN

"""What MXFP8 declares, read alike by the trainer (:mod:`.component`) and the memory plan (``trl-fp8 plan``):
its ``GRPOConfig`` fields with their defaults, when it is wanted. Pure Python: importable without torch or TRL."""

from __future__ import annotations

from dataclasses import dataclass, field

KERNELS = ("auto", "emulated", "sm100")
# Kept in bf16 on both sides: the output head, embeddings, MoE router gates (a bare `gate`/`router` module — not
# the dense `gate_proj`, which an over-broad pattern has been seen to skip in the wild).
DEFAULT_EXCLUDE = (r"(^|\.)lm_head$", r"embed", r"(^|\.)(router|gate)$")
AFTER = ()
OVERRIDES = ()
DERIVED_STREAM = False


@dataclass
class MXFP8Args:
    mxfp8: bool = field(
        default=False,
        metadata={"help": "trl_fp8: train linear layers in MXFP8 through torchao (e4m3, 32-element blocks, E8M0 "
                  "RCEIL scales); the in-process sampler uses the identical quantizer."},
    )
    mxfp8_kernel: str = field(
        default="auto",
        metadata={"help": "trl_fp8: MXFP8 kernels: 'auto' (SM100 if present, else emulated), 'emulated' or 'sm100' "
                  "(fail without a Blackwell GPU).", "choices": list(KERNELS)},
    )
    mxfp8_exclude: list[str] = field(
        default_factory=lambda: list(DEFAULT_EXCLUDE),
        metadata={"help": "trl_fp8: regexes of linear layers kept in high precision with mxfp8=True (default: "
                  "lm_head, embeddings, MoE router gates)."},
    )


def wanted(args) -> bool:
    return bool(getattr(args, "mxfp8", False))

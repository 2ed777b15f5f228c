"""What fast QLoRA serves the sampler (its declaration for :func:`trl_fp8.sampling.decide`): pure, importable without
torch or TRL, so that ``trl-fp8 plan`` reads the same declaration the trainer does."""

from __future__ import annotations

from .. import sampling, serving


def serves(args, facts) -> str | None:
    """Over a 4-bit LoRA policy: in-process, the rollout cache; to vLLM with ``lora_serving='merged'``, the dense
    ``dequant(W) + ΔW`` stream (a 16-bit engine). To vLLM as adapters it has nothing to add: the engine serves base +
    adapters (the sampling decision's own adapter serving)."""
    if not (facts.four_bit and facts.lora is not None):
        return None
    if sampling.vllm_mode(args) == "off":
        return sampling.ROLLOUT_CACHE
    return None if serving.resolved(args) == "adapters" else sampling.DENSE_STREAM

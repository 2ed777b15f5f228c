"""What Fair Cast serves the sampler (its declaration for :func:`trl_fp8.sampling.decide`): pure, importable without
torch or TRL, so that ``trl-fp8 plan`` reads the same declaration the trainer does."""

from __future__ import annotations

from .. import sampling, serving


def serves(args, facts) -> str | None:
    """A full model (or a LoRA served merged): its served copy, as a dense stream to vLLM or to an in-process twin.
    A LoRA served as adapters: its served factors as LoRA versions to vLLM; in-process, nothing (the policy itself,
    its factors holding the served values, generates)."""
    use_vllm = sampling.vllm_mode(args) != "off"
    if facts.lora is not None and serving.resolved(args) == "adapters":
        return sampling.LORA_VERSIONS if use_vllm else None
    return sampling.DENSE_STREAM if use_vllm else sampling.TWIN

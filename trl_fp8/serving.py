"""How a LoRA run's policy is served to the sampler: base + adapters, or the merged model (a neutral module: no
capability imports it from another, and it imports none).

A LoRA run's policy is the frozen base plus the adapters. With ``lora_serving="adapters"`` (what ``"auto"`` resolves
to, except to a vLLM server) the base is loaded once and never copied, merged or re-exported; only the adapter factors are exported (Fair
Cast's rounding rule) and sent. ``"merged"`` serves ``W + ΔW`` as one dense tensor per layer: a dense copy of the
model beside the learner, and a merge that rounds a small ΔW away (see docs/will-it-fit.md for the bytes).

The field matters only where a trl_fp8 capability serves the sampler (Fair Cast; fast QLoRA with vLLM): with every
trl_fp8 capability off, TRL's own path runs, whatever the field says.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LORA_SERVING_MODES = ("auto", "adapters", "merged")


@dataclass
class ServingArgs:
    lora_serving: str = field(
        default="auto",
        metadata={
            "help": "trl_fp8: how a LoRA policy is served where a trl_fp8 capability serves the sampler (Fair Cast, "
            "fast QLoRA with vLLM): 'adapters' (the base as loaded plus the exported adapter factors; Fair Cast's "
            "state is O(adapter parameters)), 'merged' (one dense W + ΔW per layer: a dense copy of the model) or "
            "'auto' (= 'adapters', except to a vLLM server: 'merged').",
            "choices": list(LORA_SERVING_MODES),
        },
    )


def validate(args) -> None:
    from .capability import check_choice

    check_choice("lora_serving", getattr(args, "lora_serving", "auto"), LORA_SERVING_MODES)


def resolved(args) -> str:
    """``"adapters"`` or ``"merged"`` for any args (a plain TRL config: as ``"auto"``). ``"auto"`` is adapters
    everywhere except to a ``vllm serve`` server (``vllm_mode="server"``), which loads LoRA adapters only from its
    own disk and is sent the merged weights."""
    mode = getattr(args, "lora_serving", "auto")
    if mode == "auto":
        server = getattr(args, "use_vllm", False) and getattr(args, "vllm_mode", None) == "server"
        return "merged" if server else "adapters"
    return mode

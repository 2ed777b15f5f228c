"""How a LoRA run's policy is served to the sampler: base + adapters, or the merged model (a neutral module: no
capability imports it from another, and it imports none).

A LoRA run's policy is the frozen base plus the adapters. With ``lora_serving="adapters"`` (what ``"auto"`` resolves
to) the base is loaded once and never copied, merged or re-exported; only the adapter factors are exported (Fair
Cast's rounding rule) and sent. ``"merged"`` serves ``W + ΔW`` as one dense tensor per layer: a dense copy of the
model beside the learner, and a merge that rounds a small ΔW away (see docs/will-it-fit.md for the bytes).

The field matters where trl_fp8 serves the sampler: where a capability does (Fair Cast; fast QLoRA with vLLM), and for
a LoRA policy over a 4-bit base with vLLM even with every capability off (TRL would merge the adapters into 4-bit
weights; trl_fp8 pushes them as adapter versions: :func:`trl_fp8.sampling.decide`). Otherwise, with every trl_fp8
capability off, TRL's own path runs, whatever the field says.
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
            "'auto' (= 'adapters'; to a vLLM server, start it with `trl-fp8 vllm-serve`).",
            "choices": list(LORA_SERVING_MODES),
        },
    )


def validate(args) -> None:
    from .capability import check_choice

    check_choice("lora_serving", getattr(args, "lora_serving", "auto"), LORA_SERVING_MODES)


def resolved(args) -> str:
    """``"adapters"`` or ``"merged"`` for any args (a plain TRL config: as ``"auto"``). ``"auto"`` is adapters,
    in-process, to a colocated engine and to a ``trl-fp8 vllm-serve`` server alike."""
    mode = getattr(args, "lora_serving", "auto")
    return "adapters" if mode == "auto" else mode


PEFT_PREFIX = "base_model.model."  # what a PEFT model puts before the wrapped model's names
# the name parts of a PEFT model's LoRA parameters (factors, embedding factors, DoRA magnitudes)
LORA_PARAM_TOKENS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


def merged_name(name: str) -> str:
    """A PEFT model's parameter or module name as the merged model (``merge_and_unload()``) and an engine loading the
    base name it: the PEFT prefix and LoRA's ``.base_layer`` removed."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer", "")


def lora_factors(model):
    """``(PEFT parameter name, factor, s)`` for each LoRA factor of every active adapter on a linear layer of a PEFT
    model, ``lora_A`` then ``lora_B`` per layer. ``s`` is what is folded into the factor when it is served as an
    adapter: 1 for ``lora_A``, the layer's scaling for ``lora_B`` (the engine then applies scale 1; see
    :func:`folded`)."""
    from peft.tuners.lora import LoraLayer

    for module_name, layer in model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        for adapter in layer.active_adapters:
            if adapter not in layer.lora_A:
                continue
            yield f"{module_name}.lora_A.{adapter}.weight", layer.lora_A[adapter].weight, 1.0
            yield f"{module_name}.lora_B.{adapter}.weight", layer.lora_B[adapter].weight, float(layer.scaling[adapter])


def folded(factor, s: float):
    """A LoRA factor with its ``s`` (:func:`lora_factors`) folded in, in fp32: what the served factor holds before it
    is rounded to the served dtype."""
    value = factor.detach().float()
    return value if s == 1 else value * s

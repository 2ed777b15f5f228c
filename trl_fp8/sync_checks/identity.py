"""Served identity: before the first rollout, the engine that serves adapter versions (a colocated vLLM engine or a
``trl-fp8 vllm-serve`` server) and the learner agree on what the base is, as each computes with it.

An adapter stream sends only the LoRA factors; the base is loaded by each side on its own — and two sides that load
"the same model" can hold different ones: another checkpoint of the same shapes (a base model on one card, its
instruct model on the other), another quantization (NF4 with or without double quantization, AWQ, FP8), another
dtype, another tokenizer, or another trl_fp8 on the server. No per-sync check sees these: the read-back compares
adapters only, and a logprob gap present from step 0 looks like precision.

Each side describes itself as a dict (:func:`learner_identity`, :func:`trl_fp8.engine_weights.engine_identity`): trl_fp8's version, the
dtype the factors are served in, the base's quantization, the tokenizer's digest, and a digest
(:func:`trl_fp8.digest.tensor_digest`) of every base tensor *in the form the engine computes with*: the learner's
tensor rounded to the engine's dtype the way the engine's load rounds it (``copy_``: round-to-nearest), a 4-bit
layer's ``dequant(W)``; the engine's tensor as its kernels read it (sliced out of packed layers). Only digests travel
(16 bytes a tensor). :func:`compare` names the first setting or tensor that differs and what fixes it.
"""

from __future__ import annotations

import torch

from ..digest import tensor_digest
from ..engine_weights import describe
from .checks import CheckResult

ADAPTER_MARKERS = (".lora_", "lora_magnitude_vector", ".modules_to_save.", ".original_module.", "trainable_tokens")


def learner_base(model):
    """``(engine name, tensor the learner computes with)`` for every base tensor of a (PEFT) model: LoRA factors and
    other adapter state left out, PEFT's prefixes and ``.base_layer`` removed, a bitsandbytes 4-bit layer as its
    ``dequant(W)`` (in its compute dtype)."""
    from .. import fourbit
    from ..serving import merged_name

    four_bit = set()
    for name, module in model.named_modules():
        if fourbit.is_4bit(module):
            four_bit.add(f"{name}.weight")
            yield merged_name(f"{name}.weight"), fourbit.dequantize(module)
    for name, param in model.named_parameters():
        if name in four_bit or any(marker in name for marker in ADAPTER_MARKERS):
            continue
        yield merged_name(name), param


def learner_identity(model, dtype: torch.dtype, tokenizer, quantization: str | None) -> dict:
    """What the learner means the engine to compute with: each base tensor rounded to ``dtype`` (the engine's), as a
    digest, and the settings."""
    tensors = {}
    for name, tensor in learner_base(model):
        if tensor.is_meta:
            raise ValueError(f"served identity: the learner's '{name}' is a meta tensor (never materialised): load "
                             "the model's weights before training.")
        tensors[name] = tensor_digest(tensor.detach().to(dtype))
    return describe(tensors, dtype, quantization, tokenizer)


def compare(learner: dict, engine: dict, where: str, fix: str, when: str = "before the first rollout") -> CheckResult:
    """The first difference between the two identities, by name, with ``fix`` (the command that makes them agree);
    reported as ``recipe_parity`` (the served recipe, ``when``: before the first rollout, or after a server came
    back)."""
    name = "recipe_parity"
    settings = (("version", "trl_fp8 version", "install the same trl_fp8 on both sides"),
                ("quantization", "base quantization", fix),
                ("dtype", "dtype the adapters are served in", fix),
                ("tokenizer", "tokenizer (vocabulary digest)", fix))
    for key, what, remedy in settings:
        lv, ev = learner.get(key), engine.get(key)
        if key == "tokenizer" and (lv is None or ev is None):
            continue  # one side has no tokenizer to describe: nothing compared
        if lv != ev:
            return CheckResult(name, False, f"served identity: the {what} differs {when}: learner "
                                            f"{lv!r}, {where} {ev!r} — {remedy}.")
    if when != "before the first rollout":
        where = f"{where} ({when})"
    ours, theirs = learner["tensors"], engine["tensors"]
    missing = [n for n in ours if theirs.get(n) is None]
    if missing:
        return CheckResult(name, False, f"served identity: {where} holds no base tensor for '{missing[0]}' "
                                        f"({len(missing)} of {len(ours)} missing) — {fix}.")
    for tensor_name, digest in ours.items():
        if theirs[tensor_name] != digest:
            return CheckResult(name, False, f"served identity: the base tensor '{tensor_name}' {where} computes with is "
                                            f"not the learner's (digest {theirs[tensor_name]} against the learner's "
                                            f"{digest}, the learner's rounded to {engine.get('dtype')}): another "
                                            f"checkpoint or quantization — {fix}.",
                               metrics={"identity_tensors": float(len(ours))})
    return CheckResult(name, True, metrics={"identity_tensors": float(len(ours))})

"""What a live trainer holds, by category — the bytes the memory plan's persistent rows are checked against — and
the bytes a forward saves for backward (the plan's activation rows, on CPU).

Each distinct tensor storage is counted once (keyed by its data pointer; on the meta device, where every pointer is
0, by the storage itself, so a meta model measures its would-be bytes), in this order, the first claim winning:

1. each capability's :meth:`~trl_fp8.capability.Capability.held_tensors`, in the trainer's order (``fair_cast/...``,
   ``fast_qlora/...``, ``sync_checks/...``; a capability may also report tensors of the model it keeps aside, e.g.
   fast QLoRA's 4-bit modules while dense copies stand in for them, under ``base``);
2. the model: ``adapters`` (LoRA factors), ``base`` (every other parameter, with bitsandbytes' 4-bit quantization
   state: absmax, nested absmax, codes, offset), ``buffers``;
3. ``gradients`` (``param.grad``), ``optimizer`` (every tensor in the optimizer's state), ``reference_model``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch

from ..memory import StorageCounter, quant_state_tensors, storage_key

LORA_TOKENS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


def model_tensors(model: torch.nn.Module) -> dict[str, list[torch.Tensor]]:
    """``adapters`` / ``base`` / ``buffers`` tensors of a model (PEFT or not)."""
    adapters, base = [], []
    for name, p in model.named_parameters(remove_duplicate=False):
        if any(f".{token}." in name or name.endswith(f".{token}") for token in LORA_TOKENS):
            adapters.append(p)
        else:
            base.append(p)
            base += quant_state_tensors(p)
    return {"adapters": adapters, "base": base,
            "buffers": [b for _, b in model.named_buffers(remove_duplicate=False)]}


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
    out = []
    for state in inner.state.values():
        out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def measure(trainer, capabilities=None) -> dict[str, int]:
    """Bytes the trainer holds now, by category (see the module docstring). ``capabilities``: the capability objects
    (default: ``trainer.capabilities``, a name -> capability mapping)."""
    counter = StorageCounter()
    caps = trainer.capabilities.values() if capabilities is None else capabilities
    for capability in caps:
        for category, tensors in capability.held_tensors().items():
            counter.add(category, tensors)
    model = trainer.accelerator.unwrap_model(trainer.model)
    for category, tensors in model_tensors(model).items():
        counter.add(category, tensors)
    counter.add("gradients", [p.grad for p in model.parameters()])
    counter.add("optimizer", optimizer_tensors(getattr(trainer, "optimizer", None)))
    ref = getattr(trainer, "ref_model", None)
    if ref is not None:
        ref = trainer.accelerator.unwrap_model(ref)
        counter.add("reference_model", [t for ts in model_tensors(ref).values() for t in ts])
    return {k: v for k, v in counter.bytes.items()}


@contextlib.contextmanager
def saved_tensor_bytes(exclude: Iterable[torch.Tensor] = ()):
    """Within the block, count the bytes of the distinct storages autograd saves for backward (parameters in
    ``exclude`` left out). Yields a dict whose ``"bytes"`` is the running total: the tensors a forward keeps for its
    backward — saved tensors, not a peak (temporaries freed during the forward are not in it)."""
    excluded = {storage_key(t) for t in exclude}
    counter = StorageCounter()
    counter.seen |= excluded
    result = {"bytes": 0}

    def pack(t):
        counter.add("saved", [t])
        result["bytes"] = counter.bytes["saved"]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield result

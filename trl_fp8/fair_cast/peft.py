"""Fair Cast units for PEFT LoRA models (no TRL imports).

Two ways to serve a LoRA model (``lora_serving``):

- **adapters** (the default): the base is served exactly as loaded (16-bit or 4-bit; never copied, never re-exported)
  and only the adapter factors are exported, one :class:`~trl_fp8.fair_cast.served.AdapterUnit` per factor
  (:func:`adapter_units`). Fair Cast's state is O(adapter parameters): an fp32 master, a served buffer (and EF's
  residual) per factor. Rounding the factors independently and unbiasedly keeps the product unbiased
  (E[B̂Â] = BA), and a small delta is computed at its own scale instead of being swallowed by ``RN(W + ΔW)``.
- **merged** (below): the served copy is the merged model.

Merged serving: for each LoRA layer the served weight is
``export(W + ΔW)`` with ``ΔW`` the active adapters' delta (``get_delta_weight``). To compute the loss on exactly
that served weight without changing PEFT's forward, the frozen base weight is set to ``q - ΔW`` between
optimizer steps: the layer then computes ``(q - ΔW) x + ΔW x = q x`` (up to fp32 rounding of the unmerged
forward), and the gradients of the LoRA factors are taken at the served weight (straight-through). The fp32 base
``W`` is kept aside and never changes.

Over a bitsandbytes 4-bit base (QLoRA) the master is ``dequant(W) + ΔW`` (fp32, derived at each export: no copy of
``W`` is kept) and the served copy is ``export(dequant(W) + ΔW)``. The loss is *not* moved onto the served copy
there: a 4-bit weight cannot hold ``q - ΔW``, and a dense residual per layer would cost the memory QLoRA saves. The
learner computes on its NF4 base + ΔW, which differs from the served weight by the export's rounding alone.
"""

from __future__ import annotations

import torch

from .. import fourbit
from ..serving import LORA_PARAM_TOKENS, lora_factors, merged_name
from .served import ParamUnit


class LoraUnit:
    """The merged weight of one LoRA layer as a served tensor."""

    trainable = True

    def __init__(self, name: str, layer):
        base = layer.get_base_layer()
        self.base = base
        self.four_bit = fourbit.is_4bit(base)
        weight = getattr(base, "weight", None)
        if not self.four_bit and (weight is None or weight.dtype != torch.float32):
            raise TypeError(
                f"Fair Cast needs an fp32 or bitsandbytes 4-bit base weight in LoRA layer '{name}', got "
                f"{None if weight is None else weight.dtype} (other quantized or low-precision bases are not "
                "supported)."
            )
        if any(layer.use_dora.get(a, False) for a in layer.active_adapters):
            raise ValueError(f"Fair Cast does not support DoRA (layer '{name}'): its forward is not W + ΔW.")
        if getattr(layer, "merged", False):
            raise ValueError(f"LoRA layer '{name}' is merged; Fair Cast needs unmerged adapters.")
        self.name = name
        self.layer = layer
        self.weight = weight
        # A 4-bit base is its own master (dequantized at each export); a dense base is copied aside once.
        self.base_master = None if self.four_bit else weight.detach().clone()

    @property
    def shape(self):
        return fourbit.weight_shape(self.base) if self.four_bit else self.weight.shape

    @property
    def device(self):
        return self.base.weight.device

    def _delta(self) -> torch.Tensor:
        if self.four_bit:  # fp32 from the factors (TRL keeps QLoRA factors in bf16)
            delta = fourbit.lora_delta(self.layer)
            return torch.zeros(self.shape, device=self.device) if delta is None else delta
        delta = torch.zeros_like(self.base_master)
        for adapter in self.layer.active_adapters:
            if adapter in self.layer.lora_A:
                delta += self.layer.get_delta_weight(adapter).float()
        return delta

    @property
    def master(self) -> torch.Tensor:
        """The fp32 merged weight W + ΔW at the current LoRA factors (W: dequantized, for a 4-bit base)."""
        base = fourbit.dequantize(self.base, torch.float32) if self.four_bit else self.base_master
        return base + self._delta()

    def capture(self) -> None:  # the master is derived from W and the live LoRA factors
        pass

    def restore(self) -> None:  # the optimizer steps the LoRA factors, not the base
        pass

    def apply(self, served: torch.Tensor) -> None:
        if self.four_bit:
            # A 4-bit weight cannot hold served - ΔW: the learner keeps computing on its NF4 base + ΔW, which differs
            # from the served weight by the export's rounding alone (half an ulp of the served dtype at most).
            return
        self.weight.data.copy_(served.float() - self._delta())


class FourBitUnit:
    """A frozen bitsandbytes 4-bit linear without adapters: served as ``export(dequant(W))``, exported once."""

    trainable = False

    def __init__(self, name: str, module):
        self.name = name
        self.module = module

    @property
    def shape(self):
        return fourbit.weight_shape(self.module)

    @property
    def device(self):
        return self.module.weight.device

    @property
    def master(self) -> torch.Tensor:
        return fourbit.dequantize(self.module, torch.float32)

    def capture(self) -> None:
        pass

    def restore(self) -> None:
        pass

    def apply(self, served: torch.Tensor) -> None:  # the 4-bit weight stays as it is (see the module docstring)
        pass


def adapter_units(peft_model) -> list:
    """One :class:`~trl_fp8.fair_cast.served.AdapterUnit` per LoRA factor of every active adapter, named as PEFT's
    ``named_parameters()`` names it (``...q_proj.lora_A.default.weight``); ``lora_B`` carries its layer's scaling.

    Factors kept in 16-bit (TRL keeps QLoRA factors in bf16) are upcast to fp32 in place: the fp32 master Fair Cast
    needs (2 bytes more per adapter parameter). Refused: DoRA, LoRA variants, ``lora_bias``, embedding LoRA, merged
    adapters and any trainable parameter that is no LoRA factor (``modules_to_save``, ``bias='all'``): the served
    policy is the frozen base plus the factors, so nothing else may change.
    """
    from peft.tuners.lora import LoraLayer

    from .served import AdapterUnit

    for module_name, layer in peft_model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        where = f"LoRA layer '{module_name}'"
        if getattr(layer, "merged", False):
            raise ValueError(f"{where} is merged; Fair Cast needs unmerged adapters.")
        for adapter in layer.active_adapters:
            if layer.use_dora.get(adapter, False) or adapter in getattr(layer, "lora_variant", {}):
                raise ValueError(f"Fair Cast does not support DoRA or other LoRA variants ({where}): its forward is "
                                 "not W + s·B·A.")
            if getattr(layer, "lora_bias", {}).get(adapter, False):
                raise ValueError(f"Fair Cast with lora_serving='adapters' does not support lora_bias=True ({where}).")
            if adapter in getattr(layer, "lora_embedding_A", {}):
                raise ValueError(f"Fair Cast with lora_serving='adapters' supports LoRA on linear layers only; {where} "
                                 "is an embedding. Use lora_serving='merged' or leave embeddings out of "
                                 "target_modules.")
    units, owned = [], set()
    for name, factor, s in lora_factors(peft_model):  # lora_B carries its layer's scaling
        if factor.dtype in (torch.bfloat16, torch.float16):
            factor.data = factor.data.float()
        units.append(AdapterUnit(name, factor, s))
        owned.add(id(factor))
    if not units:
        raise ValueError("Fair Cast with lora_serving='adapters': the model has no active LoRA adapters on linear "
                         "layers.")
    for name, param in peft_model.named_parameters():
        if param.requires_grad and id(param) not in owned:
            raise ValueError(
                f"Fair Cast with lora_serving='adapters' serves the frozen base plus the LoRA factors, but parameter "
                f"'{name}' is trainable too (PEFT modules_to_save or LoraConfig(bias=...)). Train LoRA factors only, "
                "or use lora_serving='merged'."
            )
    return units


def lora_units(peft_model) -> list:
    """One unit per tensor of the merged model: :class:`LoraUnit` for LoRA layers, :class:`FourBitUnit` for 4-bit
    linears without adapters, :class:`ParamUnit` else.

    Names are those of ``merge_and_unload()``'s parameters (PEFT prefix and ``.base_layer`` removed).
    """
    from peft.tuners.lora import LoraLayer

    units, lora_weights = [], set()
    lora_bases = {id(m.get_base_layer()) for m in peft_model.modules() if isinstance(m, LoraLayer)}
    for module_name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer):
            unit = LoraUnit(merged_name(module_name) + ".weight", module)
            units.append(unit)
            lora_weights.add(id(unit.weight))
        elif fourbit.is_4bit(module) and id(module) not in lora_bases:
            units.append(FourBitUnit(merged_name(module_name) + ".weight", module))
            lora_weights.add(id(module.weight))
    for name, param in peft_model.named_parameters():
        if id(param) in lora_weights or any(f".{t}." in name for t in LORA_PARAM_TOKENS):
            continue
        if ".modules_to_save." in name or ".original_module." in name:
            raise ValueError(
                f"Fair Cast does not support PEFT `modules_to_save` yet (parameter '{name}'); train those modules "
                "with LoRA or leave them frozen."
            )
        units.append(ParamUnit(merged_name(name), param))
    return units

"""bitsandbytes 4-bit layers as data: finding them, dequantizing them, their NF4 codes, and the CPU repack trap.

A neutral module (no capability imports it from another capability): fast QLoRA ranks, keeps and caches 4-bit
layers with it; Fair Cast derives the master of a LoRA layer over a 4-bit base with it; the vLLM glue streams
``dequant(W) + ΔW`` with it. Every bitsandbytes-internal name trl_fp8 touches is here (read from bitsandbytes
0.50.2; ``tests/test_fourbit.py`` exercises each on CPU).
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _bnb():
    try:
        import bitsandbytes
    except ImportError:  # an optional dependency in practice: nothing 4-bit can exist without it
        return None
    return bitsandbytes


def is_4bit(module: torch.nn.Module) -> bool:
    bnb = _bnb()
    return bnb is not None and isinstance(module, bnb.nn.Linear4bit)


def is_8bit(module: torch.nn.Module) -> bool:
    bnb = _bnb()
    return bnb is not None and isinstance(module, bnb.nn.Linear8bitLt)


def has_4bit(model: torch.nn.Module) -> bool:
    return any(is_4bit(m) for m in model.modules())


def has_8bit(model: torch.nn.Module) -> bool:
    return any(is_8bit(m) for m in model.modules())


# -- the CPU repack trap --------------------------------------------------------------------------------------------
def _packed_for_cpu(module) -> bool:
    state = getattr(module.weight, "quant_state", None)
    return bool(getattr(state, "packing_format_for_cpu", False))


@torch.no_grad()
def guard_cpu_repack(model: torch.nn.Module) -> int:
    """Switch off bitsandbytes' in-place CPU repack on every 4-bit layer of ``model``; undo it where it happened.

    On an AVX512-BF16 CPU, ``Linear4bit.forward`` in eval mode with a no-grad input repacks the weight *in place*
    for a fused GEMV (``packing_format_for_cpu``). After that, ``dequantize_4bit`` returns garbage and, back in
    train mode, gradients through the layer silently vanish. Returns the number of layers that had been repacked;
    those are converted back to bitsandbytes' canonical layout, which is close but not exact (the repack stores the
    block scales in bf16: a relative change of at most 2^-8 per block).
    """
    bnb = _bnb()
    if bnb is None:
        return 0
    restored = 0
    for module in model.modules():
        if not is_4bit(module):
            continue
        module.support_avx512bf16_for_cpu = False
        if _packed_for_cpu(module):
            from bitsandbytes.nn.modules import _convert_weight_packed_for_cpu_inverse

            data, state = _convert_weight_packed_for_cpu_inverse(module.weight.data, module.weight.quant_state)
            module.weight.data = data
            module.weight.quant_state = state
            if getattr(module, "quant_state", None) is not None:
                module.quant_state = state
            restored += 1
    return restored


# -- values ---------------------------------------------------------------------------------------------------------
def compute_dtype(module) -> torch.dtype:
    """The dtype the layer's weight dequantizes to (bitsandbytes' ``quant_state.dtype``)."""
    return module.weight.quant_state.dtype


def dequantize(module, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The dense weight of a 4-bit layer (``[out, in]``), as its forward computes with it; ``dtype`` casts."""
    if _packed_for_cpu(module):
        raise RuntimeError(
            "a 4-bit weight was repacked in place for bitsandbytes' CPU inference kernel (an eval-mode forward on an "
            "AVX512-BF16 CPU); its dequantization would be garbage. Call trl_fp8.fourbit.guard_cpu_repack(model) "
            "before any forward."
        )
    import bitsandbytes.functional as F

    weight = F.dequantize_4bit(module.weight.data, module.weight.quant_state)
    return weight if dtype is None or weight.dtype == dtype else weight.to(dtype)


def block_absmax(state) -> torch.Tensor:
    """Per-block absmax (fp32) of a 4-bit quant state, double quantization undone."""
    absmax = state.absmax
    if state.nested:
        import bitsandbytes.functional as F

        absmax = F.dequantize_blockwise(absmax, state.state2) + state.offset
    return absmax.float()


def codes(module) -> torch.Tensor:
    """The 4-bit code indices (0..15) of every weight element, in row-major order of the ``[out, in]`` weight."""
    packed = module.weight.data.reshape(-1)
    if packed.dtype != torch.uint8:
        packed = packed.view(torch.uint8)
    out = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)
    numel = module.weight.quant_state.shape.numel()
    return out[:numel].long()


def code_table(module) -> torch.Tensor:
    """The 16 values of the layer's 4-bit data type (NF4 or FP4), in [-1, 1], indexed by code."""
    state = module.weight.quant_state
    table = getattr(state, "code", None)
    if table is None or table.numel() != 16:
        import bitsandbytes.functional as F

        table = F.get_4bit_type(state.quant_type, device="cpu")
    return table.float().cpu()


def weight_shape(module) -> torch.Size:
    return module.weight.quant_state.shape


# -- LoRA over a 4-bit base ---------------------------------------------------------------------------------------
def lora_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every PEFT LoRA layer of ``model`` whose base layer is a bitsandbytes 4-bit linear (with its name)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return []
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer) and is_4bit(m.get_base_layer())]


@torch.no_grad()
def lora_delta(layer, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """Σ over the active adapters of ``B @ A * scaling``, computed in fp32 from the factors (``[out, in]``), cast to
    ``dtype``; None when no active adapter has factors in this layer. PEFT's ``get_delta_weight`` computes in the
    factors' dtype (bf16 under TRL's QLoRA); this computes in fp32 for every factor dtype."""
    delta = None
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A:
            continue
        a = layer.lora_A[adapter].weight.float()
        b = layer.lora_B[adapter].weight.float()
        d = (b @ a) * float(layer.scaling[adapter])
        if getattr(layer, "fan_in_fan_out", False):
            d = d.t()
        delta = d if delta is None else delta + d
    return None if delta is None else delta.to(dtype)


@torch.no_grad()
def merged_weight(layer) -> torch.Tensor:
    """``W + ΔW`` of a LoRA layer in fp32 (``W``: dequantized for a 4-bit base), never written anywhere: what a dense
    copy, the rollout cache and a 16-bit engine hold for this layer."""
    base = layer.get_base_layer()
    weight = dequantize(base, torch.float32) if is_4bit(base) else base.weight.detach().float()
    delta = lora_delta(layer)
    return weight if delta is None else weight + delta.to(weight.device)


class DenseBase(torch.nn.Module):
    """A frozen dense linear standing in for a 4-bit one: the same ``weight`` values bitsandbytes dequantizes to,
    computed as its forward computes (input cast to the layer's compute dtype, ``linear(x, W, bias)``, output cast
    back to the input's dtype), with no dequantization."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, name: str = "",
                 compute_dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.compute_dtype = compute_dtype  # None: compute in the input's dtype
        self.source = name

    @classmethod
    def from_4bit(cls, module, name: str = "") -> DenseBase:
        compute = module.compute_dtype if getattr(module, "compute_type_is_set", False) else None
        return cls(dequantize(module), module.bias, name, compute)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xc = x if self.compute_dtype is None or x.dtype == self.compute_dtype else x.to(self.compute_dtype)
        weight = self.weight if self.weight.dtype == xc.dtype else self.weight.to(xc.dtype)
        bias = self.bias if self.bias is None or self.bias.dtype == xc.dtype else self.bias.to(xc.dtype)
        y = torch.nn.functional.linear(xc, weight, bias)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.weight.dtype}"


@torch.no_grad()
def densify(model: torch.nn.Module) -> int:
    """Replace every 4-bit linear of ``model`` (in place) by a :class:`DenseBase` holding its dequantized weight.
    For a copy that must compute without bitsandbytes (e.g. a served twin). Returns the number replaced."""
    targets = [(n, m) for n, m in model.named_modules() if is_4bit(m)]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, DenseBase.from_4bit(module, name))
    return len(targets)


@torch.no_grad()
def unload_dense(model: torch.nn.Module) -> int:
    """In place (on a copy: this consumes the adapters): replace every LoRA layer whose base is 4-bit (or a
    :class:`DenseBase`) by a :class:`DenseBase` holding ``dequant(W) + ΔW`` computed in fp32 — the exact merge PEFT
    cannot do into a 4-bit weight — then densify any 4-bit layer left. PEFT's ``merge_and_unload`` then merges the
    remaining (dense) LoRA layers exactly. Returns the number of LoRA layers unloaded."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return 0
    targets = [(n, m) for n, m in model.named_modules()
               if isinstance(m, LoraLayer) and (is_4bit(m.get_base_layer()) or isinstance(m.get_base_layer(), DenseBase))]
    for name, layer in targets:
        base = layer.get_base_layer()
        weight = merged_weight(layer)
        dtype = compute_dtype(base) if is_4bit(base) else base.weight.dtype
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        compute = getattr(base, "compute_dtype", None) if getattr(base, "compute_type_is_set", True) else None
        setattr(parent, child, DenseBase(weight.to(dtype), base.bias, name, compute))
    densify(model)
    return len(targets)

"""Numerics as data: what format a served tensor is in, and the one quantizer that interprets it.

A :class:`TensorSpec` is the frozen description of one tensor as a sampler computes with it: storage dtype,
quantization format (``"dense"`` or ``"mxfp8"``), block size, scale dtype and scale rounding, whether the layer was
deliberately excluded from quantization, the kernel path, and the cast the sampler's load applies to what it is sent
(``"none"``: the bits arrive in the served dtype; ``"rtn"``: the load rounds to nearest). Capabilities contribute
specs for the tensors they own (Fair Cast: the served dtype; MXFP8: the quantized linears); the weight-sync checks
compare the learner's specs with the sampler's and apply :func:`quantize` to the learner's tensors to get what the
sampler must compute with. This module imports nothing from trl_fp8: every package may depend on it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace

import torch

MX_BLOCK_SIZE = 32
MX_ELEMENT_DTYPE = torch.float8_e4m3fn
MX_SCALE_ROUNDINGS = ("rceil", "floor")
FORMATS = ("dense", "mxfp8", "engine")  # "engine": quantized by an inference engine's own method (named in kernel)
CASTS = ("none", "rtn")


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` (or ``"torch.bfloat16"``, or ``"bfloat16"``) -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name) -> torch.dtype:
    """``"bfloat16"`` / ``"torch.bfloat16"`` / ``torch.bfloat16`` -> ``torch.bfloat16``; a clear error otherwise."""
    if isinstance(name, torch.dtype):
        return name
    known = _DTYPES.get(name) if isinstance(name, str) else None  # the checks ask per tensor and per sync
    if known is not None:
        return known
    value = getattr(torch, dtype_name(name), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype name (e.g. 'bfloat16', 'float16', 'float32').")
    if isinstance(name, str):
        _DTYPES[name] = value
    return value


_DTYPES: dict[str, torch.dtype] = {}  # names already resolved by torch_dtype


@dataclass(frozen=True)
class TensorSpec:
    dtype: str
    format: str = "dense"
    block_size: int | None = None
    scale_dtype: str | None = None
    scale_rounding: str | None = None
    excluded: bool = False
    kernel: str = "dense"
    cast: str = "none"

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"TensorSpec.format={self.format!r} is not valid; allowed: {', '.join(FORMATS)}.")
        if self.cast not in CASTS:
            raise ValueError(f"TensorSpec.cast={self.cast!r} is not valid; allowed: {', '.join(CASTS)}.")
        if self.format == "mxfp8" and self.scale_rounding not in MX_SCALE_ROUNDINGS:
            raise ValueError(f"an MXFP8 TensorSpec needs scale_rounding in {MX_SCALE_ROUNDINGS}, got "
                             f"{self.scale_rounding!r}.")

    def with_(self, **changes) -> TensorSpec:
        return replace(self, **changes)

    def as_dict(self) -> dict:
        return asdict(self)


def dense(dtype, cast: str = "none", excluded: bool = False) -> TensorSpec:
    """The spec of a plain (unquantized) tensor stored in ``dtype`` (one shared frozen spec per combination: a
    sampler's recipe is rebuilt per weight version, a spec per tensor)."""
    return _dense(dtype_name(dtype), cast, excluded)


@functools.lru_cache(maxsize=256)
def _dense(dtype: str, cast: str, excluded: bool) -> TensorSpec:
    return TensorSpec(dtype=dtype, cast=cast, excluded=excluded)


def mxfp8(dtype, scale_rounding: str = "rceil", kernel: str = "emulated") -> TensorSpec:
    """The spec of an MXFP8 linear weight: e4m3 elements, one E8M0 scale per 32 elements of the reduction dim."""
    return TensorSpec(dtype=dtype_name(dtype), format="mxfp8", block_size=MX_BLOCK_SIZE, scale_dtype="e8m0",
                      scale_rounding=scale_rounding, kernel=f"mxfp8-{kernel}")


def _mx_ops():
    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
    except ImportError as err:  # pragma: no cover - torchao is a dependency
        raise ImportError(f"MXFP8 numerics need torchao >= 0.18: {err}") from err
    return ScaleCalculationMode, to_mx, to_dtype


def mx_fake_quantize(weight: torch.Tensor, rounding: str = "rceil", block_size: int = MX_BLOCK_SIZE) -> torch.Tensor:
    """MXFP8 quantize-dequantize along the last dimension (blocks of ``block_size``), back in ``weight``'s dtype."""
    if rounding not in MX_SCALE_ROUNDINGS:
        raise ValueError(f"MXFP8 scale rounding {rounding!r} is not valid; allowed: {', '.join(MX_SCALE_ROUNDINGS)}.")
    modes, to_mx, to_dtype = _mx_ops()
    w = weight.detach().contiguous()
    scale, data = to_mx(w, MX_ELEMENT_DTYPE, block_size, getattr(modes, rounding.upper()))
    return to_dtype(data, scale, MX_ELEMENT_DTYPE, block_size, w.dtype)


def quantize(tensor: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """What a sampler following ``spec`` computes with when it is sent ``tensor``: the load's cast to the spec's
    dtype, then the spec's quantizer (quantize-dequantize) where it has one. A dense tensor already in the spec's
    dtype is returned as it is (the same object)."""
    out = tensor.detach() if tensor.requires_grad else tensor
    target = torch_dtype(spec.dtype)
    if out.dtype != target:
        out = out.to(target)
    if spec.format == "mxfp8":
        return mx_fake_quantize(out, spec.scale_rounding, spec.block_size)
    if spec.format == "engine":
        raise ValueError(f"no reference quantizer for an engine-quantized tensor (method {spec.kernel!r}): the "
                         "learner side must describe what the engine computes in a format trl_fp8 implements.")
    return out


# -- computing the way a sampler computes (the logprob check's reference) ------------------------------------------
# A reference forward needs no second model: the served twin with the learner's export in it, or the learner with its
# parameters cast to the engine's dtype, run with autocast off (every op in the dtype of the weights, as a model
# loaded in that dtype runs) and in eval mode (no dropout, as an inference engine decodes).
@contextlib.contextmanager
def parameters_replaced(model: torch.nn.Module, named: dict[str, torch.Tensor]):
    """Within the block, each parameter of ``model`` named in ``named`` (``named_parameters`` names) is that tensor,
    in every module that holds it (a tied weight is replaced under both names). Unknown names are a ``KeyError``."""
    params = dict(model.named_parameters())
    unknown = sorted(set(named) - set(params))
    if unknown:
        raise KeyError(f"not parameters of {type(model).__name__}: {unknown[:5]}")
    by_id = {id(params[n]): t for n, t in named.items()}
    saved = []
    try:
        for module in model.modules():
            for key, param in list(module._parameters.items()):
                if param is not None and id(param) in by_id:
                    saved.append((module, key, param))
                    module._parameters[key] = by_id[id(param)]
        yield model
    finally:
        for module, key, param in reversed(saved):
            module._parameters[key] = param


def cast_floating(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``name -> tensor`` in ``dtype`` for every floating tensor not already in it (what an engine in ``dtype`` holds
    when it is sent the learner's tensors); integer and packed tensors are left out (they stay as they are)."""
    return {n: t.detach().to(dtype) for n, t in named if t.is_floating_point() and t.dtype != dtype}


@contextlib.contextmanager
def sampler_precision(model: torch.nn.Module, device_type: str):
    """Autocast off and ``model`` in eval mode for the block (its mode restored after; a model in eval mode, as a
    served twin always is, is left as it is: setting a mode walks every module)."""
    was_training = model.training
    if was_training:
        model.eval()
    try:
        with torch.autocast(device_type, enabled=False):
            yield model
    finally:
        if was_training:
            model.train(True)

"""MXFP8 linear layers through torchao 0.18, and the reference quantizer both sides share.

MXFP8: float8_e4m3fn elements, one power-of-two (E8M0) scale per 1×32 block along the reduction dimension. The
learner's eligible ``nn.Linear`` layers are swapped, in the torchao idiom, for an ``MXFP8Linear`` built from them
(:meth:`from_linear`, like torchao's ``from_float`` constructors) that holds the *same* ``weight`` and ``bias``
Parameters, so optimizers, Fair Cast units and ``state_dict`` keys are untouched and checkpoints load back into
plain transformers. ``MXFP8Linear`` runs ``_to_mxfp8_then_scaled_mm`` — the same
function torchao's ``MXFP8TrainingOpConfig`` tensor subclass dispatches to — and then adds the bias, which the
0.18 tensor-subclass path drops (``F.linear(x, w, b)`` is overridden without ``b``; see the tests).

What a converted layer computes with is described as data (:func:`layer_spec` -> :class:`trl_fp8.numerics.TensorSpec`);
the quantizer both sides are checked against is :func:`trl_fp8.numerics.quantize`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

logger = logging.getLogger("trl_fp8.mxfp8")

from .. import numerics
from .declaration import DEFAULT_EXCLUDE, KERNELS  # noqa: F401 (re-exported)

BLOCK_SIZE = numerics.MX_BLOCK_SIZE
ROUNDINGS = numerics.MX_SCALE_ROUNDINGS


@dataclass(frozen=True)
class MXRecipe:
    rounding: str = "rceil"  # E8M0 scale rounding: "rceil" (torchao >= 0.17, vLLM, TE) or "floor" (OCP MX 1.0)
    kernel: str = "emulated"  # "emulated" (PyTorch ops, any device) or "sm100" (Blackwell kernels)

    def __post_init__(self):
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"MXFP8 scale rounding {self.rounding!r} is not valid; allowed: {', '.join(ROUNDINGS)}")
        if self.kernel not in ("emulated", "sm100"):
            raise ValueError(f"MXFP8 kernel {self.kernel!r} is not valid; allowed: 'emulated', 'sm100'")

    def spec(self, dtype) -> numerics.TensorSpec:
        """What a layer converted with this recipe computes with, for weights stored in ``dtype``."""
        return numerics.mxfp8(dtype, self.rounding, self.kernel)


def _torchao():
    try:
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
        from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
    except ImportError as err:  # pragma: no cover - torchao is a dependency
        raise ImportError(f"mxfp8=True needs torchao >= 0.18 (torchao.prototype.moe_training): {err}") from err
    return dict(MXFP8TrainingOpConfig=MXFP8TrainingOpConfig, MXFP8TrainingRecipe=MXFP8TrainingRecipe,
                MXFP8Linear=MXFP8Linear, ScaleCalculationMode=ScaleCalculationMode, KernelPreference=KernelPreference)


_LINEAR_CLASS = None


def mxfp8_linear_class():
    """torchao's ``MXFP8Linear`` with two additions. Under autocast (``bf16=True``) the weight and the input are
    cast to the autocast dtype first, as autocast does for a plain linear (torchao's emulated matmul otherwise
    fails on a bf16 input against an fp32 master weight). And the token count is padded to a multiple of 32 with
    zero rows: torchao's backward quantizes the weight gradient in 32-token blocks and asserts on any other count
    (a GRPO micro-batch has rows × sequence length tokens). The GEMM itself is torchao's."""
    global _LINEAR_CLASS
    if _LINEAR_CLASS is None:
        ao = _torchao()
        from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm

        class TrlFp8MXFP8Linear(ao["MXFP8Linear"]):
            @classmethod
            def from_linear(cls, linear: nn.Linear, config) -> TrlFp8MXFP8Linear:
                """An MXFP8 layer that computes with ``linear``'s own Parameters (no copy, no new storage)."""
                new = cls(linear.in_features, linear.out_features, bias=False, device="meta",
                          kernel_preference=config.kernel_preference,
                          scale_calculation_mode=config.scale_calculation_mode, wgrad_with_hp=config.wgrad_with_hp)
                new.weight = linear.weight
                new.bias = linear.bias
                new.train(linear.training)
                return new

            def forward(self, input: torch.Tensor) -> torch.Tensor:
                weight, kind = self.weight, input.device.type
                if torch.is_autocast_enabled(kind):
                    dtype = torch.get_autocast_dtype(kind)
                    input, weight = input.to(dtype), weight.to(dtype)
                elif weight.dtype != input.dtype:
                    weight = weight.to(input.dtype)
                # The weight gradient quantizes along the token dimension in blocks of 32: pad the tokens with
                # zero rows (a zero row changes no block's scale and no real row's value), drop them after.
                shape = input.shape
                rows = input.reshape(-1, shape[-1])
                tokens = rows.size(0)
                if tokens % BLOCK_SIZE:
                    rows = torch.nn.functional.pad(rows, (0, 0, 0, BLOCK_SIZE - tokens % BLOCK_SIZE))
                with torch.autocast(kind, enabled=False):
                    output = _to_mxfp8_then_scaled_mm(
                        rows, weight, kernel_preference=self.kernel_preference,
                        scale_calculation_mode=self.scale_calculation_mode, wgrad_with_hp=self.wgrad_with_hp,
                    )
                output = output[:tokens].reshape(*shape[:-1], output.size(-1))
                if self.bias is not None:
                    output = output + self.bias.to(output.dtype)
                return output

        TrlFp8MXFP8Linear.__module__ = __name__
        _LINEAR_CLASS = TrlFp8MXFP8Linear
    return _LINEAR_CLASS


def torchao_config(recipe: MXRecipe):
    """torchao's ``MXFP8TrainingOpConfig`` for a recipe (from torchao's own named recipes where one matches)."""
    ao = _torchao()
    named = ao["MXFP8TrainingRecipe"]
    if recipe.rounding == "rceil":
        base = named.MXFP8_EMULATED_RCEIL if recipe.kernel == "emulated" else named.MXFP8_RCEIL
        return ao["MXFP8TrainingOpConfig"].from_recipe(base)
    kernel = ao["KernelPreference"].EMULATED if recipe.kernel == "emulated" else ao["KernelPreference"].AUTO
    return ao["MXFP8TrainingOpConfig"](kernel_preference=kernel,
                                       scale_calculation_mode=ao["ScaleCalculationMode"].FLOOR)


def sm100_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (10, 0)


def resolve_kernel(kernel: str) -> str:
    """``"auto"`` -> ``"sm100"`` on Blackwell, else ``"emulated"`` (logged once); ``"sm100"`` elsewhere raises."""
    if kernel not in KERNELS:
        raise ValueError(f"mxfp8_kernel={kernel!r} is not valid; allowed values: {', '.join(map(repr, KERNELS))}.")
    if kernel == "sm100" and not sm100_available():
        where = (f"a GPU with compute capability {torch.cuda.get_device_capability()}" if torch.cuda.is_available()
                 else "no CUDA device")
        raise ValueError(f"mxfp8_kernel='sm100' needs a Blackwell (SM100) GPU for the real MXFP8 kernels; this "
                         f"machine has {where}. Use mxfp8_kernel='emulated' (or 'auto').")
    if kernel == "auto":
        kernel = "sm100" if sm100_available() else "emulated"
        if kernel == "emulated":
            logger.info("MXFP8: no Blackwell (SM100) GPU here; using torchao's emulated kernels (exact MXFP8 "
                        "numerics, slower than bf16).")
    return kernel


def layer_recipe(module: nn.Module) -> MXRecipe | None:
    """The recipe of an MXFP8 linear layer (as converted by :func:`convert_linears`), else None."""
    ao = _torchao()
    if not isinstance(module, ao["MXFP8Linear"]):
        return None
    rounding = module.scale_calculation_mode.name.lower()
    kernel = "emulated" if module.kernel_preference == ao["KernelPreference"].EMULATED else "sm100"
    return MXRecipe(rounding=rounding, kernel=kernel)


def _is_adapter(name: str) -> bool:
    """PEFT adapter layers (``lora_A``, ``lora_B``, ...) stay in high precision and are not served layers."""
    return re.search(r"(^|\.)lora_[A-Za-z]+(\.|$)", name) is not None


def _excluded_by(name: str, patterns: Iterable[str]) -> str | None:
    for pattern in patterns:
        if re.search(pattern, name):
            return pattern
    return None


def convert_linears(model: nn.Module, recipe: MXRecipe, exclude: Iterable[str] = DEFAULT_EXCLUDE,
                    strict: bool = True) -> dict[str, list[str]]:
    """Turn the eligible ``nn.Linear`` layers of ``model`` into torchao ``MXFP8Linear`` in place.

    Excluded: names matching an ``exclude`` regex, and layers whose in/out features are not multiples of 32 (the
    forward blocks along in_features, the backward along out_features) — those stay in high precision with a
    warning that lists them. Returns ``{"converted": [...], "excluded": [...], "indivisible": [...]}``. With
    ``strict``, a model with nothing to convert is a ``ValueError``.
    """
    ao = _torchao()
    patterns = [re.compile(p) for p in exclude]
    config = torchao_config(recipe)
    report = {"converted": [], "excluded": [], "indivisible": []}
    swaps = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:  # plain linears only (LoRA wrappers keep their base_layer, converted)
            continue
        if _is_adapter(name):
            continue
        if _excluded_by(name, patterns):
            report["excluded"].append(name)
            continue
        if module.in_features % BLOCK_SIZE or module.out_features % BLOCK_SIZE:
            report["indivisible"].append(f"{name} ({module.out_features}×{module.in_features})")
            continue
        swaps.append((name, module))
        report["converted"].append(name)
    cls = mxfp8_linear_class()
    for name, module in swaps:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, cls.from_linear(module, config))
    if report["indivisible"]:
        logger.warning("MXFP8: %d linear layer(s) keep high precision, their dimensions are not multiples of %d: "
                       "%s", len(report["indivisible"]), BLOCK_SIZE, ", ".join(report["indivisible"]))
    if strict and not report["converted"]:
        raise ValueError(
            "mxfp8=True found no linear layer to convert: "
            + (f"excluded by mxfp8_exclude: {', '.join(report['excluded'][:8])}; " if report["excluded"] else "")
            + (f"dimensions not multiples of {BLOCK_SIZE}: {', '.join(report['indivisible'][:8])}; "
               if report["indivisible"] else "")
            + "the model has no eligible nn.Linear (MXFP8 applies to nn.Linear layers whose in/out features are "
            f"multiples of {BLOCK_SIZE})."
        )
    return report


def layer_spec(module: nn.Module) -> numerics.TensorSpec | None:
    """What an MXFP8 linear layer computes its weight with, as data; None for any other module."""
    recipe = layer_recipe(module)
    return recipe.spec(module.weight.dtype) if recipe is not None else None


def linear_specs(model: nn.Module) -> dict[str, numerics.TensorSpec]:
    """Per weight of every linear layer: its MXFP8 spec, or a dense spec marked ``excluded`` (kept high precision)."""
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or _is_adapter(name):
            continue
        spec = layer_spec(module)
        out[f"{name}.weight"] = spec if spec is not None else numerics.dense(module.weight.dtype, excluded=True)
    return out

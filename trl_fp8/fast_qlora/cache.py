"""The rollout dequant cache: the base is frozen while rollouts decode, so each LoRA-over-4-bit layer gets one dense
weight ``dequant(W) + ΔW`` per generation call, and decoding runs one plain matmul per linear instead of a
dequantization plus a LoRA side path per token.

The weights are built when a generation call starts (so they carry the adapters of the latest optimizer step),
used through an instance ``forward`` on each LoRA layer (names, parameters, optimizer references and hooks stay as
they are), and dropped when the call ends. Nothing is ever merged into the 4-bit weights. Layers beyond the byte
budget keep their usual path. LoRA dropout is not applied on the cached path: rollouts are decoded as an inference
engine (vLLM) decodes them, with the adapters' full delta.
"""

from __future__ import annotations

import contextlib
import math

import torch

from .. import fourbit


def _cached_forward(weight: torch.Tensor, bias: torch.Tensor | None):
    def forward(x, *args, **kwargs):
        y = torch.nn.functional.linear(x.to(weight.dtype), weight, bias)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    return forward


def dense_weight_bytes(layer, dtype: torch.dtype) -> int:
    """Bytes of one dense ``[out, in]`` weight (plus bias) of a LoRA layer's base in ``dtype``."""
    base = layer.get_base_layer()
    shape = fourbit.weight_shape(base) if fourbit.is_4bit(base) else base.weight.shape
    size = torch.empty((), dtype=dtype).element_size()
    bias = base.bias.numel() if getattr(base, "bias", None) is not None else 0
    return (math.prod(shape) + bias) * size


class RolloutCache:
    """Dense ``dequant(W) + ΔW`` weights for the LoRA layers in ``layers`` (``(name, LoraLayer)``), within
    ``budget_bytes``, in ``dtype``, for the duration of :meth:`active`.

    ``on_dequant`` is called once per explicit dequantization (a cache build of a 4-bit base)."""

    def __init__(self, layers, budget_bytes: int, dtype: torch.dtype, on_dequant=None):
        self.layers = list(layers)
        self.budget_bytes = int(budget_bytes)
        self.dtype = dtype
        self.on_dequant = on_dequant
        self.bytes = 0  # of the weights held by the current (or last) generation call
        self.cached: list[str] = []
        self.builds = 0  # generation calls that built a cache

    def plan(self) -> list[tuple[str, object]]:
        """The layers that fit the budget, in model order (every layer costs the same per byte and per token)."""
        chosen, used = [], 0
        for name, layer in self.layers:
            cost = dense_weight_bytes(layer, self.dtype)
            if cost <= self.budget_bytes - used:
                chosen.append((name, layer))
                used += cost
        return chosen

    @torch.no_grad()
    def _weight(self, layer) -> tuple[torch.Tensor, torch.Tensor | None]:
        base = layer.get_base_layer()
        weight = fourbit.merged_weight(layer)
        if fourbit.is_4bit(base) and self.on_dequant is not None:  # a layer kept dense needs no dequantization
            self.on_dequant()
        bias = base.bias
        return weight.to(self.dtype), None if bias is None else bias.detach().to(self.dtype)

    @contextlib.contextmanager
    def active(self):
        planned = self.plan() if self.budget_bytes > 0 else []
        installed = []
        try:
            for name, layer in planned:
                if getattr(layer, "merged", False) or getattr(layer, "disable_adapters", False):
                    continue  # PEFT's own forward handles these states; never cache around them
                weight, bias = self._weight(layer)
                previous = vars(layer).get("forward")  # e.g. speed mode's base-only forward of a frozen layer
                layer.forward = _cached_forward(weight, bias)
                installed.append((name, layer, previous, weight.numel() * weight.element_size()
                                  + (0 if bias is None else bias.numel() * bias.element_size())))
            self.bytes = sum(entry[3] for entry in installed)
            self.cached = [entry[0] for entry in installed]
            if installed:
                self.builds += 1
            yield self
        finally:
            for _, layer, previous, _ in installed:  # the weights go with the closures
                if previous is None:
                    vars(layer).pop("forward", None)
                else:
                    layer.forward = previous

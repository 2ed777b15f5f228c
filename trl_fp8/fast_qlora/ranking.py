"""Which 4-bit layers to keep dense: a data-free NF4 error estimate and a byte budget (pure PyTorch).

Once a model is loaded in 4-bit its original weights are gone, so the reconstruction error is estimated from the
4-bit weights alone: a value that quantized to code ``c`` lay somewhere in ``c``'s bin (the interval of values
that round to it), taken uniform there, so its squared error is ``width(c)² / 12`` in units of the block's absmax:

    err² ≈ Σ_blocks absmax² · Σ_i width(code_i)² / 12,      relative error = sqrt(err² / ‖dequant(W)‖²)

The extreme codes ±1 are where each block's absmax element itself lands (exactly); their bin is the half-bin
toward zero. Layers are then kept greedily by relative error per byte of their dense copy, within the budget
(the source paper: the number of layers kept matters more than which).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def bin_widths(table: torch.Tensor) -> torch.Tensor:
    """Width of the interval of normalised values in [-1, 1] that round to each code of ``table`` (16 values)."""
    values, order = torch.sort(table.double())
    mids = (values[1:] + values[:-1]) / 2
    lower = torch.cat([values[:1], mids])  # the lowest code is -1: the block's absmax (negative) lands on it
    upper = torch.cat([mids, values[-1:]])
    widths = torch.empty_like(values)
    widths[order] = upper - lower
    return widths


def estimate_error(codes: torch.Tensor, absmax: torch.Tensor, table: torch.Tensor, blocksize: int) -> tuple[float, float]:
    """(estimated squared reconstruction error, squared norm of the dequantized weight) of one 4-bit tensor.

    ``codes``: code index per element (row-major, flat); ``absmax``: one scale per block of ``blocksize`` elements.
    """
    if codes.numel() == 0:
        return 0.0, 0.0
    blocks = absmax.double().repeat_interleave(blocksize)[: codes.numel()]
    widths = bin_widths(table)[codes]
    values = table.double()[codes] * blocks
    err2 = float((blocks.square() * widths.square() / 12).sum())
    norm2 = float(values.square().sum())
    return err2, norm2


def relative_error(err2: float, norm2: float) -> float:
    if norm2 <= 0:
        return float("inf") if err2 > 0 else 0.0
    return (err2 / norm2) ** 0.5


@dataclass(frozen=True)
class LayerCost:
    name: str
    rel_error: float  # estimated relative NF4 reconstruction error
    dense_bytes: int  # bytes of its dense copy


def select_within_budget(layers: list[LayerCost], budget_bytes: int) -> list[LayerCost]:
    """The layers to keep dense: highest relative error per byte first, each taken if it still fits the budget.
    Ties keep model order. Deterministic."""
    if budget_bytes <= 0:
        return []
    ranked = sorted(enumerate(layers), key=lambda il: (-(il[1].rel_error / il[1].dense_bytes), il[0]))
    chosen, used = [], 0
    for _, layer in ranked:
        if layer.dense_bytes <= budget_bytes - used:
            chosen.append(layer)
            used += layer.dense_bytes
    return chosen

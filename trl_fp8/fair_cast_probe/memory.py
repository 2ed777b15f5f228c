"""What the Fair Cast probe allocates: its row of the memory plan (``trl-fp8 plan``) — the sample's indices (int64)
and its values before the step (fp32), on the weights' device."""

from __future__ import annotations

from ..memory import PERSISTENT, Row
from .core import ELEMENTS, TENSORS, sample_sizes


def memory_rows(spec) -> list[Row]:
    # off where the trained weights are 16-bit (no fp32 master): TRL's bf16 QLoRA factors, a 16-bit full model
    if (spec.adapter_bytes if spec.lora is not None else spec.base_bytes) != 4:
        return []
    if spec.lora is not None:
        trained = [t.numel for t in spec.lora.tensors(spec.arch)]
    else:
        trained = [t.numel for t in spec.arch.tensors()]
    sampled = sum(sample_sizes(trained))
    return [Row("Fair Cast probe (sampled indices and values)", 12 * sampled,
                f"12 B × {sampled:,} sampled elements (≤ {ELEMENTS} from each of ≤ {TENSORS} trained tensors)",
                PERSISTENT, "fair_cast_probe", None)]

"""What MXFP8 allocates: its rows of the memory plan (``trl-fp8 plan``). A pure function of the plan's spec.

The converted layers compute with the linears' own parameters (no copy, no new storage). Each forward quantizes the
layer's weight to e4m3 with one E8M0 scale per 32 elements (1 + 1/32 B per element), and backward quantizes it again
along the other axis: a transient of about twice that for the layer in flight. The plan's activation rows count the
16-bit path (what torchao saves for backward is not measured here): an estimate for MXFP8 runs.
"""

from __future__ import annotations

from ..memory import PERSISTENT, TRAINING, Row, per


def memory_rows(spec) -> list[Row]:
    largest = spec.largest_linear()
    return [
        Row("MXFP8 layers (compute with the parameters themselves)", 0, "0 B", PERSISTENT, "mxfp8", "mxfp8/state"),
        Row("MXFP8 weight quantization scratch (layer in flight)", int(2 * (1 + 1 / 32) * largest),
            per(2 * (1 + 1 / 32), "params of the largest projection", largest), TRAINING, "mxfp8", exact=False),
    ]

"""Exact byte counts the plan is built on: bitsandbytes' 4-bit storage, LoRA factors, Fair Cast's metric sample."""

import pytest
import torch

from trl_fp8.fair_cast.memory import METRIC_ELEMENTS, metric_subset_sizes
from trl_fp8.plan.models import MODELS
from trl_fp8.plan.spec import LoraSpec, QuantSpec


def test_nf4_bytes_of_one_qwen25_7b_mlp_projection_by_hand():
    # gate_proj of Qwen2.5-7B: 18944 × 3584 = 67,895,296 weights
    #   packed codes, two per uint8:            67,895,296 / 2       = 33,947,648 B
    #   double-quantized absmax, 1 B per block: 67,895,296 / 64      =  1,060,864 B
    #   nested fp32 absmax, one per 256 blocks: ceil(1,060,864/256)  =      4,144 × 4 = 16,576 B
    #   nested 256-entry fp32 code 1,024 B + fp32 offset 4 B + the 16-entry fp32 NF4 code 64 B = 1,092 B
    #   total 33,947,648 + 1,060,864 + 16,576 + 1,092 = 35,026,180 B (0.516 B per weight)
    n = 18944 * 3584
    assert QuantSpec().weight_bytes(n) == 35_026_180
    # without double quantization: fp32 absmax per block: 33,947,648 + 4 × 1,060,864 + 64 = 38,191,168
    assert QuantSpec(double_quant=False).weight_bytes(n) == 38_191_168


@pytest.mark.parametrize("double_quant, expected", [(True, 4264), (False, 3520)])
def test_nf4_bytes_equal_what_bitsandbytes_stores(double_quant, expected):
    # a 96 × 64 layer (6,144 weights): 3,072 B of codes; 96 blocks: 96 B + one nested fp32 (4 B) + 1,024 + 4 + 64
    # = 4,264 B with double quant; 3,072 + 96 × 4 + 64 = 3,520 B without
    from tests.fast_qlora.conftest import make_4bit_linear
    from trl_fp8.memory import StorageCounter, quant_state_tensors

    layer, _ = make_4bit_linear(96, 64, bias=False, double_quant=double_quant)
    counter = StorageCounter()
    counter.add("base", [layer.weight] + quant_state_tensors(layer.weight))
    assert counter.bytes["base"] == QuantSpec(double_quant=double_quant).weight_bytes(96 * 64) == expected


def test_lora_factors_of_qwen25_7b():
    # per block, r × (in + out) for q (3584+3584), k and v (3584+512 each), o (3584+3584), gate and up
    # (3584+18944 each), down (18944+3584): r × 90,112; × 16 × 28 blocks = 40,370,176
    assert LoraSpec(16).params(MODELS["qwen2.5-7b"]) == 16 * 90_112 * 28 == 40_370_176
    assert LoraSpec(8, ("q_proj", "v_proj")).params(MODELS["qwen2.5-7b"]) == 8 * (7168 + 4096) * 28


def test_metric_sample_sizes_follow_fair_cast():
    from trl_fp8.fair_cast import served

    assert served.METRIC_ELEMENTS is METRIC_ELEMENTS  # one home: fair_cast.memory
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (5, 1000, 70000)]
    copy = served.ServedCopy.from_named_params([(str(i), p) for i, p in enumerate(params)], "rtn")
    assert [len(copy._subset[str(i)]) for i in range(3)] == metric_subset_sizes([5, 1000, 70000])

"""The probe's arithmetic: the share of a step's update that round-to-nearest into the served dtype drops, exact on
hand-built updates (values on the bf16 grid, steps below and above half an ulp)."""

import pytest
import torch

from trl_fp8.fair_cast_probe.core import DroppedShare, chosen, sample_sizes


def _probe(values, dtype=torch.bfloat16, **kwargs):
    p = torch.nn.Parameter(torch.tensor(values, dtype=torch.float32))
    return p, DroppedShare([("w", p)], dtype, **kwargs)


def test_the_share_is_the_update_mass_whose_rounded_value_did_not_move():
    # 1.0 on the bf16 grid: the next value up is 1 + 2**-7, down 1 - 2**-8. A step up of less than 2**-8 rounds back
    # to 1 (dropped); 2**-6 up and 2**-7 down move it. Binary fractions: every difference is exact in fp32.
    p, probe = _probe([1.0, 1.0, 1.0, 1.0])
    probe.begin()
    with torch.no_grad():
        p.add_(torch.tensor([2 ** -9, 2 ** -10, 2 ** -6, -(2 ** -7)]))
    assert probe.end() == pytest.approx((2 ** -9 + 2 ** -10) / (2 ** -9 + 2 ** -10 + 2 ** -6 + 2 ** -7), rel=1e-12)


def test_the_served_dtype_sets_the_grid():
    # fp16: ulp(1) = 2**-10, half an ulp 2**-11: 3 * 2**-12 moves the rounded value, 2**-12 does not; in bf16 neither
    p, probe = _probe([1.0, 1.0], dtype=torch.float16)
    probe.begin()
    with torch.no_grad():
        p.add_(torch.tensor([3 * 2 ** -12, 2 ** -12]))
    assert probe.end() == 0.25
    p, probe = _probe([1.0, 1.0], dtype=torch.bfloat16)
    probe.begin()
    with torch.no_grad():
        p.add_(torch.tensor([3 * 2 ** -12, 2 ** -12]))
    assert probe.end() == 1.0


def test_an_update_across_a_rounding_boundary_is_not_dropped_however_small():
    # just below the midpoint between 1 and 1 + 2**-7: a tiny step across it moves the rounded value
    mid = 1 + 2 ** -8
    p, probe = _probe([mid - 2 ** -20])
    probe.begin()
    with torch.no_grad():
        p.add_(2 ** -19)
    assert probe.end() == 0.0


def test_no_update_gives_no_reading_not_a_ratio_of_zeros():
    p, probe = _probe([1.0, 2.0])
    assert probe.end() is None  # no begin
    probe.begin()
    assert probe.end() is None  # nothing moved


def test_a_fixed_sample_spread_over_the_tensors():
    assert chosen(5, 64) == [0, 1, 2, 3, 4]
    picked = chosen(200, 64)
    assert len(picked) == 64 and picked[0] == 0 and picked[-1] == 199
    assert sample_sizes([10, 10_000], elements=4096) == [10, 4096]
    params = [(f"w{i}", torch.nn.Parameter(torch.zeros(50, 100))) for i in range(3)]
    probe = DroppedShare(params, elements=1000, tensors=2, seed=3)
    assert [name for name, _, _ in probe.samples] == ["w0", "w2"] and probe.elements == 2000
    again = DroppedShare(params, elements=1000, tensors=2, seed=3)
    assert all(torch.equal(a[2], b[2]) for a, b in zip(probe.samples, again.samples))  # the same elements


def test_a_served_dtype_that_is_not_16_bit_is_refused():
    with pytest.raises(ValueError, match="served dtype must be torch.bfloat16 or torch.float16"):
        DroppedShare([("w", torch.nn.Parameter(torch.zeros(3)))], torch.float32)


def test_the_plan_counts_the_probe_only_where_it_runs():
    from trl_fp8.plan.plan import make_spec, plan_args
    from trl_fp8.fair_cast_probe.memory import memory_rows

    lora16 = make_spec("qwen2.5-1.5b", plan_args(fair_cast="off"), peft=16, device="t4")  # fp32 factors
    qlora = make_spec("qwen2.5-1.5b", plan_args(fair_cast="off"), peft=16, quantization="nf4", device="t4")
    rows = memory_rows(lora16)
    assert len(rows) == 1 and 0 < rows[0].bytes <= 12 * 64 * 4096
    assert memory_rows(qlora) == []  # TRL's bf16 QLoRA factors: the probe turns itself off

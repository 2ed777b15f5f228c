"""trl_fp8.fast_qlora.ranking: the data-free NF4 error estimate and the byte budget."""

import math

import pytest
import torch

from tests.fast_qlora.conftest import make_4bit_linear
from trl_fp8 import fourbit
from trl_fp8.fast_qlora.ranking import LayerCost, bin_widths, estimate_error, relative_error, select_within_budget


def test_bin_widths_tile_the_interval():
    table = torch.tensor([-1.0, -0.5, 0.0, 0.25, 1.0])
    # bins: [-1,-0.75], [-0.75,-0.25], [-0.25,0.125], [0.125,0.625], [0.625,1]
    torch.testing.assert_close(bin_widths(table), torch.tensor([0.25, 0.5, 0.375, 0.5, 0.375], dtype=torch.float64))
    shuffled = table[[3, 0, 4, 2, 1]]
    torch.testing.assert_close(bin_widths(shuffled), bin_widths(table)[[3, 0, 4, 2, 1]])
    assert bin_widths(table).sum().item() == pytest.approx(2.0)


def test_estimate_error_on_hand_computed_codes():
    table = torch.tensor([-1.0, 0.0, 1.0])  # widths 0.5, 1.0, 0.5
    codes = torch.tensor([0, 1, 2, 1])
    absmax = torch.tensor([2.0, 4.0])  # two blocks of 2
    err2, norm2 = estimate_error(codes, absmax, table, blocksize=2)
    assert err2 == pytest.approx((4 * 0.25 + 4 * 1.0 + 16 * 0.25 + 16 * 1.0) / 12)
    assert norm2 == pytest.approx(4.0 + 0.0 + 16.0 + 0.0)
    assert relative_error(err2, norm2) == pytest.approx(math.sqrt(err2 / norm2))
    assert relative_error(0.0, 0.0) == 0.0


def _true_and_estimated(layer, weight):
    state = layer.weight.quant_state
    err2, norm2 = estimate_error(fourbit.codes(layer), fourbit.block_absmax(state), fourbit.code_table(layer),
                                 state.blocksize)
    true = ((fourbit.dequantize(layer) - weight).norm() / weight.norm()).item()
    return true, relative_error(err2, norm2)


def test_estimate_tracks_the_true_nf4_error_and_ranks_layers_like_it():
    """Gaussian weights (~0.09 relative error) and heavier-tailed ones (outliers raise the block absmax)."""
    layers = []
    for seed, tail in enumerate([0.0, 0.0, 0.5, 1.0, 2.0, 4.0]):
        gen = torch.Generator().manual_seed(seed)
        layer, weight = make_4bit_linear(128, 128, bias=False, seed=seed)
        spikes = (torch.rand(weight.shape, generator=gen) < 0.01) * torch.randn(weight.shape, generator=gen) * tail * 4
        weight = weight + spikes
        import bitsandbytes as bnb

        layer.weight = bnb.nn.Params4bit(weight.clone(), requires_grad=False, quant_type="nf4")
        layer = layer.to("cpu")
        layers.append(_true_and_estimated(layer, weight))
    true, est = zip(*layers)
    assert 0.06 < true[0] < 0.12
    for t, e in layers:
        assert e == pytest.approx(t, rel=0.35)  # the uniform-in-bin model, not an exact error
    rank = lambda xs: sorted(range(len(xs)), key=lambda i: xs[i])  # noqa: E731
    assert rank(true)[-3:] == rank(est)[-3:]  # the worst layers are found


def test_select_within_budget_takes_error_per_byte_and_skips_what_does_not_fit():
    layers = [LayerCost("a", 0.10, 100), LayerCost("b", 0.30, 400), LayerCost("c", 0.12, 100), LayerCost("d", 0.5, 1000)]
    # per byte: a 1e-3, b 7.5e-4, c 1.2e-3, d 5e-4
    assert [c.name for c in select_within_budget(layers, 250)] == ["c", "a"]
    assert [c.name for c in select_within_budget(layers, 600)] == ["c", "a", "b"]
    assert [c.name for c in select_within_budget(layers, 1000)] == ["c", "a", "b"]  # d no longer fits
    assert [c.name for c in select_within_budget(layers, 1600)] == ["c", "a", "b", "d"]
    assert select_within_budget(layers, 0) == [] and select_within_budget(layers, 99) == []
    assert sum(c.dense_bytes for c in select_within_budget(layers, 1000)) <= 1000

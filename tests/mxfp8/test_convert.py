"""MXFP8 conversion (torchao 0.18, emulated) and the shared reference quantizer."""

import logging

import pytest
import torch
from torch import nn

from trl_fp8.mxfp8.convert import (
    BLOCK_SIZE, DEFAULT_EXCLUDE, MXRecipe, convert_linears, layer_recipe, layer_spec, linear_specs, resolve_kernel,
    torchao_config,
)
from trl_fp8.numerics import mx_fake_quantize as fake_quantize


def _mx_reference(x, w, b=None):
    out = fake_quantize(x) @ fake_quantize(w).T
    return out if b is None else out + b


def test_fake_quantize_is_mxfp8():
    torch.manual_seed(0)
    w = torch.randn(4, 64) * torch.logspace(-3, 2, 64)  # blocks with very different ranges
    q = fake_quantize(w)
    rel = ((q - w).abs() / w.abs().clamp_min(1e-12))[w.abs() > w.abs().amax(1, keepdim=True) / 8]
    assert rel.max() <= 2 ** -4 + 1e-6  # 3 mantissa bits: at most half an ulp of 2^-3
    assert torch.equal(fake_quantize(q), q)  # idempotent
    b = w.to(torch.bfloat16)
    assert torch.equal(fake_quantize(b).float(), fake_quantize(b.float()))  # same values whatever the dtype
    assert (fake_quantize(b, "floor") != fake_quantize(b, "rceil")).any()  # the scale rounding matters


def test_converted_linear_keeps_its_bias_which_torchao_s_tensor_subclass_drops():
    from torchao.quantization import quantize_

    torch.manual_seed(0)
    x = torch.randn(5, 64)
    ours, theirs = nn.Linear(64, 32), nn.Linear(64, 32)
    theirs.load_state_dict(ours.state_dict())
    weight, bias = ours.weight, ours.bias
    holder = nn.Sequential(ours)
    convert_linears(holder, MXRecipe())
    ours = holder[0]  # swapped for an MXFP8 module built from the linear (no __class__ assignment)
    assert type(ours).__name__ == "TrlFp8MXFP8Linear"
    assert ours.weight is weight and ours.bias is bias  # the same Parameters: optimizers and checkpoints unaffected
    torch.testing.assert_close(ours(x), _mx_reference(x, weight.detach(), bias.detach()), rtol=0, atol=1e-5)
    quantize_(nn.Sequential(theirs), torchao_config(MXRecipe()), filter_fn=lambda m, fqn: isinstance(m, nn.Linear))
    dropped = theirs(x).detach()
    torch.testing.assert_close(dropped, _mx_reference(x, weight.detach()), rtol=0, atol=1e-5)  # no bias added


def test_backward_runs_for_any_token_count_and_autocast_is_handled():
    torch.manual_seed(0)
    holder = nn.Sequential(nn.Linear(64, 32))
    convert_linears(holder, MXRecipe())
    lin = holder[0]
    for shape in ((4, 64), (3, 7, 64), (32, 64)):  # torchao alone asserts unless tokens % 32 == 0
        x = torch.randn(*shape, requires_grad=True)
        out = lin(x)
        assert out.shape == (*shape[:-1], 32)
        torch.testing.assert_close(out, _mx_reference(x.detach().reshape(-1, 64), lin.weight.detach(),
                                                      lin.bias.detach()).reshape(out.shape), rtol=0, atol=1e-5)
        lin.weight.grad = None
        out.sum().backward()
        assert lin.weight.grad is not None and x.grad is not None and torch.isfinite(lin.weight.grad).all()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(torch.randn(4, 64))
    assert y.dtype == torch.bfloat16


def test_exclusions_indivisible_layers_and_nothing_to_convert(caplog):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_proj = nn.Linear(64, 64)
            self.gate_proj = nn.Linear(64, 64)  # dense MLP gate: converted
            self.gate = nn.Linear(64, 32)  # MoE router: kept
            self.odd = nn.Linear(48, 64)  # in_features not a multiple of 32
            self.lm_head = nn.Linear(64, 128)

    model = Model()
    with caplog.at_level(logging.WARNING, logger="trl_fp8.mxfp8"):
        report = convert_linears(model, MXRecipe(), DEFAULT_EXCLUDE)
    assert report["converted"] == ["gate_proj"]
    assert report["excluded"] == ["embed_proj", "gate", "lm_head"]
    assert report["indivisible"] == ["odd (64×48)"]
    assert "keep high precision, their dimensions are not multiples of 32: odd (64×48)" in caplog.text
    specs = linear_specs(model)
    assert specs["gate_proj.weight"].format == "mxfp8" and specs["gate.weight"].excluded is True
    assert specs["gate.weight"].format == "dense"
    with pytest.raises(ValueError, match=r"found no linear layer to convert: excluded by mxfp8_exclude: lm_head; "
                                         r"dimensions not multiples of 32: odd"):
        convert_linears(nn.ModuleDict({"lm_head": nn.Linear(64, 64), "odd": nn.Linear(48, 64)}), MXRecipe())
    with pytest.raises(ValueError, match="the model has no eligible nn.Linear"):
        convert_linears(nn.Sequential(nn.LayerNorm(8)), MXRecipe())


def test_recipes_and_kernels():
    holder = nn.Sequential(nn.Linear(64, 64))
    convert_linears(holder, MXRecipe(rounding="floor"))
    lin = holder[0]
    assert layer_recipe(lin) == MXRecipe(rounding="floor", kernel="emulated")
    assert layer_recipe(nn.Linear(64, 64)) is None and layer_spec(nn.Linear(64, 64)) is None
    assert layer_spec(lin).as_dict() == {
        "dtype": "float32", "format": "mxfp8", "block_size": BLOCK_SIZE, "scale_dtype": "e8m0",
        "scale_rounding": "floor", "excluded": False, "kernel": "mxfp8-emulated", "cast": "none"}
    with pytest.raises(ValueError, match="scale rounding 'ceil' is not valid"):
        MXRecipe(rounding="ceil")
    if not torch.cuda.is_available():
        assert resolve_kernel("auto") == "emulated"
        with pytest.raises(ValueError, match=r"mxfp8_kernel='sm100' needs a Blackwell \(SM100\) GPU .* no CUDA device"):
            resolve_kernel("sm100")
    with pytest.raises(ValueError, match="mxfp8_kernel='fast' is not valid"):
        resolve_kernel("fast")

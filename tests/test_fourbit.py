"""trl_fp8.fourbit: codes, absmax and dequantization of bitsandbytes 4-bit layers, the CPU repack trap, DenseBase."""

import copy

import pytest
import torch

from tests.fast_qlora.conftest import load_4bit_demo, make_4bit_linear
from trl_fp8 import fourbit


@pytest.mark.parametrize("double_quant", [False, True])
def test_codes_absmax_and_table_reconstruct_the_dequantized_weight(double_quant):
    layer, _ = make_4bit_linear(double_quant=double_quant)
    state = layer.weight.quant_state
    values = fourbit.code_table(layer)[fourbit.codes(layer)]
    scales = fourbit.block_absmax(state).repeat_interleave(state.blocksize)[: values.numel()]
    torch.testing.assert_close((values * scales).reshape(state.shape), fourbit.dequantize(layer), rtol=0, atol=0)


def test_the_cpu_repack_trap_is_guarded_and_undone():
    if not fourbit._bnb().functional.has_avx512bf16():
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes never repacks here")
    layer, _ = make_4bit_linear()
    before = fourbit.dequantize(layer).clone()
    layer.eval()
    with torch.no_grad():
        layer(torch.randn(2, 64))  # bitsandbytes repacks the weight in place here
    assert fourbit._packed_for_cpu(layer)
    with pytest.raises(RuntimeError, match="guard_cpu_repack"):
        fourbit.dequantize(layer)
    holder = torch.nn.Sequential(layer)
    assert fourbit.guard_cpu_repack(holder) == 1
    # back in the canonical layout; the repack had rounded the block scales to bf16 (relative 2^-8 at most)
    torch.testing.assert_close(fourbit.dequantize(layer), before, rtol=2**-8, atol=0)
    with torch.no_grad():
        layer(torch.randn(2, 64))  # guarded: no repack any more
    assert not fourbit._packed_for_cpu(layer)
    layer.train()
    x = torch.randn(2, 64, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0  # gradients flow through the base again


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_base_computes_exactly_what_the_4bit_layer_computes(dtype):
    layer, _ = make_4bit_linear()
    fourbit.guard_cpu_repack(torch.nn.Sequential(layer))
    dense = fourbit.DenseBase.from_4bit(layer)
    x = torch.randn(5, 64, dtype=dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = layer(x1), dense(x2)
    assert y1.dtype == y2.dtype == dtype
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=0, atol=0)
    assert not dense.weight.requires_grad


def test_lora_delta_is_b_at_a_times_scaling_over_active_adapters():
    model = load_4bit_demo()
    name, layer = fourbit.lora_layers(model)[0]
    expected = layer.lora_B["default"].weight.float() @ layer.lora_A["default"].weight.float() * layer.scaling["default"]
    torch.testing.assert_close(fourbit.lora_delta(layer), expected, rtol=0, atol=0)
    assert len(fourbit.lora_layers(model)) == 14 and fourbit.has_4bit(model) and not fourbit.has_8bit(model)


def test_unload_dense_gives_the_exact_merged_model_without_touching_the_4bit_weights():
    model = load_4bit_demo()
    packed = {n: m.weight.data.clone() for n, m in model.named_modules() if fourbit.is_4bit(m)}
    twin = copy.deepcopy(model)
    assert fourbit.unload_dense(twin) == 14
    merged = twin.merge_and_unload()
    assert not fourbit.has_4bit(merged)
    ids = torch.randint(2, 100, (2, 12))
    model.eval(), merged.eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)
    for n, m in model.named_modules():
        if fourbit.is_4bit(m):
            assert torch.equal(m.weight.data, packed[n])  # nothing merged into the 4-bit weights

"""trl_fp8.fast_qlora.cache: the rollout dequant cache (values, budget, lifetime, dropout) and the dequant counter."""

import pytest
import torch

from tests.fast_qlora.conftest import load_4bit_demo
from trl_fp8 import fourbit
from trl_fp8.fast_qlora.cache import RolloutCache, dense_weight_bytes
from trl_fp8.fast_qlora.counters import DequantCounter


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_fp32_cache_computes_the_lora_forward_with_one_matmul_per_linear():
    model = load_4bit_demo()
    model.eval()
    ids = torch.randint(2, 100, (3, 10))
    reference = _logits(model, ids)
    layers = fourbit.lora_layers(model)
    counter = DequantCounter()
    assert counter.attach(model) == 14
    cache = RolloutCache(layers, 10**9, torch.float32, on_dequant=counter.count_explicit)
    with cache.active():
        assert all("forward" in vars(layer) for _, layer in layers)
        cached = _logits(model, ids)
    assert counter.forward == 0 and counter.explicit == 14  # one build per layer, no 4-bit forward
    torch.testing.assert_close(cached, reference, rtol=1e-5, atol=1e-5)
    assert cache.bytes == sum(dense_weight_bytes(layer, torch.float32) for _, layer in layers)


def test_cache_is_freed_after_the_call_and_rebuilt_with_the_current_adapters():
    model = load_4bit_demo()
    model.eval()
    layers = fourbit.lora_layers(model)
    cache = RolloutCache(layers, 10**9, torch.float32)
    ids = torch.randint(2, 100, (2, 8))
    with cache.active():
        first = _logits(model, ids)
    assert not any("forward" in vars(layer) for _, layer in layers)  # freed: PEFT's own forward again
    with torch.no_grad():  # an optimizer step changes the adapters
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(0.05)
    with cache.active():
        second = _logits(model, ids)
    torch.testing.assert_close(second, _logits(model, ids), rtol=1e-5, atol=1e-5)  # the new adapters
    assert not torch.allclose(first, second)
    assert cache.builds == 2


def test_layers_beyond_the_budget_keep_the_per_call_path():
    model = load_4bit_demo()
    layers = fourbit.lora_layers(model)
    sizes = [dense_weight_bytes(layer, torch.bfloat16) for _, layer in layers]
    budget = sum(sizes[:3])
    cache = RolloutCache(layers, budget, torch.bfloat16)
    with cache.active():
        cached = [name for name, layer in layers if "forward" in vars(layer)]
    assert cached == [name for name, _ in layers[:3]] and cache.bytes == budget
    with RolloutCache(layers, 0, torch.bfloat16).active() as empty:
        assert empty.bytes == 0 and not any("forward" in vars(layer) for _, layer in layers)


def test_dropout_is_not_applied_on_the_cached_path():
    """TRL decodes with the model in train mode: PEFT applies LoRA dropout to every decoded token. The cache decodes as
    an inference engine does: the full delta, deterministic, equal to the eval-mode LoRA forward."""
    model = load_4bit_demo(dropout=0.5)
    ids = torch.randint(2, 100, (2, 8))
    model.eval()
    eval_logits = _logits(model, ids)
    model.train()
    torch.manual_seed(0)
    a = _logits(model, ids)
    b = _logits(model, ids)
    assert not torch.allclose(a, b)  # PEFT's path: dropout active in train mode
    cache = RolloutCache(fourbit.lora_layers(model), 10**9, torch.float32)
    with cache.active():
        c, d = _logits(model, ids), _logits(model, ids)
    assert torch.equal(c, d)
    torch.testing.assert_close(c, eval_logits, rtol=1e-5, atol=1e-5)


def test_counter_counts_forwards_and_the_backwards_that_dequantize_again():
    model = load_4bit_demo()
    model.train()
    counter = DequantCounter()
    counter.attach(model)
    ids = torch.randint(2, 100, (2, 8))
    model.enable_input_require_grads()  # as TRL does with gradient checkpointing: gradients reach every base layer
    model(ids).logits.sum().backward()
    assert counter.forward == 14 and counter.backward == 14
    assert counter.reset() == {"forward": 14, "backward": 14, "explicit": 0, "total": 28}
    assert counter.total == 0
    counter.detach()
    with torch.no_grad():
        model(ids)
    assert counter.total == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_cache_stays_close(dtype):
    model = load_4bit_demo()
    model.eval()
    ids = torch.randint(2, 100, (2, 12))
    reference = torch.log_softmax(_logits(model, ids), -1)
    with RolloutCache(fourbit.lora_layers(model), 10**9, dtype).active():
        cached = torch.log_softmax(_logits(model, ids).float(), -1)
    gap = (cached - reference).abs()
    # the weights and activations of the linears rounded to 16 bits (bf16: 8 significant bits)
    assert gap.mean() < 0.01 and gap.max() < (0.2 if dtype == torch.bfloat16 else 0.05)

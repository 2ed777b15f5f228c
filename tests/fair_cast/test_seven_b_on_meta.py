"""A Qwen2.5-7B-shaped QLoRA policy goes through trl_fp8.GRPOTrainer's set-up on the meta device (config only, no
weights) with Fair Cast + the default checks + DUET, and nothing of a dense base layer's size is allocated beside the
base: no merged twin, no dense served copy, no fp32 copy of the base.

bitsandbytes cannot quantize on the meta device, so each decoder linear is a real ``bnb.nn.Linear4bit`` whose
``Params4bit`` holds meta tensors of the packed sizes (NF4 codes: numel/2 bytes; double-quantized block scales: one
uint8 per 64 weights, one fp32 per 256 blocks), marked quantized as bitsandbytes marks a loaded layer. Every tensor
created while the trainer is built is seen by a ``TorchDispatchMode`` (meta tensors go through the dispatcher like any
other), so a transient dense tensor would be caught as well as a kept one.

Fast QLoRA is off here: its layer ranking reads the 4-bit codes, which a meta tensor does not have (its own
allocations are bounded by ``qlora_keep_budget_gb`` and ``qlora_rollout_cache_gb``; see docs/will-it-fit.md).
"""

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import trl_fp8

bnb = pytest.importorskip("bitsandbytes")

# Qwen2.5-7B's config.json (architecture numbers only)
QWEN25_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                 tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=1e6)
SMALLEST_DENSE_LAYER = 512 * 3584  # k_proj / v_proj: 4 KV heads × 128 × hidden


def _meta_4bit(linear: torch.nn.Linear, compute_dtype=torch.bfloat16):
    from bitsandbytes.functional import QuantState

    out_f, in_f = linear.weight.shape
    n = out_f * in_f
    blocks = n // 64
    layer = bnb.nn.Linear4bit(in_f, out_f, bias=linear.bias is not None, compute_dtype=compute_dtype,
                              quant_type="nf4", compress_statistics=True, device="meta")
    nested = QuantState(absmax=torch.empty(-(-blocks // 256), dtype=torch.float32, device="meta"),
                        code=torch.empty(256, device="meta"), blocksize=256, dtype=torch.float32)
    state = QuantState(absmax=torch.empty(blocks, dtype=torch.uint8, device="meta"), shape=torch.Size([out_f, in_f]),
                       code=torch.empty(16, device="meta"), blocksize=64, quant_type="nf4", dtype=compute_dtype,
                       offset=torch.empty((), device="meta"), state2=nested)
    layer.weight = bnb.nn.Params4bit(torch.empty(n // 2, 1, dtype=torch.uint8, device="meta"), requires_grad=False,
                                     quant_state=state, quant_type="nf4", bnb_quantized=True,
                                     compress_statistics=True, blocksize=64)
    if linear.bias is not None:
        layer.bias = linear.bias
    return layer


def meta_qlora_7b(embedding_dtype=torch.bfloat16):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils.quantization_config import QuantizationMethod

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**QWEN25_7B)).to(embedding_dtype)
    for module in list(model.model.layers.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(module, name, _meta_4bit(child))
    model.is_loaded_in_4bit = True  # as from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True))
    model.quantization_method = QuantizationMethod.BITS_AND_BYTES
    return model


class DenseAllocations(TorchDispatchMode):
    """Every tensor produced while active with at least ``threshold`` elements (op, shape, dtype)."""

    def __init__(self, threshold: int):
        super().__init__()
        self.threshold = threshold
        self.seen = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() >= self.threshold:
                self.seen[(str(func), tuple(t.shape), t.dtype)] += 1
        return out


def _build(tmp_path, model, **overrides):
    from peft import LoraConfig

    from trl_fp8.app.tasks.arithmetic import correctness_reward, make_arithmetic_dataset
    from trl_fp8.tokenization import build_char_tokenizer

    kwargs = dict(output_dir=str(tmp_path / "run"), use_cpu=True, bf16=True, fair_cast="stochastic", duet=True,
                  num_generations=8, per_device_train_batch_size=8, max_completion_length=512, report_to="none",
                  gradient_checkpointing=True, save_strategy="no", disable_tqdm=True)
    kwargs.update(overrides)
    return trl_fp8.GRPOTrainer(model=model, reward_funcs=[correctness_reward], args=trl_fp8.GRPOConfig(**kwargs),
                               train_dataset=make_arithmetic_dataset(16), processing_class=build_char_tokenizer(),
                               peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))


@pytest.mark.slow
def test_a_7b_qlora_policy_with_fair_cast_checks_and_duet_allocates_no_dense_twin(tmp_path):
    model = meta_qlora_7b()
    with DenseAllocations(SMALLEST_DENSE_LAYER) as dense:
        trainer = _build(tmp_path, model)
    assert not dense.seen, dense.seen.most_common(5)  # nothing of a dense layer's size, not even for a moment
    assert {"fair_cast", "duet"} <= set(trainer.capabilities)
    # the checks: in-process, the sampler *is* the learner (base as loaded + served factors): nothing to compare,
    # so they stand down (with vLLM they observe the adapter stream)
    assert "sync_checks" not in trainer.capabilities
    fair_cast = trainer.capability("fair_cast")
    assert fair_cast.adapters and fair_cast.sampler is None
    factors = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    adapter_params = sum(p.numel() for p in factors.values())
    assert adapter_params == 40_370_176  # r=16 on the 7 projections of 28 blocks: 16·Σ(in+out) per block × 28
    assert all(p.dtype == torch.float32 for p in factors.values())  # fp32 masters (TRL's QLoRA keeps bf16)
    served = fair_cast.served
    held = [*served.served.values(), *served.residual.values(), *(u.stored for u in served.units.values())]
    assert max(t.numel() for t in held) < SMALLEST_DENSE_LAYER
    held_bytes = sum(t.numel() * t.element_size() for t in held)
    assert held_bytes == adapter_params * (4 + 2)  # SR: fp32 master + bf16 served factor, nothing per base parameter
    packed = sum(p.numel() for n, p in trainer.model.named_parameters() if p.dtype == torch.uint8)
    assert packed == sum(m.weight.quant_state.shape.numel() // 2 for m in trainer.model.modules()
                         if isinstance(m, bnb.nn.Linear4bit))  # the base: still the 4-bit codes, never dequantized


def test_the_detector_sees_a_dense_layer_made_on_the_meta_device():
    """The control: a tensor of a dense layer's size made on the meta device (as merged serving's served buffers
    are, one per merged layer) goes through the dispatcher and is reported; a factor-sized one is not."""
    with DenseAllocations(SMALLEST_DENSE_LAYER) as dense:
        torch.empty(16, 18944, device="meta")
        torch.empty(512, 3584, dtype=torch.bfloat16, device="meta").float()
    assert set(dense.seen) == {("aten.empty.memory_format", (512, 3584), torch.bfloat16),
                               ("aten._to_copy.default", (512, 3584), torch.float32)}, dense.seen

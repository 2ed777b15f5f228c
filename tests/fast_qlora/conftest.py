"""Small bitsandbytes 4-bit layers and 4-bit LoRA policies, built locally on CPU."""

import pytest
import torch


def make_4bit_linear(out_features=96, in_features=64, bias=True, seed=0, scale=1.0,
                     compute_dtype=torch.float32, double_quant=False):
    """A quantized ``bnb.nn.Linear4bit`` (NF4) and the dense fp32 weight it was quantized from."""
    import bitsandbytes as bnb

    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen) * scale
    layer = bnb.nn.Linear4bit(in_features, out_features, bias=bias, compute_dtype=compute_dtype, quant_type="nf4",
                              compress_statistics=double_quant)
    layer.weight = bnb.nn.Params4bit(weight.clone(), requires_grad=False, quant_type="nf4",
                                     compress_statistics=double_quant)
    if bias:
        layer.bias = torch.nn.Parameter(torch.randn(out_features, generator=gen) * 0.1, requires_grad=False)
    return layer.to("cpu"), weight


def load_4bit_demo(peft=True, dropout=0.0, r=8):
    """The embedded demo model in NF4 (fp32 compute), with LoRA on every linear (B randomised, so ΔW != 0)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from trl_fp8 import fourbit
    from trl_fp8.app.demo.model import demo_model_path

    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(demo_model_path(), quantization_config=q, dtype=torch.float32)
    fourbit.guard_cpu_repack(model)
    if not peft:
        return model
    model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", lora_dropout=dropout))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return model


@pytest.fixture
def qlora_model():
    return load_4bit_demo()

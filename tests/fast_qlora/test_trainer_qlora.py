"""Fast QLoRA wired into trl_fp8.GRPOTrainer: config, refusals, equivalence with TRL's QLoRA, counters, cache
lifetime, and composition with Fair Cast, the weight-sync checks and DUET (in-process sampler, CPU)."""

import pytest
import torch

import trl_fp8
from trl_fp8 import fourbit
from trl_fp8.app.tasks.arithmetic import correctness_reward, format_reward, make_arithmetic_dataset


def _quant():
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)


def _args(tmp_path, name="run", four_bit=True, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / name), use_cpu=True, bf16=False, max_steps=3, learning_rate=1e-3,
        per_device_train_batch_size=8, num_generations=4, max_completion_length=12, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, gradient_checkpointing=False, seed=7,
        fast_qlora="on",
    )
    if four_bit:
        kwargs["model_init_kwargs"] = {"quantization_config": _quant(), "dtype": torch.float32}
    kwargs.update(overrides)
    return trl_fp8.GRPOConfig(**kwargs)


def _lora(**kwargs):
    from peft import LoraConfig

    return LoraConfig(**{"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "lora_dropout": 0.0, **kwargs})


def _trainer(tmp_path, demo_dir, peft_config="lora", reward_funcs=None, name="run", four_bit=True, **overrides):
    return trl_fp8.GRPOTrainer(
        model=demo_dir, reward_funcs=reward_funcs or [correctness_reward, format_reward],
        args=_args(tmp_path, name, four_bit=four_bit, **overrides), train_dataset=make_arithmetic_dataset(200, seed=5),
        peft_config=_lora() if peft_config == "lora" else peft_config,
    )


def _recorder(store):
    def completions_seen(completions, **kwargs):
        store.append(list(completions))
        return [0.0] * len(completions)

    return completions_seen


def _history(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


def _adapters(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}


# -- config and refusals --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value,match", [
    ("fast_qlora", "yes", "fast_qlora='yes' is not valid"),
    ("qlora_keep_budget_gb", -1, "qlora_keep_budget_gb must be a number of GiB >= 0"),
    ("qlora_rollout_cache_gb", "big", "qlora_rollout_cache_gb must be a number of GiB >= 0 or None"),
    ("qlora_cache_dtype", "int8", "qlora_cache_dtype='int8' is not valid"),
    ("qlora_adapter_layers", "top", "qlora_adapter_layers must be 'all' or a number of top blocks >= 1"),
    ("qlora_adapter_layers", 0, "qlora_adapter_layers must be 'all' or a number of top blocks >= 1"),
])
def test_config_errors_name_the_field(tmp_path, field, value, match):
    with pytest.raises(ValueError, match=match):
        _args(tmp_path, **{field: value})


def test_config_accepts_a_number_of_blocks(tmp_path):
    assert _args(tmp_path, qlora_adapter_layers=2).resolved_adapter_layers() == 2
    assert _args(tmp_path, qlora_adapter_layers="all").resolved_adapter_layers() is None


def test_mxfp8_with_fast_qlora_or_a_4bit_policy_is_refused(tmp_path, demo_dir):
    with pytest.raises(ValueError, match="fast_qlora='on' cannot be combined with mxfp8=True"):
        _args(tmp_path, mxfp8=True)
    with pytest.raises(ValueError, match="mxfp8=True with a bitsandbytes-quantized"):
        _trainer(tmp_path, demo_dir, fast_qlora="off", mxfp8=True)


def test_every_4bit_policy_is_guarded_against_the_cpu_repack_whatever_samples_it(tmp_path, demo_dir):
    """fast QLoRA off: the trainer still switches off bitsandbytes' in-place CPU repack on every 4-bit layer, so an
    eval-mode no-grad forward after set-up (the logprob check's reference on a vLLM run, a user's evaluation) leaves
    the weights trainable; on an AVX512-BF16 CPU the step after it failed ('a view of a leaf Variable that requires
    grad is being used in an in-place operation', the demo model's q/k/v biases)."""
    trainer = _trainer(tmp_path, demo_dir, fast_qlora="off", max_steps=1)
    layers = [m for m in trainer.model.modules() if fourbit.is_4bit(m)]
    assert layers and all(m.support_avx512bf16_for_cpu is False for m in layers)
    model = trainer.accelerator.unwrap_model(trainer.model)
    model.eval()
    with torch.no_grad():
        model(input_ids=torch.tensor([[3, 4, 5, 6]]))
    model.train()
    assert not any(fourbit._packed_for_cpu(m) for m in layers)
    trainer.train()
    assert _history(trainer, "loss")


def test_on_without_a_4bit_base_refuses_and_auto_steps_aside(tmp_path, demo_dir):
    with pytest.raises(ValueError, match="fast_qlora='on': the policy has no 4-bit layers"):
        _trainer(tmp_path, demo_dir, four_bit=False)
    trainer = _trainer(tmp_path, demo_dir, four_bit=False, fast_qlora="auto")
    assert trainer.capability("fast_qlora") is None
    with pytest.raises(ValueError, match="4-bit layers but no LoRA adapters"):  # adapters, but not on a 4-bit layer
        _trainer(tmp_path, demo_dir, peft_config=_lora(target_modules=["embed_tokens"]))


def test_dora_is_refused(tmp_path, demo_dir):
    with pytest.raises(ValueError, match="does not support DoRA"):
        _trainer(tmp_path, demo_dir, peft_config=_lora(use_dora=True))


# -- equivalence ----------------------------------------------------------------------------------------------------
def test_with_both_budgets_at_zero_training_is_trls_qlora_bit_for_bit(tmp_path, demo_dir):
    plain = _trainer(tmp_path, demo_dir, name="plain", fast_qlora="off")
    plain.train()
    fast = _trainer(tmp_path, demo_dir, name="fast", qlora_keep_budget_gb=0, qlora_rollout_cache_gb=0)
    fast.train()
    assert _history(fast, "loss") == _history(plain, "loss")
    a, b = _adapters(plain), _adapters(fast)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_with_budgets_on_greedy_rollouts_and_the_loss_match_trls_qlora(tmp_path, demo_dir):
    """Kept layers compute bit for bit what the 4-bit layers compute; an fp32 cache decodes the same greedy tokens."""
    seen_plain, seen_fast = [], []
    common = dict(generation_kwargs={"do_sample": False}, max_steps=2)
    plain = _trainer(tmp_path, demo_dir, name="plain", fast_qlora="off",
                     reward_funcs=[correctness_reward, _recorder(seen_plain)], **common)
    plain.train()
    fast = _trainer(tmp_path, demo_dir, name="fast", qlora_keep_budget_gb=0.0001, qlora_rollout_cache_gb=1,
                    qlora_cache_dtype="float32", reward_funcs=[correctness_reward, _recorder(seen_fast)], **common)
    capability = fast.capability("fast_qlora")
    assert 0 < len(capability.kept_layers()) < 14
    fast.train()
    assert seen_fast == seen_plain and len(seen_fast) == 2
    assert _history(fast, "loss") == _history(plain, "loss")
    assert capability.cache.builds == 2


def test_dequantizations_per_step_drop_and_metrics_are_recorded(tmp_path, demo_dir):
    plain = _trainer(tmp_path, demo_dir, name="plain", fast_qlora="off", max_steps=2)
    from trl_fp8.fast_qlora.counters import DequantCounter

    counter = DequantCounter()
    counter.attach(plain.model)
    plain.train()
    per_step_plain = counter.total / 2
    fast = _trainer(tmp_path, demo_dir, name="fast", qlora_keep_budget_gb=0, qlora_rollout_cache_gb=1, max_steps=2)
    fast.train()
    per_step_fast = _history(fast, "qlora/dequant_calls")
    assert len(per_step_fast) == 2
    # plain: every decoded token's forward dequantizes every layer; fast: 14 cache builds + the loss forward/backward
    assert max(per_step_fast) * 4 < per_step_plain
    assert min(_history(fast, "qlora/cache_bytes")) > 0
    assert _history(fast, "qlora/kept_layers") == [0.0, 0.0]


def test_cache_lives_for_one_generation_call_and_edits_are_undone_after_training(tmp_path, demo_dir):
    trainer = _trainer(tmp_path, demo_dir, qlora_keep_budget_gb=0.0001, qlora_rollout_cache_gb=1,
                       qlora_adapter_layers=1, steps_per_generation=2, max_steps=4)
    capability = trainer.capability("fast_qlora")
    layers = capability.layers
    kept = capability.kept_layers()
    assert kept and all(isinstance(layers[n].base_layer, fourbit.DenseBase) for n in kept)
    trainer.train()
    assert capability.cache.builds == 2  # one per generation call (every 2 steps)
    assert not any("forward" in vars(layer) for layer in layers.values())  # freed after each call
    assert all(fourbit.is_4bit(layer.base_layer) for layer in layers.values())  # the user's QLoRA model again
    assert all(p.requires_grad for n, p in trainer.model.named_parameters() if "lora_" in n)
    lower = [p for n, p in trainer.model.named_parameters() if "lora_B" in n and ".layers.0." in n]
    upper = [p for n, p in trainer.model.named_parameters() if "lora_B" in n and ".layers.1." in n]
    assert all(torch.count_nonzero(p) == 0 for p in lower)  # speed mode: the lower block never trained
    assert any(torch.count_nonzero(p) > 0 for p in upper)


# -- composition ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["stochastic", "error_feedback"])
def test_fair_cast_serves_export_of_dequant_plus_delta_and_the_checks_pass(tmp_path, demo_dir, mode):
    from trl_fp8.fair_cast.rounding import stochastic_round

    trainer = _trainer(tmp_path, demo_dir, fair_cast=mode, sync_checks="all", qlora_keep_budget_gb=0,
                       learning_rate=1e-2, lora_serving="merged")
    fair_cast = trainer.capability("fair_cast")
    twin = fair_cast.sampler.model
    assert not fourbit.has_4bit(twin) and all(p.dtype == torch.bfloat16 for p in twin.parameters())
    packed = {n: m.weight.data.clone() for n, m in trainer.model.named_modules() if fourbit.is_4bit(m)}
    trainer.train()
    for name in ("sync/coverage", "sync/freshness", "sync/logprob_agreement"):
        assert _history(trainer, name) and all(v == 1.0 for v in _history(trainer, name)), name
    for n, m in trainer.model.named_modules():
        if fourbit.is_4bit(m):
            assert torch.equal(m.weight.data, packed[n])  # never merged into the 4-bit weights
    served = fair_cast.served
    name = "model.layers.0.self_attn.q_proj.weight"
    unit = served.units[name]
    assert unit.four_bit and unit.base_master is None  # no fp32 copy of the base is kept
    master = unit.master
    if mode == "stochastic":
        expected = stochastic_round(master, seed=served.seed, step=served.step, index=served._index[name])
        assert torch.equal(served.served[name].view(torch.int16), expected.view(torch.int16))
    else:  # error feedback: the served copy tracks dequant(W) + ΔW, its rounding error carried in an fp32 residual
        assert served.residual[name].dtype == torch.float32 and served.residual[name].shape == master.shape
        assert (served.served[name].float() - master).abs().max() < 2**-7 * master.abs().max()
    assert torch.count_nonzero(trainer.model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight)


def test_fair_cast_with_adapters_on_some_layers_serves_the_other_4bit_layers_dequantized(tmp_path, demo_dir):
    trainer = _trainer(tmp_path, demo_dir, fair_cast="stochastic", sync_checks="all", qlora_keep_budget_gb=0,
                       peft_config=_lora(target_modules=["q_proj", "v_proj"]), max_steps=2, lora_serving="merged")
    served = trainer.capability("fair_cast").served
    down = served.units["model.layers.0.mlp.down_proj.weight"]
    assert type(down).__name__ == "FourBitUnit" and not down.trainable
    trainer.train()
    assert all(v == 1.0 for v in _history(trainer, "sync/coverage"))
    module = trainer.model.base_model.model.model.layers[0].mlp.down_proj
    twin = trainer.capability("fair_cast").sampler.model
    # frozen: exported once (stochastic rounding of dequant(W) at the first export), and served as it is
    assert (twin.model.layers[0].mlp.down_proj.weight.float() - fourbit.dequantize(module)).abs().max() < 2**-7


def test_stochastic_export_of_a_4bit_lora_layer_is_unbiased():
    from tests.fast_qlora.conftest import load_4bit_demo
    from trl_fp8.fair_cast.peft import LoraUnit
    from trl_fp8.fair_cast.served import ServedCopy

    model = load_4bit_demo()
    name, layer = fourbit.lora_layers(model)[0]
    unit = LoraUnit("w", layer)
    copy = ServedCopy([unit], "stochastic", torch.bfloat16, seed=11)
    master = unit.master
    total = torch.zeros_like(master, dtype=torch.float64)
    n = 400
    for step in range(n):
        copy.export(step)
        total += copy.served["w"].double()
    mean = total / n
    spacing = (master.abs().clamp_min(1e-30).log2().floor() - 7).exp2()  # bf16 ulp of each element
    z = (mean - master.double()) / (spacing.double() / (2 * n**0.5))  # |error| / (ulp / 2 / sqrt(n)) bound
    assert z.abs().mean() < 1.0  # unbiased: the mean of the exports converges to dequant(W) + ΔW
    rtn = master.to(torch.bfloat16).double()
    assert (rtn - master.double()).abs().mean() > 3 * (mean - master.double()).abs().mean()


def test_duet_decodes_through_the_cache(tmp_path, demo_dir):
    trainer = _trainer(tmp_path, demo_dir, duet=True, duet_budget=0.5, qlora_rollout_cache_gb=1, max_steps=2)
    trainer.train()
    assert trainer.capability("fast_qlora").cache.builds == 2
    assert min(_history(trainer, "qlora/cache_bytes")) > 0


def test_the_rollout_cache_is_a_sampler_the_logprob_check_compares(tmp_path, demo_dir):
    # the rollout cache decodes in bf16 (or fp32 with qlora_cache_dtype="float32") while the learner computes in fp32:
    # a separate numerics path. The logprob check compares it on every generation, against a cache built afresh.
    trainer = _trainer(tmp_path, demo_dir, max_steps=6, qlora_cache_dtype="bfloat16", sync_checks="default")
    checks = trainer.capability("sync_checks")
    assert checks is not None and checks.monitor.sampler.label == "rollout cache"
    assert checks.monitor.checks == ("logprob_agreement",)  # nothing is synced into it: the other checks cannot apply
    trainer.train()
    assert checks.monitor.failures == [] and checks.monitor.compared == {"logprob_agreement": 6}
    gaps = _history(trainer, "sync/logp_gap_mean")
    assert len(gaps) == 6 and all(0 < g < 0.05 for g in gaps)


def test_a_stale_rollout_cache_is_caught_by_the_logprob_check(tmp_path, demo_dir):
    trainer = _trainer(tmp_path, demo_dir, max_steps=12, learning_rate=2e-2, qlora_cache_dtype="float32",
                       sync_checks=["logprob_agreement"])
    cache = trainer.capability("fast_qlora").cache
    frozen = {}
    weight = type(cache)._weight

    def stale_weight(self, layer):  # from step 4 on, the cache keeps serving the step-3 adapters
        if trainer.state.global_step < 4 or id(layer) not in frozen:
            frozen[id(layer)] = weight(self, layer)
        return frozen[id(layer)]

    cache._weight = stale_weight.__get__(cache)
    with pytest.raises(trl_fp8.WeightSyncError, match=r"\[logprob_agreement\] mean \|logπ_learner − logμ_sampler"):
        trainer.train()
    assert trainer.state.global_step >= 4

"""mxfp8=True in trl_fp8.GRPOTrainer: the learner's linears in MXFP8 (emulated), Fair Cast's sampler twin with the
identical quantizer, the weight-sync checks fed with the real recipes, checkpoints that load into transformers."""

import warnings

import pytest
import torch
from torch import nn

import trl_fp8
from trl_fp8.mxfp8.convert import layer_recipe
from trl_fp8.numerics import mx_fake_quantize as fake_quantize
from trl_fp8.app.tasks.arithmetic import correctness_reward, format_reward, make_arithmetic_dataset

LAYER = "model.layers.1.mlp.down_proj"


def _trainer(tmp_path, model_dir, peft_config=None, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, max_steps=3, learning_rate=1e-4,
        per_device_train_batch_size=16, num_generations=4, max_completion_length=12, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, seed=7, fair_cast="stochastic", mxfp8=True,
        mxfp8_kernel="emulated", sync_checks="all",
    )
    kwargs.update(overrides)
    return trl_fp8.GRPOTrainer(model=model_dir, reward_funcs=[correctness_reward, format_reward],
                               args=trl_fp8.GRPOConfig(**kwargs), train_dataset=make_arithmetic_dataset(400, seed=5),
                               peft_config=peft_config)


def test_learner_and_twin_quantize_identically_and_checks_stay_clean(tmp_path, demo_dir):
    trainer = _trainer(tmp_path, demo_dir, max_steps=20)
    mxfp8 = trainer.capability("mxfp8")
    report = mxfp8.report
    assert len(report["converted"]) == 14 and report["excluded"] == ["lm_head"]  # 2 layers × (q,k,v,o,gate,up,down)
    learner = dict(trainer.model.named_modules())
    twin = dict(trainer.capability("fair_cast").sampler.model.named_modules())
    for name in report["converted"]:
        assert layer_recipe(learner[name]) == layer_recipe(twin[name]) == mxfp8.recipe
    assert learner["model.layers.0.self_attn.q_proj"].bias is not None  # Qwen2's biased q/k/v are converted too
    with warnings.catch_warnings():
        warnings.simplefilter("error", trl_fp8.WeightSyncWarning)
        trainer.train()
    records = [r for r in trainer.state.log_history if "loss" in r]
    assert all(r["sync/quant_parity"] == 1.0 and r["sync/freshness"] == 1.0 for r in records)
    assert records[0]["sync/recipe_parity"] == 1.0
    trainer._generation_model()
    for name in report["converted"]:  # dequantized weights equal bit for bit (learner: fp32 holding served values)
        a = fake_quantize(learner[name].weight.detach()).to(torch.bfloat16)
        b = fake_quantize(twin[name].weight.detach())
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name


@pytest.mark.parametrize("check, message", [
    ("recipe_parity", rf"'{LAYER}.weight': scale_rounding learner='rceil' sampler='floor'"),
    ("quant_parity", rf"\[quant_parity\] '{LAYER}.weight' differs from the learner's quantizer output: \d+ of 16384 "
                     r"elements differ"),
])
def test_floor_scales_on_the_sampler_are_caught(tmp_path, demo_dir, check, message):
    from trl_fp8.mxfp8.convert import MXRecipe, torchao_config

    trainer = _trainer(tmp_path, demo_dir, sync_checks=[check])
    layer = trainer.capability("fair_cast").sampler.model.get_submodule(LAYER)
    layer.scale_calculation_mode = torchao_config(MXRecipe(rounding="floor")).scale_calculation_mode
    with pytest.raises(trl_fp8.WeightSyncError, match=message):
        trainer.train()


def test_recipe_parity_catches_a_layer_excluded_on_the_sampler_only(tmp_path, demo_dir):
    trainer = _trainer(tmp_path, demo_dir, sync_checks=["recipe_parity"])
    trainer.capability("fair_cast").sampler.model.get_submodule(LAYER).__class__ = nn.Linear  # the sampler computes it in bf16
    with pytest.raises(trl_fp8.WeightSyncError, match=rf"'{LAYER}.weight': format learner='mxfp8' sampler='dense'"):
        trainer.train()


def test_checkpoint_loads_into_plain_transformers(tmp_path, demo_dir):
    from transformers import AutoModelForCausalLM

    trainer = _trainer(tmp_path, demo_dir, max_steps=2, sync_checks="off")
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert not any(layer_recipe(m) for m in plain.modules())
    learner = dict(trainer.model.named_parameters())
    for name, p in plain.named_parameters():
        assert torch.equal(p, learner[name].detach()), name


def test_lora_on_an_mxfp8_base(tmp_path, demo_dir):
    from peft import LoraConfig
    from peft.tuners.lora import LoraLayer

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = _trainer(tmp_path, demo_dir, peft_config=lora, fair_cast="off", learning_rate=1e-2)
    layers = [m for m in trainer.model.modules() if isinstance(m, LoraLayer)]
    assert layers and all(layer_recipe(m.get_base_layer()) is not None for m in layers)
    assert all(layer_recipe(m.lora_A["default"]) is None for m in layers)  # adapters stay in high precision
    trainer.train()
    assert any(torch.count_nonzero(m.lora_B["default"].weight) for m in layers)
    with pytest.raises(ValueError, match=r"fair_cast with a PEFT \(LoRA\) model whose layers another capability "
                                         r"quantizes \(e.g. mxfp8=True\)"):
        _trainer(tmp_path, demo_dir, peft_config=lora)


def test_nothing_to_convert_is_a_clear_error(tmp_path, demo_dir):
    with pytest.raises(ValueError, match="mxfp8=True found no linear layer to convert: excluded by mxfp8_exclude"):
        _trainer(tmp_path, demo_dir, mxfp8_exclude=[".*"])


@pytest.mark.parametrize("overrides, message", [
    ({"use_vllm": True}, "mxfp8=True is supported with the in-process sampler only for now"),
    ({"mxfp8_kernel": "fast"}, "mxfp8_kernel='fast' is not valid; allowed values: 'auto', 'emulated', 'sm100'"),
    ({"mxfp8_exclude": ["lm_head", "(("]}, r"mxfp8_exclude: '\(\(' is not a valid regular expression"),
])
def test_bad_mxfp8_config_is_a_clear_error(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        trl_fp8.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", mxfp8=True, **overrides)

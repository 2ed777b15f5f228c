"""Fair Cast over LoRA with ``lora_serving="adapters"`` (the default): the base is served as loaded, only the adapter
factors are exported (lora_B with its scaling folded in), the loss runs on the served factors, and Fair Cast's state is
O(adapter parameters)."""

import math
import os

import pytest
import torch

import trl_fp8
from trl_fp8.app.tasks.arithmetic import correctness_reward, format_reward, make_arithmetic_dataset
from trl_fp8.fair_cast.rounding import stochastic_round
from trl_fp8.fair_cast.served import AdapterUnit, ServedCopy


def _lora(**kwargs):
    from peft import LoraConfig

    kwargs.setdefault("target_modules", ["q_proj", "v_proj", "gate_proj"])
    kwargs.setdefault("lora_alpha", 8)
    return LoraConfig(r=4, **kwargs)


def _trainer(tmp_path, model_dir, peft_config=None, name="run", model_kwargs=None, **overrides):
    kwargs = dict(output_dir=str(tmp_path / name), use_cpu=True, bf16=False, max_steps=3, learning_rate=1e-2,
                  per_device_train_batch_size=8, num_generations=4, max_completion_length=8, logging_steps=1,
                  save_strategy="no", report_to="none", disable_tqdm=True, gradient_checkpointing=False, seed=7,
                  fair_cast="stochastic")
    kwargs.update(overrides)
    if model_kwargs:
        kwargs["model_init_kwargs"] = model_kwargs
    return trl_fp8.GRPOTrainer(model=model_dir, reward_funcs=[correctness_reward, format_reward],
                               args=trl_fp8.GRPOConfig(**kwargs), train_dataset=make_arithmetic_dataset(64, seed=5),
                               peft_config=peft_config or _lora())


@pytest.fixture(scope="module")
def demo_dir():
    from trl_fp8.app.demo.model import demo_model_path

    return demo_model_path()


def _factors(model):
    return {n: p for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}


# -- the unit ---------------------------------------------------------------------------------------------------------
def test_a_lora_b_factor_is_served_with_its_scaling_folded_in_and_held_unscaled():
    gen = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(16, 4, generator=gen) * 1e-3)
    start = param.detach().clone()
    unit = AdapterUnit("b", param, scale=2.0)
    copy = ServedCopy([unit], "stochastic", torch.bfloat16, seed=3)
    copy.begin()
    expected = stochastic_round(start * 2, seed=3, step=0, index=0)
    assert torch.equal(copy.served["b"].view(torch.int16), expected.view(torch.int16))  # export(s·B)
    assert torch.equal(param.data, expected.float() / 2)  # the learner computes s·(served/s) = served, exactly
    copy.before_step()
    assert torch.equal(param.data, start)  # the optimizer steps the unscaled fp32 master
    param.data.add_(1e-4)
    copy.after_step(1)
    assert torch.equal(unit.stored, start + 1e-4)
    state = copy.state_dict()
    assert torch.equal(state["master"]["b"], start + 1e-4)  # saved unscaled


def test_a_scaling_that_is_no_power_of_two_is_applied_within_fp32_rounding():
    param = torch.nn.Parameter(torch.linspace(-1, 1, 64).reshape(16, 4))
    copy = ServedCopy([AdapterUnit("b", param, scale=1 / 3)], "rtn", torch.bfloat16)
    copy.begin()
    assert torch.allclose(param.data / 3, copy.served["b"].float(), rtol=2**-22, atol=0)


def test_a_16bit_factor_is_refused_by_the_unit():
    with pytest.raises(TypeError, match="fp32 master of LoRA factor 'b'"):
        AdapterUnit("b", torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.bfloat16)))


# -- the trainer ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["rtn", "stochastic", "error_feedback"])
def test_adapters_are_served_the_base_is_not_copied_and_the_loss_runs_on_the_served_factors(tmp_path, demo_dir, mode):
    from peft.tuners.lora import LoraLayer

    trainer = _trainer(tmp_path, demo_dir, fair_cast=mode, per_device_train_batch_size=16, max_completion_length=12)
    fair_cast = trainer.capability("fair_cast")
    assert fair_cast.adapters and fair_cast.sampler is None  # no twin: the policy itself is the served policy
    assert trainer._generation_model() is None
    factors = _factors(trainer.model)
    served = fair_cast.served
    assert set(served.units) == set(factors)
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if n not in factors}
    layer = next(m for m in trainer.model.modules() if isinstance(m, LoraLayer))
    a_name = next(n for n, p in factors.items() if p is layer.lora_A["default"].weight)
    b_name = next(n for n, p in factors.items() if p is layer.lora_B["default"].weight)
    scale = layer.scaling["default"]
    seen = []

    def on_layer(module, args):
        if torch.is_grad_enabled():  # the loss forward runs on exactly the served factors
            seen.append(torch.equal(module.lora_A["default"].weight, served.served[a_name].float()) and
                        torch.equal(module.lora_B["default"].weight * scale, served.served[b_name].float()))

    layer.register_forward_pre_hook(on_layer)
    trainer.train()
    assert seen and all(seen)
    for n, p in trainer.model.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), n  # the base as loaded: never written
    assert torch.count_nonzero(layer.lora_B["default"].weight) > 0  # the adapters trained
    if mode == "stochastic":
        unit = served.units[b_name]
        expected = stochastic_round(unit.stored * scale, seed=served.seed, step=served.step, index=served._index[b_name])
        assert torch.equal(served.served[b_name].view(torch.int16), expected.view(torch.int16))
    held = [*served.served.values(), *served.residual.values(), *(u.stored for u in served.units.values())]
    assert all(t.shape == factors[n].shape for n, t in zip([*served.served, *served.residual, *served.units], held))
    assert any(v > 0 for v in _history(trainer, "fair_cast/visible_update_frac"))


def _history(trainer, name):
    return [r[name] for r in trainer.state.log_history if name in r]


@pytest.mark.parametrize("mode, most", [("stochastic", 1.5), ("error_feedback", 2.5)])
def test_fair_cast_state_is_a_small_multiple_of_the_adapters(tmp_path, tiny_model_dir, mode, most):
    trainer = _trainer(tmp_path, tiny_model_dir, fair_cast=mode, max_steps=1)
    served = trainer.capability("fair_cast").served
    adapter_fp32 = sum(p.numel() * 4 for p in _factors(trainer.model).values())
    storages = {}
    for t in [*served.served.values(), *served.residual.values(), *(u.stored for u in served.units.values())]:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    assert sum(storages.values()) == most * adapter_fp32  # 4 B master + 2 B served (+ 4 B residual) per parameter


def test_a_bf16_base_is_served_as_loaded(tmp_path, tiny_model_dir):
    trainer = _trainer(tmp_path, tiny_model_dir, model_kwargs={"dtype": "bfloat16"}, bf16=True, max_steps=2)
    factors = _factors(trainer.model)
    assert all(p.dtype == torch.float32 for p in factors.values())  # fp32 masters of the factors
    assert all(p.dtype == torch.bfloat16 for n, p in trainer.model.named_parameters() if n not in factors)
    trainer.train()
    assert math.isfinite(trainer.state.log_history[-1]["train_loss"])


def test_merged_serving_is_still_there_on_request(tmp_path, tiny_model_dir):
    trainer = _trainer(tmp_path, tiny_model_dir, lora_serving="merged", max_steps=1)
    fair_cast = trainer.capability("fair_cast")
    assert not fair_cast.adapters and fair_cast.sampler is not None  # the dense merged twin
    assert not any("lora" in n for n, _ in fair_cast.sampler.model.named_parameters())


@pytest.mark.parametrize("extra, message", [
    ({"bias": "all"}, r"parameter '.*bias' is trainable too .* use lora_serving='merged'"),
    ({"use_dora": True}, "does not support DoRA"),
])
def test_what_adapter_serving_cannot_serve_is_refused_by_name(tmp_path, tiny_model_dir, extra, message):
    with pytest.raises(ValueError, match=message):
        _trainer(tmp_path, tiny_model_dir, peft_config=_lora(**extra))


def test_lora_serving_is_validated_at_config_time(tmp_path):
    with pytest.raises(ValueError, match=r"lora_serving='dense' is not valid; allowed values: 'auto', 'adapters'"):
        trl_fp8.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, lora_serving="dense")


def test_a_resume_across_serving_modes_is_refused(tmp_path, tiny_model_dir):
    first = _trainer(tmp_path, tiny_model_dir, max_steps=1, save_strategy="steps", save_steps=1)
    first.train()
    second = _trainer(tmp_path, tiny_model_dir, name="other", max_steps=2, lora_serving="merged")
    with pytest.raises(ValueError, match="lora_serving="):
        second.train(resume_from_checkpoint=os.path.join(first.args.output_dir, "checkpoint-1"))


def test_a_scaling_that_is_no_power_of_two_under_autocast_is_refused_in_process_too(tmp_path, tiny_model_dir):
    """In process the policy holds export(s·B) / s between steps; under autocast its forward casts that to bf16, a
    second rounding whenever s is no power of two (0.17–0.19 ulp of bias measured): refused by field, as the vLLM
    adapter kinds refuse it."""
    with pytest.raises(ValueError, match=r"s = lora_alpha / r .* = 0.75 is not a power of two: under bf16=True "
                                         r"autocast .*Fair Cast serves"):
        _trainer(tmp_path, tiny_model_dir, peft_config=_lora(lora_alpha=3), bf16=True)
    _trainer(tmp_path, tiny_model_dir, peft_config=_lora(lora_alpha=3), name="fp32")  # fp32: exact enough, served
    _trainer(tmp_path, tiny_model_dir, peft_config=_lora(lora_alpha=16), name="bf16", bf16=True)  # s = 4

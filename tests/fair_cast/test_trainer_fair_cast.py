"""Fair Cast wired into trl_fp8.GRPOTrainer (in-process sampler), on the tiny local models."""

import os

import pytest
import torch

import trl_fp8
from trl_fp8.app.tasks.arithmetic import correctness_reward, format_reward, make_arithmetic_dataset


def _args(tmp_path, name="run", **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / name), use_cpu=True, bf16=False, max_steps=3, learning_rate=1e-3,
        per_device_train_batch_size=16, num_generations=4, max_completion_length=12, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, gradient_checkpointing=False, seed=7,
        fair_cast="stochastic",
    )
    kwargs.update(overrides)
    return trl_fp8.GRPOConfig(**kwargs)


def _trainer(tmp_path, model_dir, peft_config=None, **overrides):
    return trl_fp8.GRPOTrainer(
        model=model_dir, reward_funcs=[correctness_reward, format_reward], args=_args(tmp_path, **overrides),
        train_dataset=make_arithmetic_dataset(200, seed=5), peft_config=peft_config,
    )


@pytest.fixture(scope="module")
def demo_dir():
    from trl_fp8.app.demo.model import demo_model_path

    return demo_model_path()


@pytest.mark.parametrize("mode", ["rtn", "stochastic", "error_feedback"])
def test_loss_runs_on_served_values_and_generation_on_the_twin(tmp_path, demo_dir, mode):
    trainer = _trainer(tmp_path, demo_dir, fair_cast=mode)
    twin = trainer.capability("fair_cast").sampler.model
    assert all(p.dtype == torch.bfloat16 for p in twin.parameters())
    learner_q = trainer.model.model.layers[0].self_attn.q_proj
    twin_q = twin.model.layers[0].self_attn.q_proj
    seen = {"twin_calls": 0, "learner_checks": []}

    def on_twin(module, args):
        seen["twin_calls"] += 1

    def on_learner(module, args):
        if torch.is_grad_enabled():  # the loss forward
            seen["learner_checks"].append(torch.equal(module.weight, twin_q.weight.float()))

    twin.register_forward_pre_hook(on_twin)
    learner_q.register_forward_pre_hook(on_learner)
    trainer.train()
    assert seen["twin_calls"] > 0  # rollouts came from the served twin
    assert seen["learner_checks"] and all(seen["learner_checks"])  # loss on exactly the served weights
    served = trainer.capability("fair_cast").served
    for name, p in trainer.model.named_parameters():
        assert p.dtype == torch.float32
        assert torch.equal(p.data, served.served[name].float()), name
    assert served.step == trainer.state.global_step == 3
    # the master moved and stays fp32, off the bf16 grid
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in served.master.values())
    logged = trainer.state.log_history[0]
    for key in ("fair_cast/visible_update_frac", "fair_cast/max_abs_err_ulps"):
        assert key in logged
    assert "fair_cast/lag_steps" in trainer.state.log_history[1]


def test_export_once_per_optimizer_step_with_accumulation(tmp_path, demo_dir):
    trainer = _trainer(tmp_path, demo_dir, gradient_accumulation_steps=2, per_device_train_batch_size=8,
                       steps_per_generation=4, max_steps=2)
    exports = []
    original = trainer.capability("fair_cast").served.export
    trainer.capability("fair_cast").served.export = lambda step, names=None: (exports.append(step), original(step, names))[1]
    trainer.train()
    assert exports == [0, 1, 2]  # once at the start, then once per optimizer step


def test_off_builds_nothing(tmp_path, demo_dir):
    trainer = _trainer(tmp_path, demo_dir, fair_cast="off", max_steps=1)
    # nothing of Fair Cast's; only its probe, which reads a sample of the weights around a step and changes nothing
    assert trainer.capability("fair_cast") is None and set(trainer.capabilities) == {"fair_cast_probe"}


def test_resume_is_exact(tmp_path, tiny_model_dir):
    """4 steps straight == 2 steps + checkpoint + resume + 2 steps: same master, served copy and residual."""
    common = dict(fair_cast="error_feedback", max_steps=4, save_strategy="steps", save_steps=2,
                  learning_rate=5e-3)
    straight = _trainer(tmp_path, tiny_model_dir, **common)
    straight.train()
    checkpoint = os.path.join(straight.args.output_dir, "checkpoint-2")
    assert os.path.isfile(os.path.join(checkpoint, "fair_cast_state.pt"))
    assert not [f for f in os.listdir(checkpoint) if f.endswith(".tmp")]

    resumed = _trainer(tmp_path, tiny_model_dir, **{**common, "output_dir": str(tmp_path / "resumed")})
    resumed.train(resume_from_checkpoint=checkpoint)
    a, b = straight.capability("fair_cast").served, resumed.capability("fair_cast").served
    for name in a.master:
        assert torch.equal(a.master[name], b.master[name]), name
        assert torch.equal(a.served[name].view(torch.int16), b.served[name].view(torch.int16)), name
        assert torch.equal(a.residual[name], b.residual[name]), name
    for (n, p), (_, q) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(p, q), n


def test_saved_model_is_the_served_copy(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    trainer = _trainer(tmp_path, tiny_model_dir, max_steps=2)
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    served = trainer.capability("fair_cast").served.served
    for name, p in saved.named_parameters():
        assert torch.equal(p.data, served[name].float()), name


def test_resume_from_a_checkpoint_without_fair_cast_state_is_refused(tmp_path, tiny_model_dir):
    plain = _trainer(tmp_path, tiny_model_dir, fair_cast="off", max_steps=2, save_strategy="steps", save_steps=2)
    plain.train()
    checkpoint = os.path.join(plain.args.output_dir, "checkpoint-2")
    fc = _trainer(tmp_path, tiny_model_dir, output_dir=str(tmp_path / "fc"), max_steps=3)
    with pytest.raises(ValueError, match="fair_cast='off' in the checkpoint, fair_cast='stochastic' in this run"):
        fc.train(resume_from_checkpoint=checkpoint)
    os.remove(os.path.join(checkpoint, "trl_fp8_settings.json"))  # as written by trl_fp8 before it recorded them
    os.remove(os.path.join(checkpoint, "trl_fp8_complete.json"))
    with pytest.raises(ValueError, match="has no fair_cast_state.pt"):
        fc.train(resume_from_checkpoint=checkpoint)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"fair_cast": "nearest"}, "fair_cast='nearest' is not valid; allowed values: 'off', 'rtn'"),
        ({"served_dtype": "fp8"}, "served_dtype='fp8' is not valid; allowed values: 'bfloat16', 'float16'"),
        ({"fair_cast_seed": "x"}, "fair_cast_seed must be an integer"),
        ({"use_transformers_continuous_batching": True}, "silently discards the fp32 master"),
        ({"bf16": True, "served_dtype": "float16"}, "served_dtype='float16' copy"),
    ],
)
def test_config_refuses_bad_values_and_combinations(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        _args(tmp_path, **overrides)


def _lora(**kwargs):
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], **kwargs)


def _lora_trainer(tmp_path, model_dir, peft_config=None, **overrides):
    return trl_fp8.GRPOTrainer(
        model=model_dir, reward_funcs=[correctness_reward, format_reward], args=_args(tmp_path, **overrides),
        train_dataset=make_arithmetic_dataset(200, seed=5), peft_config=peft_config or _lora(),
    )


def test_lora_serves_the_merged_weights_and_trains_on_them(tmp_path, demo_dir):
    from peft.tuners.lora import LoraLayer

    from trl_fp8.fair_cast.rounding import stochastic_round

    trainer = _lora_trainer(tmp_path, demo_dir, learning_rate=1e-2, lora_serving="merged")
    twin = trainer.capability("fair_cast").sampler.model
    assert not any("lora" in n for n, _ in twin.named_parameters())  # a plain merged model
    layers = {n: m for n, m in trainer.model.named_modules() if isinstance(m, LoraLayer)}
    name, layer = next(iter(layers.items()))
    served_name = name.removeprefix("base_model.model.") + ".weight"
    twin_weight = dict(twin.named_parameters())[served_name]
    base_before = layer.get_base_layer().weight.detach().clone()
    calls = {"twin": 0, "checks": []}

    def delta():
        return layer.get_delta_weight("default")

    def on_learner(module, args):
        if torch.is_grad_enabled():  # the loss forward: effective weight == the served merged weight
            effective = module.get_base_layer().weight + delta()
            calls["checks"].append(torch.allclose(effective, twin_weight.float(), rtol=0, atol=1e-6))

    twin.register_forward_pre_hook(lambda m, a: calls.__setitem__("twin", calls["twin"] + 1))
    layer.register_forward_pre_hook(on_learner)
    trainer.train()
    assert calls["twin"] > 0 and calls["checks"] and all(calls["checks"])
    served = trainer.capability("fair_cast").served
    unit = served.units[served_name]
    assert torch.equal(unit.base_master, base_before)  # the fp32 base W never changes
    assert torch.count_nonzero(layer.lora_B["default"].weight) > 0  # the adapters trained
    with torch.no_grad():
        merged = base_before + delta()
    expected = stochastic_round(merged, seed=served.seed, step=served.step, index=served._index[served_name])
    assert torch.equal(served.served[served_name].view(torch.int16), expected.view(torch.int16))
    trainer._generation_model()  # the twin receives the latest export at the next generation's sync
    assert torch.equal(twin_weight.view(torch.int16), expected.view(torch.int16))
    # frozen non-LoRA tensors are served once and never re-rounded
    assert "model.embed_tokens.weight" not in served.trainable


@pytest.mark.parametrize("lora_serving", ["adapters", "merged"])
def test_lora_resume_is_exact(tmp_path, tiny_model_dir, lora_serving):
    common = dict(fair_cast="stochastic", max_steps=4, save_strategy="steps", save_steps=2, learning_rate=5e-3,
                  lora_serving=lora_serving)
    straight = _lora_trainer(tmp_path, tiny_model_dir, **common)
    straight.train()
    resumed = _lora_trainer(tmp_path, tiny_model_dir, **{**common, "output_dir": str(tmp_path / "resumed")})
    resumed.train(resume_from_checkpoint=os.path.join(straight.args.output_dir, "checkpoint-2"))
    a, b = straight.capability("fair_cast").served, resumed.capability("fair_cast").served
    for name in a.units:
        assert torch.equal(a.served[name].view(torch.int16), b.served[name].view(torch.int16)), name
    for (n, p), (_, q) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize(
    "extra, message",
    [({"use_dora": True}, "does not support DoRA"), ({"modules_to_save": ["lm_head"]}, "modules_to_save")],
)
def test_unsupported_peft_setups_are_refused_clearly(tmp_path, tiny_model_dir, extra, message):
    with pytest.raises(ValueError, match=message):
        _lora_trainer(tmp_path, tiny_model_dir, peft_config=_lora(**extra))


def test_twin_generates_with_its_own_weights_under_gradient_checkpointing(tmp_path, demo_dir):
    # Regression: TRL patches the policy's forward with a closure over the original model; a deep copy kept that
    # closure, so the twin ran the *learner* (and, with gradient checkpointing in train mode, without a KV cache).
    trainer = _trainer(tmp_path, demo_dir, gradient_checkpointing=True, max_steps=2)
    twin = trainer.capability("fair_cast").sampler.model
    ids = trainer.processing_class(["12+34="], return_tensors="pt").input_ids
    trainer.train()
    trainer.model.train()
    with torch.no_grad():
        for p in trainer.model.parameters():  # the learner changes; the twin must not notice
            p.add_(0.5)
        out = twin.generate(ids, max_new_tokens=10, do_sample=False)
        logits = twin(ids).logits
    fresh = type(twin)(twin.config).eval()  # a model built from scratch, parameters in bf16 like the twin's
    fresh.load_state_dict(twin.state_dict())
    for p in fresh.parameters():
        p.data = p.data.to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(logits, fresh(ids).logits)
        assert torch.equal(out, fresh.generate(ids, max_new_tokens=10, do_sample=False))
    assert trainer.processing_class.decode(out[0]).startswith("12+34=\\boxed{")
    assert max(r.get("reward", 0) for r in trainer.state.log_history) > 0


def test_a_prompt_learning_peft_model_is_refused_at_start(tmp_path, demo_dir):
    from peft import PromptTuningConfig

    with pytest.raises(ValueError, match=r"fair_cast with a PEFT PROMPT_TUNING model is not supported: .* Use LoRA"):
        _trainer(tmp_path, demo_dir, peft_config=PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))

"""trl_fp8.GRPOTrainer with every trl_fp8 field at its default is trl.GRPOTrainer, bit for bit on CPU."""

import json

import pytest
import torch
import trl

import trl_fp8
from trl_fp8.app.tasks.arithmetic import correctness_reward, format_reward, make_arithmetic_dataset

# Wall-clock entries differ between any two runs; everything else must be identical.
TIMING_KEYS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}


def _args(config_cls, tmp_path, name, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / name),
        use_cpu=True,
        bf16=False,
        max_steps=4,
        learning_rate=1e-3,
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=12,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        gradient_checkpointing=False,
        seed=11,
    )
    kwargs.update(overrides)
    return config_cls(**kwargs)


def _train(trainer_cls, config_cls, model_dir, tmp_path, name, **overrides):
    trainer = trainer_cls(
        model=model_dir,
        reward_funcs=[correctness_reward, format_reward],
        args=_args(config_cls, tmp_path, name, **overrides),
        train_dataset=make_arithmetic_dataset(200, seed=5),
    )
    trainer.train()
    logs = [{k: v for k, v in rec.items() if k not in TIMING_KEYS} for rec in trainer.state.log_history]
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return logs, params


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"loss_type": "grpo", "beta": 0.04, "steps_per_generation": 2, "num_iterations": 2},
    ],
    ids=["dapo-default", "grpo-beta-multi-iteration"],
)
def test_bitwise_parity_with_trl(overrides, tmp_path):
    from trl_fp8.app.demo.model import demo_model_path

    model_dir = demo_model_path()
    ref_logs, ref_params = _train(trl.GRPOTrainer, trl.GRPOConfig, model_dir, tmp_path, "trl", **overrides)
    logs, params = _train(trl_fp8.GRPOTrainer, trl_fp8.GRPOConfig, model_dir, tmp_path, "fp8", **overrides)

    assert len(ref_logs) == 5  # 4 steps + the train summary
    # at its defaults trl_fp8 adds one thing: the Fair Cast probe (Fair Cast is off) reads a sample of the weights
    # around every 10th step and logs its share; it changes nothing else
    probe = "fair_cast/rtn_dropped_frac"
    assert [r["step"] for r in logs if probe in r] == [1]
    logs = [{k: v for k, v in r.items() if k != probe} for r in logs]
    assert logs == ref_logs  # losses, rewards, grad norms, lengths: exactly equal floats
    assert params.keys() == ref_params.keys()
    for name, ref in ref_params.items():
        assert torch.equal(params[name], ref), name
    # Training did move the weights (otherwise the comparison proves nothing).
    from transformers import AutoModelForCausalLM

    start = dict(AutoModelForCausalLM.from_pretrained(model_dir).named_parameters())
    assert any(not torch.equal(start[n].detach(), p) for n, p in params.items())


def test_metrics_jsonl_records_every_step_without_changing_training(tmp_path, tiny_model_dir):
    path = tmp_path / "metrics.jsonl"
    ref_logs, ref_params = _train(trl.GRPOTrainer, trl.GRPOConfig, tiny_model_dir, tmp_path, "trl", max_steps=3)
    logs, params = _train(
        trl_fp8.GRPOTrainer, trl_fp8.GRPOConfig, tiny_model_dir, tmp_path, "fp8", max_steps=3, metrics_jsonl=str(path)
    )
    assert [{k: v for k, v in r.items() if k != "fair_cast/rtn_dropped_frac"} for r in logs] == ref_logs  # the probe
    assert all(torch.equal(params[n], p) for n, p in ref_params.items())
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 3]
    assert all("reward" in r for r in records[:3])


def test_accepts_a_plain_trl_config(tmp_path, tiny_model_dir):
    trainer = trl_fp8.GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=format_reward,
        args=_args(trl.GRPOConfig, tmp_path, "plain", max_steps=1),
        train_dataset=make_arithmetic_dataset(20),
    )
    trainer.train()
    assert trainer.state.global_step == 1


def test_a_field_set_after_the_config_was_built_is_checked_when_the_trainer_is(tmp_path, demo_dir):
    """Notebooks set fields on a built config (``args.x = ...``): the trainer checks them again, before building
    anything — e.g. continuous batching would silently discard Fair Cast's fp32 master."""
    import trl_fp8
    from trl_fp8.app.tasks.arithmetic import correctness_reward, make_arithmetic_dataset

    def build(**late):
        args = trl_fp8.GRPOConfig(output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, max_steps=1,
                                  per_device_train_batch_size=4, num_generations=4, max_completion_length=4,
                                  report_to="none", save_strategy="no")
        for key, value in late.items():
            setattr(args, key, value)
        return trl_fp8.GRPOTrainer(model=demo_dir, reward_funcs=[correctness_reward], args=args,
                                   train_dataset=make_arithmetic_dataset(8, seed=1))

    with pytest.raises(ValueError, match=r"fair_cast='stochastic' cannot be combined with "
                                         r"use_transformers_continuous_batching=True"):
        build(fair_cast="stochastic", use_transformers_continuous_batching=True)
    with pytest.raises(ValueError, match=r"fair_cast='sr' is not valid; allowed values: 'off', 'rtn'"):
        build(fair_cast="sr")
    with pytest.raises(ValueError, match=r"lora_serving='dense' is not valid"):
        build(lora_serving="dense")

"""The probe in the trainer: on with Fair Cast off (its default), off with Fair Cast on or fair_cast_probe=0, off by
name where there is no fp32 master; its metric and its end-of-run line."""

import logging

import pytest
import torch

import trl_fp8
from trl_fp8.app.tasks.arithmetic import correctness_reward, format_reward, make_arithmetic_dataset
from trl_fp8.fair_cast_probe.component import advice


def _length_reward(completions, **kwargs):  # varies within a group on an untrained model: the weights move
    return [len(str(c)) / 10 for c in completions]


def _trainer(tmp_path, model_dir, **overrides):
    kwargs = dict(output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, max_steps=4, learning_rate=1e-3,
                  per_device_train_batch_size=8, num_generations=4, max_completion_length=8, logging_steps=1,
                  save_strategy="no", report_to="none", disable_tqdm=True, gradient_checkpointing=False, seed=7)
    kwargs.update(overrides)
    return trl_fp8.GRPOTrainer(model=model_dir, reward_funcs=[correctness_reward, format_reward, _length_reward],
                               args=trl_fp8.GRPOConfig(**kwargs), train_dataset=make_arithmetic_dataset(64, seed=5))


def test_the_probe_records_every_nth_step_with_fair_cast_off(tmp_path, tiny_model_dir):
    trainer = _trainer(tmp_path, tiny_model_dir, fair_cast_probe=2)
    probe = trainer.capability("fair_cast_probe")
    assert probe is not None and not probe.samples_16bit  # fp32 on CPU: it says what a 16-bit sampler would drop
    trainer.train()
    logged = [(r["step"], r["fair_cast/rtn_dropped_frac"]) for r in trainer.state.log_history
              if "fair_cast/rtn_dropped_frac" in r]
    assert [s for s, _ in logged] == [1, 3]  # steps 0 and 2 began with global_step % 2 == 0
    assert all(0.0 <= x <= 1.0 for _, x in logged)
    assert [s for s, _ in probe.readings] == [1, 3]


@pytest.mark.parametrize("overrides", [dict(fair_cast="stochastic"), dict(fair_cast_probe=0)],
                         ids=["fair_cast_on", "probe_off"])
def test_no_probe_with_fair_cast_on_or_the_field_at_zero(tmp_path, tiny_model_dir, overrides):
    trainer = _trainer(tmp_path, tiny_model_dir, **overrides)
    assert trainer.capability("fair_cast_probe") is None


def test_16_bit_trained_weights_turn_the_probe_off_saying_why(tmp_path, tiny_model_dir, caplog):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="trl_fp8.fair_cast_probe"):
        trainer = _trainer(tmp_path, model)
    assert trainer.capability("fair_cast_probe") is None
    assert "the Fair Cast probe is off for this run: the trained weights are bfloat16" in caplog.text


def test_a_negative_interval_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="fair_cast_probe must be an integer >= 0"):
        trl_fp8.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, fair_cast_probe=-1)


def test_the_advice_line_needs_the_last_readings_to_stay_high():
    high = [(s, 0.8) for s in (10, 20, 30, 40, 50)]
    line = advice(high, "bfloat16", samples_16bit=True)
    assert line.startswith("trl_fp8: round-to-nearest into bfloat16 dropped 80% of each step's update")
    assert "steps 10–50" in line and "fair_cast='stochastic'" in line and "fair_cast_probe=0" in line
    assert "would drop" in advice(high, "bfloat16", samples_16bit=False)
    assert advice(high[:2], "bfloat16", True) is None  # too few readings
    assert advice([(s, 0.3) for s in range(5)] + high[:1], "bfloat16", True) is None  # the last five's mean: 0.4
    assert advice([(1, 0.1)] + high, "bfloat16", True) is not None  # only the last five count

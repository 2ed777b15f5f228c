"""The plan's persistent rows equal the bytes the live trainer holds, category by category, on the tiny model the
test-suite builds (tests/conftest.py): full fine-tuning, Fair Cast off / RTN / SR / EF, the default weight-sync checks
and DUET. Measured after the first optimizer step (gradients and optimizer state exist then), by
:func:`trl_fp8.plan.measure`: distinct storages, each counted once."""

import pytest
from transformers import TrainerCallback

import trl_fp8
from trl_fp8.app.tasks.arithmetic import correctness_reward, format_reward, make_arithmetic_dataset
from trl_fp8.plan import measure, memory_plan


class _MeasureAtStep(TrainerCallback):
    def __init__(self):
        self.trainer, self.measured = None, None

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.measured is None:
            self.measured = measure(self.trainer)


def _train_one_step(tmp_path, model_dir, **overrides):
    kwargs = dict(output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, max_steps=1, learning_rate=1e-3,
                  per_device_train_batch_size=8, num_generations=4, max_completion_length=8, logging_steps=1,
                  save_strategy="no", report_to="none", disable_tqdm=True, gradient_checkpointing=False, seed=7)
    kwargs.update(overrides)
    spy = _MeasureAtStep()
    trainer = trl_fp8.GRPOTrainer(model=model_dir, reward_funcs=[correctness_reward, format_reward],
                                  args=trl_fp8.GRPOConfig(**kwargs), train_dataset=make_arithmetic_dataset(64, seed=5))
    trainer.add_callback(spy)  # after the capabilities' callbacks: Fair Cast has exported this step's copy
    spy.trainer = trainer
    trainer.train()
    return trainer, spy


@pytest.mark.parametrize("fair_cast", ["off", "rtn", "stochastic", "error_feedback"])
def test_full_fine_tuning_rows_equal_the_trainer_s_tensors(tmp_path, tiny_model_dir, fair_cast):
    trainer, spy = _train_one_step(tmp_path, tiny_model_dir, fair_cast=fair_cast, duet=True)
    assert set(trainer.capabilities) >= {"duet"} | ({"fair_cast", "sync_checks"} if fair_cast != "off" else set())
    plan = memory_plan(tiny_model_dir, trainer.args, precision="fp32", device="t4")
    predicted = plan.by_category()
    measured = dict(spy.measured)  # Fair Cast's tensors from FairCast.held_tensors, claimed first
    for category in ("base", "buffers", "gradients", "optimizer"):
        assert measured[category] == predicted[category], category
    if fair_cast == "off":
        assert not any(k.startswith("fair_cast/") for k in predicted)
        assert "sync_checks" not in trainer.capabilities  # the learner generates: nothing to check
    else:
        fair = {k: v for k, v in predicted.items() if k.startswith("fair_cast/")}
        # the metric sample's indices are their own small tensors (no slice keeping a whole permutation alive)
        assert {k: v for k, v in measured.items() if k.startswith("fair_cast/") and k in fair} == fair
        assert ("fair_cast/residual" in fair) == (fair_cast == "error_feedback")
        # the checks hold references to Fair Cast's served copy: nothing of their own
        assert measured["sync_checks/learner"] == predicted["sync_checks/learner"] == 0
    assert measured["duet/state"] == predicted["duet/state"] == 0
    # everything the trainer holds is in a planned category
    assert {k for k, v in measured.items() if v} <= set(predicted)


def test_measure_stays_the_function_once_its_module_is_imported():
    import trl_fp8.plan
    import trl_fp8.plan.held  # noqa: F401  (a submodule named like the function would replace it on the package)

    assert trl_fp8.plan.measure is measure and callable(trl_fp8.plan.measure)


def test_plan_rows_by_hand_for_the_tiny_model(tiny_model_dir):
    # tests/conftest.py's model: vocab 128, hidden 64, MLP 128, 2 blocks, 2 heads of 32, 1 KV head, untied
    #   embeddings 128 × 64 = 8,192; per block q 64×64 + 64, k and v 32×64 + 32 each, o 64×64, gate/up/down
    #   3 × 64×128, two norms 2 × 64: 4,160 + 2 × 2,080 + 4,096 + 24,576 + 128 = 37,120; final norm 64; head 8,192
    #   = 8,192 + 2 × 37,120 + 64 + 8,192 = 90,688 parameters in 27 tensors
    plan = memory_plan(tiny_model_dir, {"fair_cast": "error_feedback"}, precision="fp32", device="t4")
    rows = plan.by_category()
    assert rows["base"] == 4 * 90_688
    assert rows["optimizer"] == 8 * 90_688 + 4 * 27  # exp_avg, exp_avg_sq and an fp32 step per tensor
    assert rows["gradients"] == 4 * 90_688
    assert rows["fair_cast/master"] == rows["fair_cast/residual"] == 4 * 90_688
    assert rows["fair_cast/served"] == 2 * 90_688
    assert rows["fair_cast/twin"] == 2 * 90_688 + 2 * 16 * 4  # + inv_freq and original_inv_freq (fp32, 16 each)
    # the metric sample: ceil(65,536 × n / 90,688) elements of each of the 27 tensors (at most all of a small one),
    # 65,545 in all: an int64 index and three fp32 samples (previous master, previous served, running update) each
    assert rows["fair_cast/metrics"] == 20 * 65_545


@pytest.mark.parametrize("lora_serving,fair_cast", [("adapters", "stochastic"), ("adapters", "error_feedback"),
                                                    ("merged", "rtn")])
def test_lora_rows_equal_fair_cast_s_held_tensors(tmp_path, tiny_model_dir, lora_serving, fair_cast):
    """LoRA over the fp32 tiny model: FairCast.held_tensors (what measure() reads) equals the plan's Fair Cast rows —
    adapters: masters, served factors (+ residual) and the metric sample, no copy of the base; merged: the fp32 base
    kept aside, the merged twin and its served buffers."""
    from peft import LoraConfig

    peft = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    kwargs = dict(output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, max_steps=1, learning_rate=1e-3,
                  per_device_train_batch_size=8, num_generations=4, max_completion_length=8, logging_steps=1,
                  save_strategy="no", report_to="none", disable_tqdm=True, gradient_checkpointing=False, seed=7,
                  fair_cast=fair_cast, lora_serving=lora_serving)
    spy = _MeasureAtStep()
    trainer = trl_fp8.GRPOTrainer(model=tiny_model_dir, reward_funcs=[correctness_reward, format_reward],
                                  args=trl_fp8.GRPOConfig(**kwargs), train_dataset=make_arithmetic_dataset(64, seed=5),
                                  peft_config=peft)
    trainer.add_callback(spy)
    spy.trainer = trainer
    trainer.train()
    plan = memory_plan(tiny_model_dir, trainer.args, peft={"r": 4, "target_modules": "all"}, precision="fp32",
                       device="t4", base_dtype="float32")
    predicted = {k: v for k, v in plan.by_category().items() if k.startswith("fair_cast/")}
    measured = {k: v for k, v in spy.measured.items() if k.startswith("fair_cast/") and v}
    assert measured == predicted
    if lora_serving == "adapters":
        assert "fair_cast/twin" not in measured and "fair_cast/base_copy" not in measured
    else:
        assert measured["fair_cast/base_copy"] > 0 and measured["fair_cast/twin"] > 0

"""DUET's refill: a step's idle prompts (warm, every observed group with one reward, not due for a re-probe) are
replaced by other prompts of the pool, so the budget they would leave unused goes where there is something to learn."""

import random

import pytest
import torch

import trl_fp8
from trl_fp8.duet.controller import DuetController
from trl_fp8.duet.surrogate import PromptStats


def _controller(**kw) -> DuetController:
    return DuetController(budget=0.5, slots=8, n_min=2, seed=0, default_length=20.0, **kw)


def _observe(c: DuetController, key: str, advantages) -> None:
    """One observed group of ``key`` with these advantages (Σ log π = -1 each)."""
    adv = torch.tensor(advantages, dtype=torch.float64)
    plan = c.plan([key])
    plan.counts = torch.tensor([len(advantages)])
    plan.monitors = [c._monitor() for _ in advantages]
    c.observe(plan, [10] * len(advantages), adv, -torch.ones(len(advantages), dtype=torch.float64))


def test_idle_means_warm_with_only_zero_variance_groups_and_not_due_for_a_reprobe():
    stats = PromptStats(reprobe_every=2)
    assert not stats.idle("cold")
    stats.update("flat", 0.0, [5, 5])
    stats.update("mixed", 0.3, [5, 5])
    stats.update("once_mixed", 0.0, [5, 5])
    stats.update("once_mixed", 0.4, [5, 5])
    assert stats.idle("flat") and not stats.idle("mixed") and not stats.idle("once_mixed")
    stats.touch("flat")  # one allocation skipped: since_update 1, the next would be the 2nd (not > 2)
    assert stats.idle("flat")
    stats.touch("flat")  # the next allocation is the 3rd without an update: a re-probe is due, not idle
    assert not stats.idle("flat")
    s, _, warm, reprobe = stats.lookup(["flat"])
    assert warm.tolist() == [True] and reprobe.tolist() == [True] and s.tolist() == [0.0]
    stats.touch("cold")  # a cold key is left alone
    assert "cold" not in stats


def test_idle_prompts_are_replaced_by_the_first_non_idle_draw_not_already_in_the_batch():
    c = _controller()
    for key in ("a", "b", "x"):
        _observe(c, key, [0.0, 0.0])  # a, b and x: one reward throughout
    _observe(c, "m", [1.0, -1.0])  # m: mixed
    pool = ["x", "a", "m", "new1", "new2"]  # draws in this order (x idle, a in the batch, m in the batch, ...)
    order = iter(pool)
    subs, idle = c.refill(["a", "m", "b"], lambda rng: (next(order),) * 2, tries=4)
    assert idle == 2
    assert subs == {0: "new1", 2: "new2"}
    # the replaced prompts counted one allocation each; the kept one (m) and the rejected draws none
    assert c.stats._table["a"].since_update == c.stats._table["b"].since_update == 1
    assert c.stats._table["m"].since_update == 0 and c.stats._table["x"].since_update == 0


def test_no_substitute_within_the_tries_keeps_the_idle_prompt():
    c = _controller()
    _observe(c, "a", [0.0, 0.0])
    _observe(c, "x", [0.0, 0.0])
    calls = []

    def draw(rng):
        calls.append(1)
        return "x", "x"

    subs, idle = c.refill(["a"], draw, tries=3)
    assert subs == {} and idle == 1 and len(calls) == 3
    assert c.stats._table["a"].since_update == 0
    assert c.refill(["a"], draw, tries=0) == ({}, 1)
    with pytest.raises(ValueError, match="tries"):
        c.refill(["a"], draw, tries=-1)


def test_a_batch_without_idle_prompts_draws_nothing_and_keeps_the_stream():
    c, ref = _controller(), _controller()
    _observe(c, "m", [1.0, -1.0])
    _observe(ref, "m", [1.0, -1.0])

    def draw(rng):
        raise AssertionError("no draw expected")

    assert c.refill(["m", "cold"], draw, tries=5) == ({}, 0)
    assert c.rng.getstate() == ref.rng.getstate()
    assert torch.equal(c.plan(["m", "cold"]).counts, ref.plan(["m", "cold"]).counts)


def test_draws_come_from_the_controllers_stream():
    """Two controllers with one seed and one history draw the same substitutes (every DDP rank decides alike)."""
    def run():
        c = _controller()
        _observe(c, "a", [0.0, 0.0])
        pool = [f"p{i}" for i in range(50)]
        return c.refill(["a"], lambda rng: (pool[rng.randrange(50)],) * 2, tries=2)

    first = run()
    assert first == run() and len(first[0]) == 1


# -- in the trainer -------------------------------------------------------------------------------------------------
def _flat(completions, **kwargs):
    """One reward for every completion of a prompt whose row says ``mixed`` False; 0, 1, 0, 1, ... for the others."""
    return [float(i % 2) if mixed else 1.0 for i, mixed in enumerate(kwargs["mixed"])]


def test_the_trainer_replaces_idle_prompts_and_scores_the_substitutes_rows(tmp_path):
    from trl_fp8.app.demo.model import demo_model_path
    from trl_fp8.app.tasks.arithmetic import make_arithmetic_dataset

    from datasets import Dataset

    rows = list(make_arithmetic_dataset(8, seed=5))  # 8 prompts, 4 a step: warm from the third step on
    data = Dataset.from_list([{**row, "mixed": i % 2 == 0} for i, row in enumerate(rows)])
    seen = []

    class Spy(trl_fp8.GRPOTrainer):
        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            seen.append(([x["prompt"] for x in inputs], prompts, [x["answer"] for x in inputs]))
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)

    args = trl_fp8.GRPOConfig(
        output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, max_steps=6, learning_rate=1e-3,
        per_device_train_batch_size=16, num_generations=4, max_completion_length=8, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, gradient_checkpointing=False, seed=3, duet=True,
        duet_screen=0, duet_refill_tries=8)
    trainer = Spy(model=demo_model_path(), reward_funcs=[_flat], args=args, train_dataset=data)
    trainer.train()
    duet = trainer.capability("duet")
    logged = [h for h in trainer.state.log_history if "duet/refilled_frac" in h]
    assert len(logged) == 6
    assert sum(h["duet/refilled_frac"] for h in logged) > 0  # half the prompts flat: idle ones were replaced
    assert all(h["duet/refilled_frac"] <= h["duet/idle_prompts_frac"] for h in logged)
    assert all(h["duet/idle_prompts_frac"] == 0 for h in logged[:2])  # nothing is warm in the first pass
    for inputs_prompts, prompts, answers in seen:
        assert prompts == inputs_prompts  # TRL tokenized and scored the rows it was given: substitutes included
        for g in range(0, 16, 4):  # whole groups: a substitute fills all its slots
            assert len({repr(p) for p in prompts[g:g + 4]}) == 1 and len(set(answers[g:g + 4])) == 1
    assert len(duet.controller.stats) > 0


def test_refill_needs_a_map_style_dataset(tmp_path):
    from datasets import IterableDataset

    from trl_fp8.app.demo.model import demo_model_path
    from trl_fp8.app.tasks.arithmetic import make_arithmetic_dataset

    rows = list(make_arithmetic_dataset(8, seed=5))
    stream = IterableDataset.from_generator(lambda: iter(rows))
    args = trl_fp8.GRPOConfig(
        output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, max_steps=1, per_device_train_batch_size=8,
        num_generations=4, max_completion_length=8, report_to="none", disable_tqdm=True, duet=True,
        duet_refill_tries=2)
    with pytest.raises(ValueError, match="duet_refill_tries=2 .*map-style"):
        trl_fp8.GRPOTrainer(model=demo_model_path(), reward_funcs=[_flat], args=args, train_dataset=stream)


def test_refill_tries_is_validated():
    with pytest.raises(ValueError, match="duet_refill_tries"):
        trl_fp8.GRPOConfig(output_dir="/tmp/x", use_cpu=True, duet=True, duet_refill_tries=-1)

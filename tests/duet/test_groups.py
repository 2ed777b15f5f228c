"""No lone rollouts: DUET gives a prompt 0 or >= duet_n_min rollouts, samples the prompts below n_min with the
right probability (unbiased with its 1/π weight), and a TRL-quickstart-shaped run (3 generations, β = 0.5) learns."""

import random

import pytest
import torch

import trl_fp8
from trl_fp8.duet.allocation import allocate_rollouts, inclusion_probabilities
from trl_fp8.duet.component import abort_grace
from trl_fp8.duet.controller import DuetController
from trl_fp8.app.tasks.arithmetic import correctness_reward, format_reward, make_arithmetic_dataset


def test_counts_are_zero_or_a_group():
    torch.manual_seed(0)
    rng = random.Random(0)
    for _ in range(50):
        s = torch.rand(12) * 2
        L = torch.randint(10, 200, (12,)).double()
        budget = float(torch.rand(()) * 3 * (L.sum()))
        n, _, pi = allocate_rollouts(s, L, budget, n_min=2, n_max=8, rng=rng)
        assert set(n.tolist()) <= {0, 2, 3, 4, 5, 6, 7, 8}
        assert torch.all((pi > 0) & (pi <= 1))
        assert torch.all(pi[n > 2] == 1)  # above the group size a prompt is certain


def test_three_slots_half_budget_samples_groups_of_two():
    """TRL's quickstart shape: 3 slots, β = 0.5, cold prompts (uniform): the target is 1.5 rollouts per prompt, so each
    prompt gets 2 rollouts with probability 0.75 -- never 1 -- and the expected cost is the budget."""
    L = torch.full((8,), 40.0)
    budget = 0.5 * 8 * 3 * 40.0
    n, _, pi = allocate_rollouts(torch.ones(8), L, budget, n_min=2, n_max=3, rng=random.Random(1))
    assert torch.allclose(pi, torch.full((8,), 0.75, dtype=torch.float64))
    assert set(n.tolist()) <= {0, 2}
    # the expected cost is the budget, plus the forced group of a batch whose 8 coins all failed (P0 = 0.25^8)
    assert float((pi * 2 * L).sum()) == pytest.approx(budget + 0.25 ** 8 * 2 * 40.0, rel=1e-12)


def test_sampling_frequency_matches_inclusion_probability():
    """Horvitz-Thompson: over many draws, each prompt is generated with frequency π_q, so 1{sampled}/π_q has mean 1
    for every prompt (the selection adds no bias to the batch gradient)."""
    s = torch.tensor([0.2, 0.5, 1.0, 3.0, 0.0])
    L = torch.tensor([100.0, 50.0, 80.0, 30.0, 60.0])
    rng = random.Random(7)
    draws = 4000
    hits = torch.zeros(5, dtype=torch.float64)
    for _ in range(draws):
        n, _, pi = allocate_rollouts(s, L, 500.0, n_min=2, n_max=8, rng=rng)
        hits += (n > 0).double() / pi
    estimate = hits / draws
    assert torch.allclose(estimate, torch.ones(5, dtype=torch.float64), atol=0.1), estimate
    assert float(pi[4]) == pytest.approx(0.05)  # zero informativeness: sampled at the floor, never never


def test_expected_cost_fits_the_budget():
    torch.manual_seed(3)
    s = torch.rand(20) * 2
    L = torch.randint(10, 150, (20,)).double()
    for budget in (200.0, 800.0, 2500.0):
        n, lam, pi = allocate_rollouts(s, L, budget, n_min=2, n_max=8, rng=None, at_least_one=False)
        targets = s / torch.sqrt(lam * L)
        expected = torch.where(targets >= 2, torch.clamp(torch.round(targets), 2, 8), pi * 2)
        assert float((expected * L).sum()) <= budget + 1e-6
        # with the forced group of an otherwise empty batch: at most P0 · n_min · max L more
        _, _, forced = allocate_rollouts(s, L, budget, n_min=2, n_max=8, rng=None)
        p0 = float(torch.prod(1 - pi))
        extra = torch.where(targets >= 2, torch.zeros_like(pi), (forced - pi) * 2)
        assert float((extra * L).sum()) <= p0 * 2 * float(L.max()) + 1e-9


def test_inclusion_probabilities_floor():
    pi = inclusion_probabilities(torch.tensor([0.0, 0.5, 1.0, 2.0, 5.0], dtype=torch.float64), 2, 0.05)
    assert pi.tolist() == pytest.approx([0.05, 0.25, 0.5, 1.0, 1.0])


def test_weights_carry_the_inverse_inclusion():
    c = DuetController(budget=0.5, slots=3, n_min=2, seed=0, default_length=10.0)
    plan = c.plan([f"p{i}" for i in range(16)])
    assert set(plan.counts.tolist()) <= {0, 2}
    w = c.weights(plan)
    assert w.numel() == int(plan.counts.sum())
    # cold prompts: every generated prompt has 2 rollouts (p = 1) and was sampled with π = 0.75
    assert torch.allclose(w, torch.full_like(w, 1 / 0.75))


def test_abort_grace_scales_with_the_completion_cap():
    assert abort_grace(None, 3072) == 150
    assert abort_grace(None, 224) == 11
    assert abort_grace(None, 16) == 8
    assert abort_grace(40, 16) == 40


@pytest.fixture(scope="module")
def demo_dir():
    from trl_fp8.app.demo.model import demo_model_path

    return demo_model_path()


def test_quickstart_shape_learns(tmp_path, demo_dir):
    """3 generations per prompt at β = 0.5 with the defaults: the weights change and the loss is not zero (the
    earlier n_min = 1 default gave every prompt one rollout: all advantages 0, nothing learned)."""
    from transformers import AutoModelForCausalLM

    before = {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(demo_dir).state_dict().items()}
    args = trl_fp8.GRPOConfig(
        output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, max_steps=3, learning_rate=1e-3,
        per_device_train_batch_size=24, num_generations=3, max_completion_length=16, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, seed=0, duet=True, duet_budget=0.5,
    )
    trainer = trl_fp8.GRPOTrainer(model=demo_dir, reward_funcs=[correctness_reward, format_reward], args=args,
                                  train_dataset=make_arithmetic_dataset(200, seed=2))
    trainer.train()
    after = trainer.model.state_dict()
    changed = sum(not torch.equal(before[k], after[k].cpu()) for k in before)
    assert changed > 0
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert any(h["grad_norm"] > 0 for h in logs)
    assert all(h["duet/rollouts_per_prompt/min"] in (0.0, 2.0) for h in logs)
    assert all(h["duet/rollouts_per_prompt/max"] <= 3 for h in logs)
    assert any(h["duet/prompts_without_rollouts_frac"] > 0 for h in logs)


def test_prior_strength_gives_a_once_silent_prompt_its_group_again():
    """The failure seen on SmolLM2 (2 prompts a step, β = 0.5): both prompts of a step had shown one zero-variance
    group of 4, so DUET planned no rollout at all (a wasted step) or one prompt only. With shrinkage they are planned
    from the mean of all observed groups, and the step spends its budget."""
    plans = {0.0: [], 1.0: []}
    for k in plans:
        for seed in range(50):  # one step each: the first visit after the zero (the re-probe floor comes later)
            c = DuetController(budget=0.5, slots=8, n_min=2, seed=seed, default_length=20.0, prior_strength=k)
            c.stats.update("other", 5.0, [20, 20])  # an informative group elsewhere in the pool
            for key in ("a", "b"):
                c.stats.update(key, 0.0, [20] * 4)
            plans[k].append(c.plan(["a", "b"]))
    # unshrunk: each prompt is drawn with the propensity floor only (0.05), so almost every step's coins all fail and
    # it gets only the forced single group (never nothing: see allocation._at_least_one_group)
    assert sum(int(p.counts.sum()) == 2 for p in plans[0.0]) >= 40
    assert all(int(p.counts.sum()) > 0 for p in plans[0.0])
    # shrunk: both prompts are alike, each gets the group the budget buys (0.5 x 2 prompts x 8 = 8 rollouts)
    assert all(p.counts.tolist() == [4, 4] for p in plans[1.0])

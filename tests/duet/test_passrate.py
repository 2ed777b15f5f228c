"""DUET's pass-rate allocator: a Beta posterior of each prompt's pass rate, aged by recurrence, and a greedy fill that
gives whole groups where a group is likely to show reward variance, per generated token."""

import random

import pytest
import torch

import trl_fp8
from trl_fp8.app.tasks.arithmetic import make_arithmetic_dataset
from trl_fp8.duet.controller import DuetController
from trl_fp8.duet.passrate import PassRates, allocate_by_variance, power_moment, variance_probability


def test_power_moment_is_the_beta_moment():
    # Beta(1, 1) is uniform: E[p^n] = 1 / (n + 1)
    for n in range(6):
        assert power_moment(1.0, 1.0, n) == pytest.approx(1.0 / (n + 1), abs=1e-15)
    # Beta(2, 3): E[p] = 2/5, E[p^2] = 2*3 / (5*6)
    assert power_moment(2.0, 3.0, 1) == pytest.approx(0.4)
    assert power_moment(2.0, 3.0, 2) == pytest.approx(0.2)
    # against a numerical integral of a non-integer Beta
    a, b, n = 2.5, 0.7, 4
    p = torch.linspace(0, 1, 400_001, dtype=torch.float64)[1:-1]
    density = p ** (a - 1) * (1 - p) ** (b - 1)
    assert power_moment(a, b, n) == pytest.approx(float((density * p ** n).sum() / density.sum()), rel=2e-3)
    with pytest.raises(ValueError, match="positive"):
        power_moment(0.0, 1.0, 2)


def test_variance_probability_tends_to_the_known_pass_rate_and_is_zero_below_two():
    # a posterior concentrated at p = 0.9: 1 - 0.9^n - 0.1^n
    a, b = 0.9e7, 0.1e7
    assert variance_probability(a, b, 8) == pytest.approx(1 - 0.9 ** 8 - 0.1 ** 8, rel=1e-5)
    assert variance_probability(a, b, 2) == pytest.approx(0.18, rel=1e-5)
    assert variance_probability(1.0, 1.0, 3) == pytest.approx(1 - 2 / 4)
    assert variance_probability(3.0, 3.0, 1) == variance_probability(3.0, 3.0, 0) == 0.0


def test_pass_rates_prior_follows_the_latest_batch_and_counts_age_by_recurrence():
    rates = PassRates(decay=0.5)
    assert rates.prior() == (1.0, 1.0)  # neutral before anything was observed
    a, b = rates.lookup(["cold"])
    assert (a.tolist(), b.tolist()) == ([1.0], [1.0]) and "cold" not in rates
    rates.update("q", passes=6, fails=2)
    rates.observe_batch(passes=3, total=4)
    assert rates.prior() == (1.5, 0.5)
    a, b = rates.lookup(["q", "cold"])  # q comes up again: its counts halve once
    assert a.tolist() == [1.5 + 3.0, 1.5] and b.tolist() == [0.5 + 1.0, 0.5]
    assert rates.counts("q") == (3.0, 1.0)
    rates.update("q", passes=1, fails=1)
    assert rates.counts("q") == (4.0, 2.0)
    rates.observe_batch(passes=0, total=0)  # nothing kept: the prior stays
    assert rates.prior() == (1.5, 0.5)
    rates.observe_batch(passes=5, total=5)  # all passed: the prior's mean is kept inside [0.01, 0.99]
    assert rates.prior() == pytest.approx((1.98, 0.02))
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="decay must be in"):
            PassRates(decay=bad)
    with pytest.raises(ValueError, match="passes and fails"):
        rates.update("q", -1, 2)


def test_pass_rates_state_round_trips_and_the_table_is_bounded():
    rates = PassRates(decay=0.75, capacity=2)
    for i, key in enumerate(["a", "b", "c"]):
        rates.update(key, i, 2)
    assert "a" not in rates and len(rates) == 2  # least recently used dropped
    rates.lookup(["b"])
    rates.observe_batch(2, 5)
    other = PassRates(decay=0.75, capacity=2)
    other.load_state_dict(rates.state_dict())
    assert other.state_dict() == rates.state_dict()
    assert [x.tolist() for x in other.lookup(["b", "c", "z"])] == [x.tolist() for x in rates.lookup(["b", "c", "z"])]


def _posterior(p: float, strength: float = 1e6) -> tuple[float, float]:
    return p * strength, (1 - p) * strength


def test_whole_groups_go_where_variance_per_token_is_likeliest():
    # pass rates 0.5, 0.999, 0.9, 0.5 (long rollouts): values V(8) = 0.992, 0.008, 0.570, 0.992; per token the
    # order is 0 (L 10), 3 (L 20: 0.0496), 2 (0.057 at L 10 beats it), ... -> 0, 2, 3, 1
    rates = [0.5, 0.999, 0.9, 0.5]
    a = torch.tensor([_posterior(p)[0] for p in rates])
    b = torch.tensor([_posterior(p)[1] for p in rates])
    lengths = torch.tensor([10.0, 10.0, 10.0, 20.0])
    counts, inclusion, value = allocate_by_variance(a, b, lengths, budget=160.0, n_min=2, n_max=8)
    assert value.tolist() == pytest.approx([1 - 2 * 0.5 ** 8, 1 - 0.999 ** 8 - 0.001 ** 8, 1 - 0.9 ** 8 - 0.1 ** 8,
                                            1 - 2 * 0.5 ** 8], rel=1e-4)
    # 0 and 2 take 8 each (160 tokens): nothing left; 1 and 3 get no group and the coin's inclusion
    assert counts.tolist() == [8, 0, 8, 0]
    assert inclusion.tolist() == [1.0, 0.05, 1.0, 0.05]
    # a larger budget: 3 fills next (160 tokens), then 1 gets what is left if it reaches n_min
    counts, _, _ = allocate_by_variance(a, b, lengths, budget=340.0, n_min=2, n_max=8)
    assert counts.tolist() == [8, 2, 8, 8]
    counts, inclusion, _ = allocate_by_variance(a, b, lengths, budget=335.0, n_min=2, n_max=8)
    assert counts.tolist() == [8, 0, 8, 8] and inclusion[1] == 0.05  # 15 tokens left: one rollout, below n_min
    # a partial group where the budget ends in the middle of a prompt
    counts, _, _ = allocate_by_variance(a, b, lengths, budget=200.0, n_min=2, n_max=8)
    assert counts.tolist() == [8, 0, 8, 2]


def test_a_nearly_solved_prompt_gets_a_whole_group_before_a_solved_one():
    """The race's diagnosis: at p = 0.9 a group of 8 shows variance 57 % of the time; the allocator gives it one
    rather than splitting the budget into groups of 2 that would look all-right."""
    a = torch.tensor([_posterior(0.9)[0], _posterior(1 - 1e-6)[0]])
    b = torch.tensor([_posterior(0.9)[1], _posterior(1 - 1e-6)[1]])
    counts, _, _ = allocate_by_variance(a, b, torch.tensor([10.0, 10.0]), budget=80.0, n_min=2, n_max=8)
    assert counts.tolist() == [8, 0]


def test_cold_prompts_hold_their_screens_first_and_compete_for_the_rest():
    a = torch.tensor([_posterior(0.5)[0], 1.0, 1.0])
    b = torch.tensor([_posterior(0.5)[1], 1.0, 1.0])
    cold = torch.tensor([False, True, True])
    lengths = torch.full((3,), 10.0)
    # screens: 2 x 2 x 10 = 40 tokens; 80 left: the warm p=0.5 prompt (value 0.992) fills 8, then nothing is left
    counts, inclusion, _ = allocate_by_variance(a, b, lengths, budget=120.0, n_min=2, n_max=8, cold=cold, screen=2)
    assert counts.tolist() == [8, 2, 2] and inclusion.tolist() == [1.0, 1.0, 1.0]
    # 30 tokens more: the first cold prompt extends by 3 (an extension needs no n_min)
    counts, _, _ = allocate_by_variance(a, b, lengths, budget=150.0, n_min=2, n_max=8, cold=cold, screen=2)
    assert counts.tolist() == [8, 5, 2]


def test_the_coin_and_the_never_empty_rule():
    a = torch.tensor([_posterior(0.999)[0]] * 3)
    b = torch.tensor([_posterior(0.999)[1]] * 3)
    lengths = torch.full((3,), 100.0)
    # a budget below one group: the first prompt (ties in prompt order) still gets n_min, certainly
    counts, inclusion, _ = allocate_by_variance(a, b, lengths, budget=50.0, n_min=2, n_max=8)
    assert counts.tolist() == [2, 0, 0] and inclusion.tolist() == [1.0, 0.05, 0.05]
    # with an rng the left-out prompts toss a coin each, in prompt order
    rng, ref = random.Random(4), random.Random(4)
    counts, _, _ = allocate_by_variance(a, b, lengths, budget=50.0, n_min=2, n_max=8, rng=rng, min_inclusion=0.5)
    expected = [2] + [2 if ref.random() < 0.5 else 0 for _ in range(2)]
    assert counts.tolist() == expected
    with pytest.raises(ValueError, match="n_min"):
        allocate_by_variance(a, b, lengths, 50.0, n_min=1, n_max=8)
    with pytest.raises(ValueError, match="screen"):
        allocate_by_variance(a, b, lengths, 50.0, n_min=2, n_max=8, screen=9)
    with pytest.raises(ValueError, match="lengths must be positive"):
        allocate_by_variance(a, b, torch.zeros(3), 50.0, n_min=2, n_max=8)


def _controller(**kw) -> DuetController:
    return DuetController(budget=0.5, slots=8, n_min=2, seed=0, default_length=10.0, screen=0,
                          allocator="pass_rate", **kw)


def _observe(c: DuetController, keys: list[str], rewards_by_key: dict[str, list[float]]) -> None:
    plan = c.plan(keys)
    plan.counts = torch.tensor([len(rewards_by_key[k]) for k in keys])
    plan.monitors = [c._monitor() for _ in range(int(plan.counts.sum()))]
    rewards = torch.tensor([r for k in keys for r in rewards_by_key[k]], dtype=torch.float64)
    n = rewards.numel()
    c.observe(plan, [10] * n, rewards - rewards.mean(), -torch.ones(n, dtype=torch.float64), rewards=rewards)


def test_the_controller_learns_passes_from_rewards_and_plans_with_them():
    c = _controller(pass_decay=0.5)
    keys = ["nearly", "solved", "hard"]
    _observe(c, keys, {"nearly": [1.0] * 7 + [0.0], "solved": [1.0] * 8, "hard": [0.0] * 7 + [0.5]})
    # threshold 0.5: the hard prompt's 0.5 passes; the batch's rate 16/24 is the prior's mean now
    assert c.pass_rates.counts("nearly") == (7, 1) and c.pass_rates.counts("solved") == (8, 0)
    assert c.pass_rates.counts("hard") == (1, 7)
    assert c.pass_rates.recent_rate == pytest.approx(16 / 24)
    # budget 0.5 x 3 x 8 x 10 = 120 tokens: one whole group and half of another. After ageing, the posteriors are
    # Beta(4/3 + 3.5, 2/3 + 0.5), Beta(4/3 + 4, 2/3), Beta(4/3 + 0.5, 2/3 + 3.5): V(8) = 0.675, 0.463, 0.839
    plan = c.plan(keys)
    counts = dict(zip(keys, plan.counts.tolist()))
    assert counts == {"hard": 8, "nearly": 4, "solved": 0}
    assert c.pass_rates.counts("nearly") == (3.5, 0.5)  # aged once by the lookup
    with pytest.raises(ValueError, match="needs them"):
        c.observe(plan, [10] * int(plan.counts.sum()), torch.zeros(int(plan.counts.sum())),
                  torch.zeros(int(plan.counts.sum())))
    with pytest.raises(ValueError, match="allocator must be one of"):
        DuetController(budget=0.5, slots=8, allocator="greedy")


def test_every_cold_prompt_is_screened_and_a_mixed_screen_continues_from_the_pool():
    """4 cold prompts, budget 0.5 x 4 x 8 x 10 = 160 tokens: screens of 2 take 80, the first cold prompt extends by 6
    (60), the second by 2 (20). All four are screened; the screens of prompts 2 and 3 are mixed, those of 0 and 1
    uniform (neither kept: keep prob ~0), so the pool of 8 goes round-robin to 2 and 3: groups of 6 each."""
    c = DuetController(budget=0.5, slots=8, n_min=2, seed=0, default_length=10.0, screen=2, screen_keep_prob=1e-12,
                       allocator="pass_rate")
    plan = c.plan(["a", "b", "c", "d"])
    assert plan.planned.tolist() == [8, 4, 2, 2] and plan.counts.tolist() == [2, 2, 2, 2]
    assert plan.screened.tolist() == [True] * 4
    new_rows = c.after_screen(plan, [True, True, False, False])
    assert plan.counts.tolist() == [2, 2, 6, 6]
    assert new_rows == [2 * 8 + j for j in range(2, 6)] + [3 * 8 + j for j in range(2, 6)]


def test_a_screen_larger_than_the_group_is_the_whole_group():
    c = DuetController(budget=0.5, slots=2, n_min=2, seed=0, default_length=10.0, screen=4, allocator="pass_rate")
    plan = c.plan(["a", "b"])
    assert plan.counts.tolist() == [2, 2] and plan.screened.tolist() == [True, True]


def test_the_controller_state_keeps_the_pass_rates():
    c = _controller()
    _observe(c, ["x", "y"], {"x": [1.0, 0.0, 1.0], "y": [0.0, 0.0]})
    state = c.state_dict()
    other = _controller()
    other.load_state_dict(state)
    assert other.pass_rates.state_dict() == c.pass_rates.state_dict()
    assert other.plan(["x", "y", "z"]).counts.tolist() == c.plan(["x", "y", "z"]).counts.tolist()
    del state["pass_rates"]  # a checkpoint from before the pass-rate allocator: the rates start afresh
    fresh = _controller()
    fresh.load_state_dict(state)
    assert len(fresh.pass_rates) == 0


def test_the_informativeness_allocator_keeps_no_pass_rates(tmp_path):
    from trl_fp8.app.demo.model import demo_model_path

    trainer = trl_fp8.GRPOTrainer(
        model=demo_model_path(), reward_funcs=[_solved_or_mixed],
        args=trl_fp8.GRPOConfig(
            output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, max_steps=2, learning_rate=1e-4,
            per_device_train_batch_size=32, num_generations=8, max_completion_length=8, logging_steps=1,
            save_strategy="no", report_to="none", disable_tqdm=True, seed=3, duet=True, duet_budget=0.5),
        train_dataset=make_arithmetic_dataset(4, seed=1))
    trainer.train()
    controller = trainer.capability("duet").controller
    assert len(controller.stats) > 0 and len(controller.pass_rates) == 0


# -- in the trainer ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo_dir():
    from trl_fp8.app.demo.model import demo_model_path

    return demo_model_path()


def _solved_or_mixed(completions, answer, **kwargs):
    """Prompts with an even answer always pass; the others alternate pass/fail within a call."""
    return [1.0 if int(a) % 2 == 0 else float(i % 2) for i, a in enumerate(answer)]


def test_the_trainer_feeds_the_total_reward_and_the_allocator_favours_mixed_prompts(tmp_path, demo_dir):
    data = make_arithmetic_dataset(4, seed=1)
    even = sum(int(a) % 2 == 0 for a in data["answer"])
    assert 0 < even < 4  # both kinds of prompt are in the pool
    trainer = trl_fp8.GRPOTrainer(
        model=demo_dir, reward_funcs=[_solved_or_mixed],
        args=trl_fp8.GRPOConfig(
            output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, max_steps=4, learning_rate=1e-4,
            per_device_train_batch_size=32, num_generations=8, max_completion_length=8, logging_steps=1,
            save_strategy="no", report_to="none", disable_tqdm=True, seed=3, duet=True, duet_budget=0.5,
            duet_allocator="pass_rate", duet_pass_threshold=1.0),
        train_dataset=data)
    trainer.train()
    controller = trainer.capability("duet").controller
    assert len(controller.pass_rates) == 4  # every prompt was observed
    keys = {}
    for row in data:
        from trl_fp8.duet.component import prompt_key

        keys[prompt_key(trainer._tokenize_prompts([row["prompt"]])[0][0])] = int(row["answer"]) % 2 == 0
    for key, solved in keys.items():
        passes, fails = controller.pass_rates.counts(key)
        assert passes > 0
        assert (fails == 0) == solved  # an even answer never failed; the others failed as often as they passed
    # the budget (half of 4 prompts x 8 slots) goes to the mixed prompts in whole groups; the solved one gets at most
    # the coin's n_min
    plan = controller.plan(list(keys))
    counts = dict(zip(keys.values(), plan.counts.tolist()))
    mixed = [n for (_, solved), n in zip(keys.items(), plan.counts.tolist(), strict=True) if not solved]
    assert max(mixed) == 8 and counts[True] <= 2


def test_a_reward_of_none_is_neither_a_pass_nor_a_fail():
    """TRL's None ("this reward function does not apply to this sample", NaN once TRL gathered the rewards): a
    function that returned None is left out of the row's total, as TRL's nansum does, and a row no function applied
    to is not judged at all, neither a pass nor a fail of its prompt."""
    from trl_fp8.duet.passrate import total_rewards

    nan = float("nan")
    per_func = torch.tensor([[1.0, nan], [nan, nan], [0.0, 0.2], [nan, 1.0]])
    total = total_rewards(per_func, torch.tensor([1.0, 0.5]))
    assert total[0] == 1.0 and torch.isnan(total[1]) and total[2] == pytest.approx(0.1) and total[3] == 0.5
    c = _controller(pass_decay=1.0)
    _observe(c, ["some_unjudged", "all_unjudged"], {"some_unjudged": [1.0, nan, 0.0, nan],
                                                     "all_unjudged": [nan, nan]})
    assert c.pass_rates.counts("some_unjudged") == (1, 1)  # the two None rows count nowhere
    assert "all_unjudged" not in c.pass_rates  # nothing observed of it: still cold
    assert c.pass_rates.recent_rate == pytest.approx(0.5)  # 1 pass of 2 judged rollouts

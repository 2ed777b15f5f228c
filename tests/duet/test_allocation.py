import pytest
import torch

from trl_fp8.duet.allocation import allocate_rollouts, importance_weights, propensities


def _cost(n, L):
    return float((n.double() * torch.as_tensor(L, dtype=torch.float64)).sum())


def _expected_cost(s, L, lam, pi, n_min, n_max):
    t = torch.as_tensor(s, dtype=torch.float64) / torch.sqrt(lam * torch.as_tensor(L, dtype=torch.float64))
    return _cost(torch.where(t >= n_min, torch.clamp(torch.round(t), n_min, n_max), pi * n_min), L)


def test_budget_respected_and_used():
    torch.manual_seed(0)
    s = torch.rand(16) * 3
    L = torch.randint(20, 200, (16,)).double()
    for budget in (300.0, 1500.0, 3000.0, 8000.0):
        # (the forced group of an otherwise empty batch adds P0 · n_min · L to the expected cost: tested below)
        n, lam, pi = allocate_rollouts(s, L, budget, n_min=2, n_max=16, at_least_one=False)
        expected = _expected_cost(s, L, lam, pi, 2, 16)
        assert expected <= budget + 1e-6
        assert set(n.tolist()) <= {0} | set(range(2, 17))
        # not wastefully small: one more rollout for some prompt would break the budget (or all are at n_max)
        assert budget - expected < L.max() * 4 or bool((n == 16).all())


def test_neyman_proportions_without_clipping():
    s = torch.tensor([1.0, 2.0, 4.0])
    L = torch.tensor([100.0, 100.0, 100.0])
    n, _, pi = allocate_rollouts(s, L, budget=1400.0, n_min=2, n_max=32)
    assert n.tolist() == [2, 4, 8] and pi.tolist() == [1.0, 1.0, 1.0]
    # cost-weighted: 4x the length -> half the rollouts at equal informativeness
    n, _, _ = allocate_rollouts(torch.tensor([4.0, 4.0]), torch.tensor([25.0, 100.0]), budget=1200.0)
    assert n[0] == 2 * n[1]


def test_monotone_in_informativeness():
    L = torch.full((8,), 50.0)
    s = torch.linspace(0.1, 3.0, 8)
    n, _, pi = allocate_rollouts(s, L, budget=1500.0, n_min=2, n_max=32)
    assert torch.all(n[1:] >= n[:-1])
    assert torch.all(pi[1:] >= pi[:-1])


def test_bounds_and_ties_and_all_cold_uniform():
    L = torch.full((4,), 10.0)
    n, _, _ = allocate_rollouts(torch.ones(4), L, budget=10_000.0, n_min=2, n_max=8)
    assert n.tolist() == [8, 8, 8, 8]  # n_max caps
    n, _, pi = allocate_rollouts(torch.ones(4), L, budget=1.0, n_min=2, n_max=8, at_least_one=False)
    assert pi.tolist() == [0.05] * 4  # an impossible budget: every prompt at the sampling floor
    n, _, _ = allocate_rollouts(torch.ones(6), torch.full((6,), 30.0), budget=6 * 4 * 30.0, n_min=2, n_max=8)
    assert n.tolist() == [4] * 6  # all-cold (prior 1, batch-mean length): uniform, the budget exactly
    n, _, pi = allocate_rollouts(torch.zeros(3), torch.full((3,), 10.0), budget=1000.0, n_min=2, n_max=8,
                                 at_least_one=False)
    assert pi.tolist() == [0.05] * 3  # nothing to learn by the surrogate: sampled at the floor only


def test_long_prompts_are_sampled_not_dropped():
    """Where the old rule trimmed the longest prompts for good, a prompt below n_min now keeps a chance π > 0."""
    s = torch.tensor([1.0, 1.0])
    L = torch.tensor([10.0, 100.0])
    n, _, pi = allocate_rollouts(s, L, budget=120.0, n_min=2, n_max=4)
    assert pi[1] < 1 and pi[1] >= 0.05 and pi[0] == 1
    assert _expected_cost(s, L, allocate_rollouts(s, L, 120.0, 2, 4)[1], pi, 2, 4) <= 120.0 + 1e-6


def test_bad_inputs():
    with pytest.raises(ValueError, match="n_min"):
        allocate_rollouts(torch.ones(2), torch.ones(2), 10.0, n_min=3, n_max=2)
    with pytest.raises(ValueError, match="lengths must be positive"):
        allocate_rollouts(torch.ones(2), torch.zeros(2), 10.0)
    with pytest.raises(ValueError, match="equal size"):
        allocate_rollouts(torch.ones(2), torch.ones(3), 10.0)


def test_propensities_and_weights():
    p = propensities(torch.tensor([1, 2, 4, 8, 100]), min_propensity=0.05)
    mean = (1 + 2 + 4 + 8 + 100) / 5
    assert torch.allclose(p, torch.tensor([max(1 / mean, 0.05), 2 / mean, 4 / mean, 8 / mean, 1.0], dtype=torch.float64))
    w = importance_weights(torch.tensor([0.5, 0.01, 1.0, 0.5]), torch.tensor([False, False, False, True]),
                           keep_prob=0.05, min_propensity=0.05, max_weight=1000.0)
    assert w.tolist() == pytest.approx([2.0, 20.0, 1.0, 40.0])
    assert importance_weights(torch.tensor([0.001]), torch.tensor([True]), max_weight=100.0).item() == 100.0


class _Draws:
    """A random stream that hands out the given values in order."""

    def __init__(self, values):
        self.values = list(values)

    def random(self):
        return self.values.pop(0)


def test_a_batch_always_gets_at_least_one_group_with_its_marginal_inclusion():
    """Every coin fails (draws 0.99 > π): one prompt is picked by the extra draw, with probability π_q / Σ π, and the
    returned inclusion is the marginal π'_q = π_q + P0 π_q / Σ π of the two-stage draw."""
    s = torch.tensor([0.0, 0.0, 0.0])  # nothing known: every prompt sampled at the floor 0.05
    L = torch.full((3,), 10.0)
    n, _, pi = allocate_rollouts(s, L, 1000.0, n_min=2, n_max=8, rng=_Draws([0.99, 0.99, 0.99, 0.5]))
    p0 = 0.95 ** 3
    assert n.tolist() == [0, 2, 0]  # 0.5 falls in the second third
    assert pi.tolist() == pytest.approx([0.05 + p0 / 3] * 3)
    # a coin that succeeds: no extra draw, the same marginal inclusion
    draws = _Draws([0.99, 0.01, 0.99])
    n, _, pi2 = allocate_rollouts(s, L, 1000.0, n_min=2, n_max=8, rng=draws)
    assert n.tolist() == [0, 2, 0] and draws.values == [] and torch.equal(pi, pi2)
    # some prompt certain to get rollouts: nothing changes
    n, _, pi = allocate_rollouts(torch.tensor([5.0, 0.0]), torch.full((2,), 10.0), 40.0, n_min=2, n_max=8,
                                 rng=_Draws([0.99]))
    assert n[0] >= 2 and pi[0] == 1.0 and pi[1] == 0.05


def test_the_forced_group_keeps_horvitz_thompson_unbiased():
    """Exact: over every outcome of the independent coins and the forced pick, P(q gets rollouts) equals the returned
    π'_q, so E[1{q sampled} / π'_q] = 1 for every prompt (unequal π included)."""
    import itertools

    s = torch.tensor([0.02, 0.05, 0.09])
    L = torch.full((3,), 10.0)
    _, lam, pi_base = allocate_rollouts(s, L, 5.0, n_min=2, n_max=8, at_least_one=False)
    _, _, pi = allocate_rollouts(s, L, 5.0, n_min=2, n_max=8)
    base = pi_base.tolist()
    assert all(x < 1 for x in base)
    prob_in = [0.0] * 3
    for coins in itertools.product([True, False], repeat=3):
        p = 1.0
        for c, b in zip(coins, base):
            p *= b if c else 1 - b
        if any(coins):
            for q in range(3):
                prob_in[q] += p * coins[q]
        else:  # the forced pick, with probability π_q / Σ π
            for q in range(3):
                prob_in[q] += p * base[q] / sum(base)
    assert prob_in == pytest.approx(pi.tolist(), rel=1e-12)
    # and the sampler draws that way (frequencies from the seeded stream)
    import random

    rng = random.Random(0)
    hits = torch.zeros(3)
    trials = 1500
    for _ in range(trials):
        n, _, _ = allocate_rollouts(s, L, 5.0, n_min=2, n_max=8, rng=rng)
        assert int(n.sum()) >= 2
        hits += (n > 0).double()
    assert (hits / trials).tolist() == pytest.approx(pi.tolist(), abs=0.04)  # sd of a frequency <= 0.013

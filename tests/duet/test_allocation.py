import pytest
import torch

from trl_fp8.duet.allocation import allocate_rollouts, importance_weights, propensities


def _cost(n, L):
    return float((n.double() * torch.as_tensor(L, dtype=torch.float64)).sum())


def test_budget_respected_and_used():
    torch.manual_seed(0)
    s = torch.rand(16) * 3
    L = torch.randint(20, 200, (16,)).double()
    for budget in (1500.0, 3000.0, 8000.0):  # all above the n_min floor (1346 tokens)
        n, lam = allocate_rollouts(s, L, budget, n_min=1, n_max=16)
        assert _cost(n, L) <= budget
        assert n.min() >= 1 and n.max() <= 16
        # no single prompt could get one more rollout (below n_max) without breaking the budget by much more
        # than its length: the allocation is not wastefully small
        assert budget - _cost(n, L) < L.max() * 4 or bool((n == 16).all())


def test_neyman_proportions_without_clipping():
    s = torch.tensor([1.0, 2.0, 4.0])
    L = torch.tensor([100.0, 100.0, 100.0])
    n, _ = allocate_rollouts(s, L, budget=700.0, n_min=1, n_max=32)
    assert n.tolist() == [1, 2, 4]
    # cost-weighted: 4x the length -> half the rollouts at equal informativeness
    n, _ = allocate_rollouts(torch.tensor([4.0, 4.0]), torch.tensor([25.0, 100.0]), budget=600.0)
    assert n[0] == 2 * n[1]


def test_monotone_in_informativeness():
    L = torch.full((8,), 50.0)
    s = torch.linspace(0.1, 3.0, 8)
    n, _ = allocate_rollouts(s, L, budget=1500.0, n_min=1, n_max=32)
    assert torch.all(n[1:] >= n[:-1])


def test_bounds_and_ties_and_all_cold_uniform():
    L = torch.full((4,), 10.0)
    n, _ = allocate_rollouts(torch.ones(4), L, budget=10_000.0, n_min=2, n_max=8)
    assert n.tolist() == [8, 8, 8, 8]  # n_max caps
    n, _ = allocate_rollouts(torch.ones(4), L, budget=1.0, n_min=2, n_max=8)
    assert n.tolist() == [2, 2, 2, 2]  # n_min floors even an impossible budget
    n, _ = allocate_rollouts(torch.ones(6), torch.full((6,), 30.0), budget=6 * 4 * 30.0, n_min=1, n_max=8)
    assert n.tolist() == [4] * 6  # all-cold (prior 1, batch-mean length): uniform, the budget exactly
    n, _ = allocate_rollouts(torch.zeros(3), torch.full((3,), 10.0), budget=1000.0, n_min=1, n_max=8)
    assert n.tolist() == [1, 1, 1]


def test_trim_decrements_the_longest_first():
    s = torch.tensor([1.0, 1.0])
    L = torch.tensor([10.0, 100.0])
    n, _ = allocate_rollouts(s, L, budget=110.0, n_min=1, n_max=1)
    assert n.tolist() == [1, 1]
    n, _ = allocate_rollouts(torch.tensor([10.0, 10.0]), L, budget=150.0, n_min=0 + 1, n_max=4)
    assert _cost(n, L) <= 150.0 and n[1] == 1


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

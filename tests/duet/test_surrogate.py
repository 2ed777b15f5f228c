import math

import pytest
import torch

from trl_fp8.duet.surrogate import LengthQuantiles, PromptStats, informativeness


def test_informativeness_is_the_std_of_advantage_times_logp():
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    logp = torch.tensor([-2.0, -4.0, -2.0, -4.0])
    g = adv * logp
    assert informativeness(adv, logp) == pytest.approx(float(g.std(unbiased=False)))
    assert informativeness(torch.zeros(4), logp) == 0.0  # all rewards agree -> zero advantages
    assert informativeness(torch.tensor([1.0]), torch.tensor([-1.0])) == 0.0


def test_welford_means_lru_bound_and_cold_prior():
    st = PromptStats(capacity=2, prior_s=1.0, default_length=40.0)
    st.update("a", 2.0, [10, 20])
    st.update("a", 4.0, [30, 30])
    s, L, warm, _ = st.lookup(["a", "new"])
    assert s.tolist() == [3.0, 1.0] and L.tolist() == [22.5, 40.0] and warm.tolist() == [True, False]
    st.observe_batch_lengths([12, 18])
    assert st.lookup(["new"])[1].tolist() == [15.0]  # cold length: the latest batch mean
    st.update("b", 1.0, [5, 5])
    st.lookup(["a"])  # touch a: b is now the least recently used
    st.update("c", 1.0, [5, 5])
    assert "a" in st and "c" in st and "b" not in st and len(st) == 2
    st.update("d", 9.0, [5])  # a single rollout is no observation
    assert "d" not in st


def test_reprobe_flag_after_stale_allocations():
    st = PromptStats(reprobe_every=2)
    st.update("z", 0.0, [5, 5])  # zero variance once
    flags = [st.lookup(["z"])[3].item() for _ in range(4)]
    assert flags == [False, False, True, True]
    st.update("z", 0.5, [5, 5])
    assert st.lookup(["z"])[3].item() is False


def test_length_quantiles_refit_schedule():
    q = LengthQuantiles(refit_every=10, min_count=4)
    q.step()
    assert math.isinf(q.k1)
    q.add([10, 20, 30, 40, 50])
    for _ in range(9):  # steps 1..9: not due
        q.step()
    assert math.isinf(q.k1)
    q.step()  # step 10: refit
    assert q.k1 == pytest.approx(22.0) and q.k2 == pytest.approx(42.0)

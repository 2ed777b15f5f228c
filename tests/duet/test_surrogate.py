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


def test_shrinkage_towards_the_mean_of_all_observed_groups():
    st = PromptStats(prior_s=1.0, prior_strength=1.0)
    assert st.lookup(["new"])[0].tolist() == [1.0]  # nothing observed yet: the cold prior
    st.update("zero", 0.0, [5, 5])  # one group whose rewards all agreed
    st.update("busy", 6.0, [5, 5])
    st.update("busy", 2.0, [5, 5])  # busy: mean 4 over 2 groups; all groups: mean (0 + 6 + 2) / 3
    m = 8.0 / 3
    s = st.lookup(["zero", "busy", "cold"])[0].tolist()
    assert s == pytest.approx([(0.0 + m) / 2, (2 * 4.0 + m) / 3, m])
    assert s[0] > 0  # one zero-variance group no longer silences the prompt
    unshrunk = PromptStats(prior_s=1.0)
    for key, v in (("zero", 0.0), ("busy", 6.0), ("busy", 2.0)):
        unshrunk.update(key, v, [5, 5])
    assert unshrunk.lookup(["zero", "busy", "cold"])[0].tolist() == [0.0, 4.0, 1.0]  # k = 0: as before
    with pytest.raises(ValueError, match="prior_strength must be >= 0, got -1"):
        PromptStats(prior_strength=-1)


def test_shrinkage_state_round_trips_and_old_states_load():
    st = PromptStats(prior_strength=2.0)
    st.update("a", 3.0, [4, 6])
    state = st.state_dict()
    assert state["groups"] == 1 and state["mean_all"] == 3.0
    again = PromptStats(prior_strength=2.0)
    again.load_state_dict(state)
    assert again.lookup(["a", "b"])[0].tolist() == st.lookup(["a", "b"])[0].tolist() == [3.0, 3.0]
    old = {k: v for k, v in state.items() if k not in ("groups", "mean_all")}  # written before shrinkage
    again.load_state_dict(old)
    assert again.groups == 0 and again.lookup(["b"])[0].tolist() == [1.0]


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

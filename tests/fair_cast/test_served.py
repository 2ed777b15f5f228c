import pytest
import torch

from trl_fp8.fair_cast.served import ServedCopy


def _params(seed=0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(64, 32)
    return lin, list(lin.named_parameters())


@pytest.mark.parametrize("mode", ["rtn", "stochastic", "error_feedback"])
def test_cycle_keeps_master_fp32_and_params_on_served_values(mode):
    lin, named = _params()
    start = {n: p.detach().clone() for n, p in named}
    copy = ServedCopy.from_named_params(named, mode, torch.bfloat16, seed=3)
    copy.begin()
    for n, p in lin.named_parameters():
        assert torch.equal(copy.master[n], start[n])
        assert torch.equal(p.data, copy.served[n].float())  # the learner computes on the served values
    opt = torch.optim.SGD(lin.parameters(), lr=1e-3)
    for step in range(1, 4):
        loss = lin(torch.randn(8, 64)).pow(2).mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in lin.named_parameters()}
        masters = {n: t.clone() for n, t in copy.master.items()}
        copy.before_step()
        opt.step()
        opt.zero_grad()
        metrics = copy.after_step(step)
        for n, p in lin.named_parameters():
            # straight-through: the master moved by the gradient taken at the served values
            assert torch.equal(copy.master[n], masters[n].add(grads[n], alpha=-1e-3))
            assert torch.equal(p.data, copy.served[n].float())
        assert set(metrics) == {"visible_update_frac", "lag_steps", "max_abs_err_ulps"} or step == 1
        # SR < 1 ulp; RTN <= 1/2 ulp; EF: |r_old - r_new| <= 1/2 ulp(v_t) + 1/2 ulp(v_t-1), where v may sit one
        # binade above w, so up to 2 ulps of w (about 1 in practice)
        limit = {"stochastic": 1.0, "rtn": 0.5, "error_feedback": 2.0}[mode]
        assert 0.0 <= metrics["max_abs_err_ulps"] <= limit


def test_rtn_lags_and_sr_does_not_under_small_persistent_updates():
    """The spec's toy: master on the bf16 grid, lr-sized drift far below half an ulp per step."""
    results = {}
    for mode in ("rtn", "stochastic", "error_feedback"):
        torch.manual_seed(0)
        w = torch.nn.Parameter((torch.rand(4096) * 0.02 + 0.02).to(torch.bfloat16).float())
        copy = ServedCopy.from_named_params([("w", w)], mode, torch.bfloat16, seed=1)
        copy.begin()
        lags, visible = [], []
        for step in range(1, 61):
            copy.before_step()
            with torch.no_grad():
                w.add_(1e-6 * (1 + 0.3 * torch.randn(4096)))
            m = copy.after_step(step)
            visible.append(m["visible_update_frac"])
            if "lag_steps" in m:
                lags.append(m["lag_steps"])
        results[mode] = (sum(lags[-20:]) / 20, sum(visible) / len(visible))
    assert results["rtn"][0] > 20  # tens of steps behind
    assert abs(results["stochastic"][0]) < 5 and abs(results["error_feedback"][0]) < 5
    assert results["rtn"][1] < results["stochastic"][1]


def test_state_round_trip_and_mismatch_errors():
    lin, named = _params()
    copy = ServedCopy.from_named_params(named, "error_feedback", torch.bfloat16, seed=2)
    copy.begin()
    copy.before_step()
    with torch.no_grad():
        for p in lin.parameters():
            p.add_(1e-5)
    copy.after_step(1)
    state = copy.state_dict()
    lin2, named2 = _params(seed=9)
    other = ServedCopy.from_named_params(named2, "error_feedback", torch.bfloat16, seed=0)
    other.load_state_dict(state)
    for n in copy.master:
        assert torch.equal(other.master[n], copy.master[n])
        assert torch.equal(other.served[n].view(torch.int16), copy.served[n].view(torch.int16))
        assert torch.equal(other.residual[n], copy.residual[n])
    assert (other.seed, other.step) == (2, 1)
    with pytest.raises(ValueError, match="mode='error_feedback', but this run uses 'stochastic'"):
        ServedCopy.from_named_params(_params()[1], "stochastic").load_state_dict(state)


def test_rejects_non_fp32_masters_and_bad_modes():
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="parameter 'p' is torch.bfloat16"):
        ServedCopy.from_named_params([("p", p)], "stochastic")
    with pytest.raises(ValueError, match="mode='sr'"):
        ServedCopy.from_named_params(_params()[1], "sr")
    with pytest.raises(ValueError, match="no parameters"):
        ServedCopy.from_named_params([], "rtn")

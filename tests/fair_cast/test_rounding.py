import math

import pytest
import torch

from trl_fp8 import native as _native
from trl_fp8.fair_cast import rounding as R
from trl_fp8.fair_cast.rounding import ErrorFeedback, error_feedback_round, neighbours, stochastic_round, ulp

BF16_MAX = torch.finfo(torch.bfloat16).max
SPECIALS = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 3.4e38, -3.4e38, 1e-40, -1e-40, 1.0, -1.0]


def _bits(t):
    return t.view(torch.int16)


def _sr(x, dtype=torch.bfloat16, step=0, index=0, seed=0):
    return stochastic_round(x, dtype, seed=seed, step=step, index=index)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sr_is_unbiased(dtype):
    # values strictly between two grid points, at several magnitudes and signs
    grid = torch.tensor([1.0, -0.0234, 3.7e-3, -150.0, 0.5]).to(dtype)
    lo = grid.float()
    hi = torch.nextafter(grid, torch.full_like(grid, float("inf"))).float()
    x = lo + 0.3 * (hi - lo)
    n = 40000
    samples = torch.stack([_sr(x, dtype, step=s) for s in range(n)]).float()
    mean = samples.mean(0)
    frac_up = (samples == hi).float().mean(0)
    assert torch.all(samples.eq(lo) | samples.eq(hi))  # only the two neighbours ever appear
    # the up-probability is 0.3 of the gap; 5 standard deviations of a binomial mean
    tol = 5 * math.sqrt(0.3 * 0.7 / n)
    assert torch.all((frac_up - 0.3).abs() < tol), frac_up
    assert torch.all(((mean - x) / (hi - lo)).abs() < tol)


def test_sr_error_below_one_ulp_and_grid_values_exact():
    x = torch.randn(100000) * 0.05
    q = _sr(x).float()
    assert torch.all((q - x).abs() < ulp(x))
    on_grid = x.to(torch.bfloat16).float()
    assert torch.equal(_sr(on_grid).float(), on_grid)


def test_sr_special_values():
    x = torch.tensor(SPECIALS)
    for step in range(50):
        q = _sr(x, step=step)
        assert torch.isnan(q[0])
        assert q[1] == float("inf") and q[2] == float("-inf")
        assert _bits(q[3]) == 0 and _bits(q[4]) == _bits(torch.tensor(-0.0, dtype=torch.bfloat16))
        assert q[5] == BF16_MAX and q[6] == -BF16_MAX  # saturate, never overflow to inf
        assert q[9] == 1.0 and q[10] == -1.0
        sub_lo, sub_hi = neighbours(x[7:9], torch.bfloat16)
        assert all(v in (lo, hi) for v, lo, hi in zip(q[7:9].float(), sub_lo, sub_hi))


def test_sr_fp16_saturates_and_passes_specials():
    x = torch.tensor([1e6, -1e6, float("nan"), float("inf"), 0.0, 1e-6])
    q = _sr(x, torch.float16)
    fmax = torch.finfo(torch.float16).max
    assert q[0] == fmax and q[1] == -fmax and torch.isnan(q[2]) and q[3] == float("inf") and q[4] == 0
    lo, hi = neighbours(x[5:], torch.float16)
    assert q[5].float() in (lo[0], hi[0])  # fp16 subnormal range


def test_sr_determinism_and_fresh_randomness():
    x = torch.randn(4096) * 0.01
    a = _sr(x, step=3, index=7, seed=1)
    assert torch.equal(_bits(a), _bits(_sr(x.clone(), step=3, index=7, seed=1)))  # replicas agree
    for other in (dict(step=4, index=7, seed=1), dict(step=3, index=8, seed=1), dict(step=3, index=7, seed=2)):
        assert not torch.equal(_bits(a), _bits(_sr(x, **other))), other
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    _sr(x)
    assert torch.equal(before, torch.random.get_rng_state())  # the global RNG is not touched


def test_native_and_torch_sr_give_identical_bits():
    x = torch.cat([torch.randn(100003) * 0.1, torch.tensor(SPECIALS)])
    key = R.derive_key(5, 9, 2)
    native = stochastic_round(x, seed=5, step=9, index=2)
    reference = R._sr_bf16_bits_torch(x, key)
    assert torch.equal(_bits(native), _bits(reference))


def test_native_and_torch_ef_give_identical_bits_and_residuals():
    x = torch.cat([torch.randn(100003) * 0.1, torch.tensor(SPECIALS)])
    r1 = torch.randn_like(x) * 1e-4
    r1[-len(SPECIALS):] = 0
    r2 = r1.clone()
    q1 = error_feedback_round(x, r1)
    q2 = R._error_feedback_torch(x, r2, torch.bfloat16)
    assert torch.equal(_bits(q1), _bits(q2))
    assert torch.equal(r1, r2)


def test_fallback_without_native_kernel(monkeypatch):
    x = torch.randn(1000) * 0.1
    expected = _sr(x, step=1)
    monkeypatch.setattr(_native, "load", lambda: None)
    assert torch.equal(_bits(_sr(x, step=1)), _bits(expected))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ef_residual_bounded_and_telescoping(dtype):
    torch.manual_seed(0)
    w = torch.randn(5000) * 0.03
    ef = ErrorFeedback(w, dtype)
    total = torch.zeros(5000, dtype=torch.float64)
    half_ulp_prev = torch.zeros(5000)
    for t in range(300):
        w = w + 1e-6 * (1 + torch.randn(5000))  # persistent drift + noise, far below one ulp per step
        q = ef(w)
        v = (q.double() + ef.residual.double()).float()
        half_ulp = torch.maximum(ulp(v, dtype), ulp(q.float(), dtype)) / 2
        assert torch.all(ef.residual.abs() <= half_ulp)  # |v - q| <= 1/2 ulp
        # |w - q| = |r_new - r_old| <= 1/2 ulp(v_t) + 1/2 ulp(v_{t-1}): about one ulp, not 1/2 (see README)
        assert torch.all((w - q.float()).abs() <= half_ulp + half_ulp_prev)
        half_ulp_prev = half_ulp
        total += q.double() - w.double()
    # sum_t (q_t - w_t) telescopes to -r_T (up to fp32 rounding of the additions w + r)
    assert torch.allclose(total, -ef.residual.double(), atol=300 * 2e-9)


def test_ef_is_deterministic_and_specials_pass():
    w = torch.tensor(SPECIALS)
    r = torch.zeros_like(w)
    q = error_feedback_round(w, r)
    assert torch.isnan(q[0]) and q[1] == float("inf") and q[2] == float("-inf")
    assert q[5] == BF16_MAX and q[6] == -BF16_MAX
    assert torch.all(r[:3] == 0)
    w2 = torch.randn(100)
    assert torch.equal(error_feedback_round(w2, torch.zeros(100)), error_feedback_round(w2, torch.zeros(100)))


def test_bad_inputs_are_named():
    with pytest.raises(TypeError, match="fp32"):
        stochastic_round(torch.zeros(3, dtype=torch.float64), seed=0, step=0, index=0)
    with pytest.raises(ValueError, match="dtype must be"):
        stochastic_round(torch.zeros(3), torch.int8, seed=0, step=0, index=0)
    with pytest.raises(ValueError, match="out must be"):
        stochastic_round(torch.zeros(3), seed=0, step=0, index=0, out=torch.empty(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="residual shape"):
        error_feedback_round(torch.zeros(3), torch.zeros(4))


def test_ulp_matches_the_spec_formula():
    x = torch.tensor([0.02, 0.04, 1.0, 1.5, -3.0])
    expected = torch.tensor([2.0 ** (math.floor(math.log2(abs(v))) - 7) for v in x.tolist()])
    assert torch.equal(ulp(x), expected)


# -- the equal-noise control: RTN plus SR's average noise, centred on RTN -------------------------------------------

def _noise(x, dtype=torch.bfloat16, step=0, index=0, seed=0, offset=0):
    return R.rtn_plus_noise(x, dtype, seed=seed, step=step, index=index, offset=offset)


# the 16-bit uniform serves a probability p as floor(65536 p + 1/2) / 65536 (5461/65536 for 1/12 a side)
_P12 = 5461 / 65536


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("value", [0.0234 + 1e-5, -1.37, 150.3, 0.99999, 1.0 + 1e-4, 2.0])
def test_rtn_noise_per_element_mean_is_rtn_and_variance_is_srs_average(dtype, value):
    """One element drawn many times (the counter gives each copy its own draw): E[q] = RN(x) and Var[q] =
    ulp(x)²/6, SR's variance averaged over a uniform residue. Tolerances are 5 standard errors of each estimate,
    derived from the three-point law itself (moves of ±one gap, 1/12 a side when the gaps are equal)."""
    n = 200_000
    x = torch.full((n,), value, dtype=torch.float32)
    q = _noise(x, dtype).float()
    rn = x.to(dtype).float()
    u = ulp(x[:1], dtype).item()
    up = torch.nextafter(x[:1].to(dtype), torch.tensor([float("inf")], dtype=dtype)).float().item()
    dn = torch.nextafter(x[:1].to(dtype), torch.tensor([float("-inf")], dtype=dtype)).float().item()
    assert set(q.unique().tolist()) <= {dn, rn[0].item(), up}  # one step to a neighbour, or none
    d = (q - rn) / u
    target_var = 1 / 6
    # the largest move is one gap, at most 2 ulp: E[d^4] <= 4 Var, so SE(var) <= sqrt(4 Var / n) * ...; use the bound
    se_mean = math.sqrt(target_var / n)
    se_var = math.sqrt(4 * target_var / n)
    assert abs(d.mean().item()) < 5 * se_mean
    assert abs(d.pow(2).mean().item() - target_var) < 5 * se_var + target_var * 1e-3


def test_rtn_noise_equal_gaps_move_one_twelfth_each_way():
    x = torch.full((300_000,), 1.37, dtype=torch.float32)
    q = _noise(x).float()
    rn = x.to(torch.bfloat16).float()
    up_frac = (q > rn).float().mean().item()
    dn_frac = (q < rn).float().mean().item()
    tol = 5 * math.sqrt(_P12 * (1 - _P12) / x.numel())
    assert abs(up_frac - _P12) < tol and abs(dn_frac - _P12) < tol


def test_rtn_noise_over_a_tensor_has_rtns_mean_and_srs_variance():
    """Over a tensor of weights of many magnitudes (uniform residues): the control's mean offset from RTN is 0 and
    its mean squared offset equals SR's mean squared error — the same noise, centred where RTN is."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1_000_000, generator=g) * torch.logspace(-3, 1, 1_000_000)
    u = ulp(x)
    rn = x.to(torch.bfloat16).float()
    d_noise = (_noise(x, step=3).float() - rn) / u
    d_sr = (_sr(x, step=3).float() - x) / u
    n = x.numel()
    assert abs(d_noise.mean().item()) < 5 * math.sqrt((1 / 6) / n)
    # both mean squares estimate 1/6 (SR's: E f(1-f) for a uniform residue f); each within 5 standard errors
    for ms in (d_noise.pow(2).mean().item(), d_sr.pow(2).mean().item()):
        assert abs(ms - 1 / 6) < 5 * math.sqrt(4 * (1 / 6) / n) + 1e-3 / 6
    # and unlike SR its mean sits on RTN, not on the master: over elements whose residue is above half an ulp
    # below the midpoint, SR's expected value is the master while the control's is RN
    resid = (x - rn) / u
    assert abs(resid.mean().item()) < 0.01  # residues centred: the check below is not trivial
    assert (d_noise + resid).abs().mean().item() > 0.2  # the control's offset from the master keeps RTN's residue


def test_rtn_noise_is_keyed_shard_invariant_and_passes_specials():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    a = _noise(x, step=5, index=2)
    assert torch.equal(_bits(a), _bits(_noise(x, step=5, index=2)))
    assert not torch.equal(_bits(a), _bits(_noise(x, step=6, index=2)))
    # a shard rounds as the whole tensor would
    assert torch.equal(_bits(a[1000:]), _bits(_noise(x[1000:], step=5, index=2, offset=1000)))
    # not SR's stream: the same key gives other draws
    moved = a.float() != x.to(torch.bfloat16).float()
    assert 0.1 < moved.float().mean().item() < 0.25  # 1/6 of the elements move
    s = torch.tensor([float("nan"), float("inf"), float("-inf"), 3.4e38, -3.4e38] * 1000)
    out = _noise(s).float()
    assert torch.isnan(out[0::5]).all()
    assert (out[1::5] == float("inf")).all() and (out[2::5] == float("-inf")).all()
    assert torch.isfinite(out[3::5]).all() and (out[3::5] <= BF16_MAX).all() and (out[4::5] >= -BF16_MAX).all()


def test_rtn_noise_bad_inputs_are_named():
    with pytest.raises(TypeError, match="fp32"):
        _noise(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="dtype must be"):
        R.rtn_plus_noise(torch.zeros(3), torch.int8, seed=0, step=0, index=0)
    with pytest.raises(ValueError, match="out must be"):
        R.rtn_plus_noise(torch.zeros(3), seed=0, step=0, index=0, out=torch.empty(4, dtype=torch.bfloat16))

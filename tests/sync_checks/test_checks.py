"""The seven checks as pure functions: each passes on agreeing inputs and fails, naming the tensor and the
numbers, on the fault it targets."""

import math

import pytest
import torch

from trl_fp8.sync_checks import checks as C
from trl_fp8.sync_checks import compare
from trl_fp8.numerics import dense


def test_resolve_checks_presets_lists_and_unknown_names():
    assert C.resolve_checks("all") == C.CHECKS and len(C.CHECKS) == 7
    assert C.resolve_checks("off") == ()
    assert "differential_oracle" not in C.resolve_checks("default")
    assert C.resolve_checks(["freshness", "coverage"]) == ("coverage", "freshness")  # canonical order
    assert C.resolve_checks("coverage, cache_hygiene") == ("coverage", "cache_hygiene")
    with pytest.raises(ValueError, match=r"unknown check\(s\) 'freshnes'.*known checks: recipe_parity"):
        C.resolve_checks(["freshnes"])


def test_bitwise_equal_sees_one_flipped_bit_and_signed_zero():
    a = torch.randn(64, dtype=torch.bfloat16)
    b = a.clone()
    assert C.bitwise_equal(a, b)
    b.view(torch.int16)[5] ^= 1
    assert not C.bitwise_equal(a, b)
    assert not C.bitwise_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not C.bitwise_equal(a, a.float())


def test_recipe_parity_names_the_layer_and_the_field():
    learner = {"a.weight": dense(torch.bfloat16), "b.weight": dense(torch.bfloat16)}
    sampler = {"a.weight": dense(torch.bfloat16), "b.weight": dense(torch.float32)}
    assert C.recipe_parity(learner, learner).passed
    result = C.recipe_parity(learner, sampler)
    assert not result.passed
    assert "'b.weight': dtype learner='bfloat16' sampler='float32'" in result.message
    excluded = {**sampler, "b.weight": learner["b.weight"].with_(excluded=True)}
    assert "'b.weight': excluded learner=False sampler=True" in C.recipe_parity(learner, excluded).message


def test_coverage_missing_duplicate_unknown_unwritten_and_shape():
    expected = {"a": (2, 2), "b": (3,)}
    targets = {"a": ["a"], "b": ["b"]}
    shapes = {"a": (2, 2), "b": (3,)}
    assert C.coverage({"a": 1, "b": 1}, expected, targets, shapes, shapes).passed
    r = C.coverage({"a": 1}, expected, targets, {"a": (2, 2)}, shapes)
    assert not r.passed and "not sent: b" in r.message and "served but never written: b" in r.message
    assert "sent more than once: a" in C.coverage({"a": 2, "b": 1}, expected, targets, shapes, shapes).message
    r = C.coverage({"a": 1, "b": 1, "c": 1}, expected, targets, {**shapes, "c": (1,)}, shapes)
    assert "sent but not served: c" in r.message
    r = C.coverage({"a": 1, "b": 1}, expected, {**targets, "fused[2]": []}, shapes, shapes)
    assert "served but never written: fused[2]" in r.message
    r = C.coverage({"a": 1, "b": 1}, expected, targets, {"a": (4,), "b": (3,)}, shapes)
    assert "shape mismatch: 'a' sent (4,) served (2, 2)" in r.message


def test_freshness_version_stale_tensor_and_stale_alias():
    sent = {"w": torch.randn(4, 4), "v": torch.randn(3)}
    served = {n: t.to(torch.bfloat16) for n, t in sent.items()}
    assert C.freshness(5, "5", sent, served.__getitem__, {}).passed
    r = C.freshness(5, "4", sent, served.__getitem__, {})
    assert not r.passed and "weight version '4', the learner is at step 5" in r.message
    stale = dict(served, v=served["v"].clone())
    stale["v"][1] += 1
    r = C.freshness(5, 5, sent, stale.__getitem__, {})
    assert not r.passed and "'v' is not what the sync sent at step 5: 1 of 3 elements differ" in r.message
    target = torch.randn(8, 2, dtype=torch.bfloat16)
    r = C.freshness(5, 5, sent, served.__getitem__, {"lm_head.weight": (target + 1, target)})
    assert not r.passed and "'lm_head.weight' (tied) computes with a stale copy" in r.message


def test_quant_parity_compares_with_the_learner_quantizer_not_the_sent_bytes():
    master = torch.randn(256) * 1e-3
    reference = {"w": (master + 1e-6 * torch.rand(256)).to(torch.bfloat16)}  # e.g. a stochastic-rounding export
    assert C.quant_parity(["w"], reference.__getitem__, reference.__getitem__).passed
    rtn = {"w": master.to(torch.bfloat16)}
    r = C.quant_parity(["w"], {"w": master.to(torch.bfloat16)}.__getitem__, {"w": rtn["w"].float()}.__getitem__)
    assert not r.passed and "learner reference torch.bfloat16 (256,), sampler torch.float32" in r.message
    flipped = reference["w"].clone()
    flipped.view(torch.int16)[3] ^= 1
    r = C.quant_parity(["w"], reference.__getitem__, {"w": flipped}.__getitem__)
    assert not r.passed and "'w' differs from the learner's quantizer output: 1 of 256 elements" in r.message


def test_quant_parity_widens_the_served_tensor_to_a_wider_reference_exactly():
    served = {"w": torch.randn(64).to(torch.bfloat16)}
    exact = {"w": served["w"].float()}  # the fp32 value the learner computes with, which bf16 holds exactly
    r = C.quant_parity(["w"], exact.__getitem__, served.__getitem__)
    assert r.passed and r.applicable and r.metrics == {"compared": 1}
    inexact = {"w": exact["w"].clone()}
    inexact["w"][5] = torch.nextafter(inexact["w"][5], torch.tensor(float("inf")))  # rounds to the same bf16
    assert inexact["w"].to(torch.bfloat16).view(torch.int16).equal(served["w"].view(torch.int16))
    r = C.quant_parity(["w"], inexact.__getitem__, served.__getitem__)
    assert not r.passed and "'w' differs from the learner's quantizer output: 1 of 64 elements" in r.message


def test_quant_parity_skips_only_references_that_are_the_verified_sent_tensors():
    ref = {"w": torch.randn(8).to(torch.bfloat16)}
    wrong = {"w": ref["w"] + 1}
    skipped = C.quant_parity(["w"], ref.__getitem__, wrong.__getitem__, sent={"w": ref["w"]})  # same object
    assert skipped.passed and not skipped.applicable  # nothing compared: not applicable, not a pass to count
    assert not C.quant_parity(["w"], ref.__getitem__, wrong.__getitem__, sent={"w": ref["w"].clone()}).passed


def _logps(gap, explained=None, shape=(2, 5)):
    """(learner, sampler, numerics): every token's |learner − sampler| is gap, |learner − numerics| explained."""
    learner = torch.zeros(shape)  # at 0 the float32 gaps are the decimal ones to ~1e-7 relative
    numerics = None if explained is None else learner - explained
    return learner, learner - gap, numerics


def _band(**kw):
    return C.LogprobBand(**{"factor": 2.0, "floor": 0.01, "persistence": 3, "gross_factor": 5.0, "max_ratio": 1.05,
                            "calibration": 3, "fallback_factor": 3.0, **kw})


def _eval(band, gap, explained=None, step=0, mask=None):
    learner, sampler, numerics = _logps(gap, explained)
    return band.check(learner, sampler, torch.ones(2, 5) if mask is None else mask, step, numerics_logps=numerics)


def _calibrate(band, gap=0.012, explained=0.01, n=3):
    for step in range(n):
        r = _eval(band, gap, explained, step)
        assert r.passed, r.message  # the bound holds from the first evaluation: nothing is learned first
        assert r.metrics["logp_gap_limit"] == pytest.approx(max(0.01, 2.0 * explained), rel=1e-5)
    return band


def test_logprob_band_healthy_gap_passes_forever_as_numerics_grow_tenfold():
    band = _band()
    for step in range(200):  # the policy sharpens: explained gap 0.004 -> 0.04, sampler gap 1.6x of it throughout
        explained = 0.004 * 10 ** (step / 199)
        r = _eval(band, 1.6 * explained, explained, step)
        assert r.passed, (step, r.message)
        assert r.metrics["logp_gap_numerics"] == pytest.approx(explained, rel=1e-5)
        assert r.metrics["logp_gap_path"] == pytest.approx(0.6 * explained, rel=1e-5)
        assert r.metrics["logp_gap_limit"] == pytest.approx(max(2.0 * explained, 0.01), rel=1e-5)  # the bound
    assert r.metrics["logp_gap_mean"] == pytest.approx(0.064, rel=1e-5)  # far above log(1.05) and a 0.01 band
    assert band.over == 0


def test_logprob_band_a_gap_present_from_the_first_evaluation_is_never_learned():
    # another base on the server (or no adapter, or another dtype) from step 0: the gap is 9x what precision explains,
    # under the gross ceiling max(log 1.05, 5 x 0.02) = 0.1 — a band calibrated on these evaluations would admit it
    band = _band()
    for step in (0, 1):
        r = _eval(band, 0.09, 0.01, step)
        assert r.passed and r.metrics["logp_gap_limit"] == pytest.approx(0.02, rel=1e-5)
    r = _eval(band, 0.09, 0.01, 2)
    assert not r.passed and r.message.endswith(
        "exceeds the band 0.02 (numerics explain 0.01 × 2 (path calibrating 0/3)) for 3 consecutive evaluations "
        "(fails after 3)"), r.message
    assert band.path_reference is None and band.path_evaluations == 0 and band.reference is None  # learned nothing


def test_logprob_band_never_admits_more_than_the_bound_after_calibration():
    band = _calibrate(_band(), 0.019, 0.01)  # a wide healthy path 0.009 calibrates the path ceiling only
    assert band.path_reference == pytest.approx(0.009, rel=1e-5) and band.path_evaluations == 3
    r = _eval(band, 0.025, 0.01, 3)  # 3 x the path term would admit 0.027: the bound 2 x 0.01 does not
    assert r.passed and r.metrics["logp_gap_limit"] == pytest.approx(0.02, rel=1e-5) and band.over == 1
    r = _eval(_band(), 0.11, 0.01, 0)
    assert not r.passed and "gross ceiling 0.1" in r.message and "path calibrating 0/3" in r.message


def test_logprob_band_persistent_fault_fires_on_the_third_evaluation_not_before():
    band = _calibrate(_band())
    for step in (3, 4):
        r = _eval(band, 0.04, 0.01, step)  # band 2 x 0.01 = 0.02; path 0.03 < its ceiling max(0.0488, 5 x 0.002)
        assert r.passed and r.metrics["logp_gap_limit"] == pytest.approx(0.02, rel=1e-5)
    r = _eval(band, 0.04, 0.01, 5)
    assert not r.passed
    assert r.message.startswith(
        "mean |logπ_learner − logμ_sampler| 0.04 at step 5 (max gap 0.04 at masked token 0); numerics explain "
        "0.01, the sampler's path adds 0.03: exceeds the band 0.02 (numerics explain 0.01 × 2) "
        "for 3 consecutive evaluations (fails after 3)"), r.message
    assert not _eval(band, 0.04, 0.01, 6).passed  # and keeps failing while the fault lasts (sync_check_action="warn")
    assert band.path_reference == pytest.approx(0.002, rel=1e-5)  # failing evaluations calibrate nothing


def test_logprob_band_spikes_that_do_not_persist_never_fire():
    band = _calibrate(_band())
    for step in range(3, 30):  # two over-band evaluations, then a healthy one, over and over
        r = _eval(band, 0.045 if step % 3 != 2 else 0.012, 0.01, step)
        assert r.passed, (step, r.message)
    assert _eval(band, 0.045, 0.01, 30).passed and _eval(band, 0.045, 0.01, 31).passed
    assert not _eval(band, 0.045, 0.01, 32).passed  # the third in a row


def test_logprob_band_floor_applies_when_numerics_explain_almost_nothing():
    band = _calibrate(_band(), 0.0001, 0.0001)  # the sampler computes exactly the reference: path 0
    r = _eval(band, 0.011, 0.0001, 3)
    assert r.passed and r.metrics["logp_gap_limit"] == pytest.approx(0.01)  # over (1 of 3): calibrates nothing
    assert _eval(band, 0.011, 0.0001, 4).passed
    r = _eval(band, 0.011, 0.0001, 5)
    assert not r.passed and "exceeds the band 0.01 (floor 0.01 (numerics explain 0.0001 × 2 = 0.0002))" in \
        r.message, r.message


def test_logprob_band_gross_excess_fires_at_once():
    band = _calibrate(_band(), 0.01, 0.01)  # path 0: band max(0.01, 2 x 0.01) = 0.02, ceiling 0.1
    r = _eval(band, 0.11, 0.06, 3)  # path 0.05: over its own ceiling 0.0488 too, but the gap's ceiling is checked first
    assert not r.passed
    assert ("0.11 at step 3" in r.message and "exceeds the gross ceiling 0.6 = max(log 1.05, 5 × band 0.12)"
            not in r.message)
    band = _calibrate(_band(), 0.01, 0.01)
    r = _eval(band, 0.11, 0.01, 3)
    assert not r.passed and "exceeds the gross ceiling 0.1 = max(log 1.05, 5 × band 0.02); band from numerics " \
        "explain 0.01 × 2: fails at once" in r.message, r.message
    assert _eval(_calibrate(_band(), 0.01, 0.01), 0.04, 0.01, 3).passed  # over the band only (1 of 3)


def test_logprob_band_a_sudden_path_jump_fails_at_once_under_a_wide_precision_band():
    band = _calibrate(_band(), 0.102, 0.1)  # precision explains a lot (band 0.2), the path 0.002
    r = _eval(band, 0.16, 0.1, 3)  # |ρ − μ| 0.06: under the wide band, over the path's ceiling max(0.0488, 0.01)
    assert not r.passed
    assert ("the sampler's path term 0.06 exceeds its gross ceiling 0.04879 = max(log 1.05, 5 × calibrated path "
            "0.002): fails at once") in r.message, r.message


def test_logprob_band_unverified_syncs_calibrate_nothing():
    band = _band()
    learner, sampler, numerics = _logps(0.015, 0.01)
    for step in range(3):
        assert band.check(learner, sampler, torch.ones(2, 5), step, numerics_logps=numerics, verified=False).passed
    assert band.path_reference is None and band.path_evaluations == 0
    r = band.check(learner, sampler, torch.ones(2, 5), 3, numerics_logps=numerics, verified=True)
    assert r.passed and band.path_evaluations == 1 and "path calibrating" not in r.message


def test_logprob_band_with_an_approximate_reference_calibrates_its_path_under_the_absolute_bound():
    band = _band()
    band.exact = False  # ZeRO-3: ρ is the learner under autocast, explaining ~0 of a bf16 sampler's gap
    for step in range(3):  # the absolute bound log 1.05 while the path calibrates
        r = _eval(band, 0.02, 0.0, step)
        assert r.passed and r.metrics["logp_gap_limit"] == pytest.approx(math.log(1.05), rel=1e-6)
    r = _eval(band, 0.05, 0.0, 3)  # calibrated: 3 x path 0.02 = 0.06, capped at the bound 0.0488
    assert r.passed and band.over == 1 and r.metrics["logp_gap_limit"] == pytest.approx(math.log(1.05), rel=1e-6)
    r = _eval(band, 0.03, 0.0, 4)
    assert r.passed and band.over == 0
    bad = _band()  # from step 0, a gap over the bound stops the run on the third evaluation
    bad.exact = False
    results = [_eval(bad, 0.0495, 0.0, s) for s in range(3)]  # under the gross ceiling 0.05
    assert [r.passed for r in results] == [True, True, False] and "the absolute bound log 1.05" in results[-1].message


def test_logprob_band_without_numerics_calibrates_under_the_absolute_bound():
    band = _band()
    for step, gap in enumerate((0.004, 0.006, 0.005)):  # calibrating: the absolute bound log 1.05
        r = _eval(band, gap, None, step)
        assert r.passed and "logp_gap_numerics" not in r.metrics
        assert r.metrics["logp_gap_limit"] == pytest.approx(math.log(1.05), rel=1e-6)
    r = _eval(band, 0.017, None, 3)  # band max(3 x 0.006, 0.01) = 0.018
    assert r.passed and r.metrics["logp_gap_limit"] == pytest.approx(0.018)
    assert _eval(band, 0.04, None, 4).metrics["logp_gap_limit"] == pytest.approx(math.log(1.05))  # 3 x 0.017, capped
    for step in (5, 6):
        assert _eval(band, 0.06, None, step).passed  # over the bound 0.0488: over, learned nothing
    assert band.reference == pytest.approx(0.04)
    r = _eval(band, 0.06, None, 7)
    assert not r.passed and ("exceeds the band 0.04879 (the absolute bound log 1.05 (no numerics logprobs: largest "
                             "passing gap 0.04 × 3 = 0.12, capped)) for 3 consecutive evaluations" in r.message), \
        r.message
    r = _eval(_band(), 0.3, None, 0)  # the gross ceiling holds while calibrating: max(log 1.05, 5 x floor)
    assert not r.passed and "gross ceiling 0.05 = max(log 1.05, 5 × band 0.01); band from the absolute bound " \
        "log 1.05 (no numerics logprobs; fallback calibrating 0/3): fails at once" in r.message, r.message


def test_logprob_band_metrics_keys_and_masked_tokens_only():
    band = _calibrate(_band())
    r = _eval(band, 0.012, 0.01, 3)
    ratio = math.exp(0.012)
    assert r.metrics == pytest.approx({
        "logp_gap_mean": 0.012, "logp_gap_max": 0.012, "logp_gap_numerics": 0.01, "logp_gap_path": 0.002,
        "logp_gap_limit": 0.02, "logp_over_band_frac": 0.0, "is_ratio_token_min": ratio,
        "is_ratio_token_mean": ratio, "is_ratio_token_max": ratio, "is_ratio_seq_min": ratio ** 5,
        "is_ratio_seq_mean": ratio ** 5, "is_ratio_seq_max": ratio ** 5}, rel=1e-5)
    assert "logp_gap_numerics" not in _eval(_band(), 0.012, None, 0).metrics  # the limit is there from the start
    learner, sampler, numerics = _logps(0.0, 0.0)
    sampler[0, 0] -= 0.004
    sampler[1] -= 5.0  # a masked-out row far off
    numerics[1] -= 7.0
    mask = torch.ones(2, 5)
    mask[1] = 0
    r = _band().check(learner, sampler, mask, 0, numerics_logps=numerics)
    assert r.passed and r.metrics["logp_gap_mean"] == pytest.approx(0.0008) and r.metrics["logp_gap_max"] == \
        pytest.approx(0.004) and r.metrics["logp_gap_path"] == pytest.approx(0.0008)
    assert r.metrics["is_ratio_seq_max"] == pytest.approx(math.exp(0.004), rel=1e-5)  # the masked row is left out
    assert _band().check(learner, sampler, torch.zeros(2, 5), 0, numerics_logps=numerics).metrics == {}


def test_over_band_fraction_counts_tokens_above_the_band_to_one_bin():
    deltas = torch.tensor([0.0, 1e-6, 0.001, 0.009, 0.011, 0.02, 0.5, 3.0])
    stats = {"hist": C.delta_histogram(deltas), "count": len(deltas)}
    assert sum(stats["hist"]) == len(deltas)
    assert C.over_fraction(stats, 0.01) == pytest.approx(4 / 8)  # 0.011, 0.02, 0.5, 3.0
    assert C.over_fraction(stats, 0.6) == pytest.approx(1 / 8)
    assert C.over_fraction(stats, 1e-7) == pytest.approx(6 / 8)  # everything at or above 1e-5's bin, not 0 and 1e-6
    assert C.over_fraction({"hist": [], "count": 0}, 0.01) == 0.0


def test_cache_hygiene():
    assert C.cache_hygiene(3, 0).passed
    assert C.cache_hygiene(3, None).passed and C.cache_hygiene(3, None).applicable
    unobservable = C.cache_hygiene(3, None, observable=False)  # a server: nothing can be observed
    assert not unobservable.applicable and "cannot be observed" in unobservable.message
    assert not C.cache_hygiene(3, 2, observable=False).passed  # what can be seen still counts
    r = C.cache_hygiene(3, 2)
    assert not r.passed and "2 prefix-cache block(s)" in r.message and "step 3" in r.message


def test_logprob_band_measures_the_reference_every_nth_evaluation_and_holds_it_between():
    band = _band(reference_every=4)
    assert band.reference_due()
    _calibrate(band)  # evaluations 0..2 measure ρ
    due = []
    for step in range(3, 11):
        due.append(band.reference_due())
        if due[-1]:
            r = _eval(band, 0.012, 0.01, step)
        else:  # no ρ: judged on every token against the held precision term and the calibrated path term
            r = _eval(band, 0.012, None, step)
            assert r.metrics["logp_gap_numerics_held"] == pytest.approx(0.01, rel=1e-5)
            assert r.metrics["logp_gap_limit"] == pytest.approx(max(2 * 0.01, 3 * 0.002), rel=1e-5)
        assert r.passed
    assert due == [False, False, False, True, False, False, False, True]
    r = _eval(band, 0.04, None, 11)  # a fault between two measurements: over the held band ...
    assert r.passed and band.over == 0 and band.reference_due()  # ... fails nothing yet: ρ is measured next
    for step in (12, 13):
        assert _eval(band, 0.04, 0.01, step).passed and band.reference_due()  # measured, over the band: 1, 2 of 3
    r = _eval(band, 0.04, 0.01, 14)
    assert not r.passed and "for 3 consecutive evaluations" in r.message
    healthy = _calibrate(_band(reference_every=4))
    assert _eval(healthy, 0.03, None, 3).passed and healthy.reference_due()  # a held band too tight for this batch
    assert _eval(healthy, 0.03, 0.02, 4).passed and not healthy.reference_due()  # measured: within 2 x 0.02


# -- the gross rule knows how many tokens it averaged ------------------------------------------------------------
def _one_token_spike(n=16, spike=1.57, mean=0.1005, explained=0.001):
    """The false alarm seen in TRL's ``test_train_multiple_reward_funcs_with_weights`` (lr 0.1, bf16 autocast): a
    mean gap of 0.1005 over a handful of tokens, driven by one token's gap of 1.57 (the others 0.0025)."""
    rest = (mean * n - spike) / (n - 1)
    learner = torch.zeros(1, n)
    sampler = learner - rest
    sampler[0, 5] = -spike
    return learner, sampler, learner - explained


def test_standard_error_is_the_sample_std_over_root_n_and_infinite_for_one_token():
    x = torch.tensor([0.3, 0.1, 2.0, 0.0, 0.7], dtype=torch.float64)
    se = C.standard_error(x.mean().item(), (x * x).sum().item(), 5)
    assert se == pytest.approx(x.std().item() / math.sqrt(5))
    assert C.standard_error(0.5, 0.25 * 4, 4) == 0.0  # no spread
    assert C.standard_error(1.57, 1.57 ** 2, 1) == math.inf


def test_a_mean_over_few_tokens_driven_by_one_token_is_not_a_gross_failure():
    learner, sampler, numerics = _one_token_spike()
    band = C.LogprobBand()  # the defaults: while calibrating, ceiling max(log 1.05, 10 × floor 0.01) = 0.1
    r = band.check(learner, sampler, torch.ones(1, 16), 3, numerics_logps=numerics)
    assert r.metrics["logp_gap_mean"] == pytest.approx(0.1005, rel=1e-4) and r.metrics["logp_gap_max"] == \
        pytest.approx(1.57, rel=1e-5)
    # the old rule (mean > 0.1) failed here at once; its standard error is ~ the mean (one token carries it)
    assert r.passed, r.message
    assert band.over == 1 and band.path_evaluations == 0 and band.path_reference is None  # over: calibrates nothing
    r = _eval(band, 0.004, 0.001, 4)
    assert r.passed and band.over == 0 and band.path_evaluations == 1  # a healthy batch after it: back to normal


def test_a_one_token_driven_gross_mean_that_persists_fails_after_three_evaluations():
    band = C.LogprobBand()
    learner, sampler, numerics = _one_token_spike()
    for step in (0, 1):
        assert band.check(learner, sampler, torch.ones(1, 16), step, numerics_logps=numerics).passed
    r = band.check(learner, sampler, torch.ones(1, 16), 2, numerics_logps=numerics)
    assert not r.passed
    assert ("over the gross ceiling 0.1 = max(log 1.05, 10 × band 0.01) by less than 3 standard errors over 16 "
            "tokens (standard error 0.09") in r.message, r.message
    assert "over for 3 consecutive evaluations (fails after 3)" in r.message
    # one token alone: no spread to judge; persistence decides
    one = C.LogprobBand()
    for step in (0, 1):
        assert one.check(torch.zeros(1, 1), torch.full((1, 1), -5.0), torch.ones(1, 1), step).passed
    r = one.check(torch.zeros(1, 1), torch.full((1, 1), -5.0), torch.ones(1, 1), 2)
    assert not r.passed and "over 1 tokens (one token: no spread to judge)" in r.message


@pytest.mark.parametrize("n", [4, 16, 200])
def test_a_desync_that_moves_most_tokens_still_fails_at_once_over_few_tokens(n):
    g = torch.Generator().manual_seed(n)
    learner = torch.zeros(1, n)
    gaps = 0.3 + 0.1 * torch.rand(1, n, generator=g)  # every token off by 0.3..0.4: a stale or corrupted sampler
    r = C.LogprobBand().check(learner, learner - gaps, torch.ones(1, n), 7, numerics_logps=learner - 0.001)
    assert not r.passed and "fails at once (by more than 3 standard errors over" in r.message, r.message
    # heavy-tailed but broad: most tokens off, exponentially spread (mean 0.5), over 32 tokens
    spread = -0.5 * torch.log(torch.rand(1, 32, generator=g))
    r = C.LogprobBand().check(torch.zeros(1, 32), -spread, torch.ones(1, 32), 7)
    assert not r.passed and "fails at once" in r.message, r.message


def test_the_sums_of_squares_add_over_ranks(stats_path):
    g = torch.Generator().manual_seed(0)
    learner, sampler = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    numerics, mask = torch.randn(4, 6, generator=g), torch.rand(4, 6, generator=g) > 0.3
    whole = C.logprob_stats(learner, sampler, mask, numerics)
    halves = [C.logprob_stats(learner[i:i + 2], sampler[i:i + 2], mask[i:i + 2], numerics[i:i + 2]) for i in (0, 2)]
    for key in ("sq_sum", "judged_sq_sum"):
        assert C.LOGPROB_STAT_OPS[key] == "sum"
        assert halves[0][key] + halves[1][key] == pytest.approx(whole[key])
    d = (learner - sampler).abs()[mask].double()
    assert whole["sq_sum"] == pytest.approx((d * d).sum().item())


def _stats_by_hand(learner, sampler, mask, numerics=None, numerics_mask=None):
    """logprob_stats computed token by token in Python floats: the definition the tensor code must match."""
    rows = []
    for i in range(learner.size(0)):
        row = [(float(learner[i, t]) - float(sampler[i, t]), t) for t in range(learner.size(1)) if mask[i, t]]
        rows.append(row)
    flat = [(abs(s), s, i, t) for i, row in enumerate(rows) for s, t in row]
    gaps = [g for g, _, _, _ in flat]
    ratios = [math.exp(s) for _, s, _, _ in flat]
    seqs = [math.exp(sum(s for s, _ in row)) for row in rows if row]
    out = {"sum": sum(gaps), "sq_sum": sum(g * g for g in gaps), "count": len(gaps), "max": max(gaps),
           "ratio_sum": sum(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios), "seqs": len(seqs),
           "seq_ratio_sum": sum(seqs), "seq_ratio_min": min(seqs), "seq_ratio_max": max(seqs)}
    masked_positions = [(i, t) for i in range(mask.size(0)) for t in range(mask.size(1)) if mask[i, t]]
    first_max = gaps.index(max(gaps))  # the flat (row-major, masked) index of the first largest gap
    out["where"] = first_max
    assert masked_positions[first_max] == (flat[first_max][2], flat[first_max][3])
    if numerics is not None:
        covered = [(i, t) for i, t in masked_positions if numerics_mask is None or numerics_mask[i, t]]
        out["explained_sum"] = sum(abs(float(learner[i, t]) - float(numerics[i, t])) for i, t in covered)
        out["path_sum"] = sum(abs(float(numerics[i, t]) - float(sampler[i, t])) for i, t in covered)
        judged = [abs(float(learner[i, t]) - float(sampler[i, t])) for i, t in covered]
        out.update(judged_sum=sum(judged), judged_sq_sum=sum(j * j for j in judged), covered=len(covered),
                   numerics=1, partial=int(numerics_mask is not None))
    return out, gaps


@pytest.mark.parametrize("with_numerics", ["none", "whole", "rows"])
def test_logprob_stats_match_a_token_by_token_count(with_numerics, stats_path):
    g = torch.Generator().manual_seed(3)
    learner = -3 * torch.rand(6, 9, generator=g)
    sampler = learner + 0.05 * torch.randn(6, 9, generator=g)
    sampler[2, 4] = learner[2, 4] - 0.9  # one large gap
    mask = torch.rand(6, 9, generator=g) > 0.25
    mask[4] = False  # a row with no token
    numerics = learner + 0.01 * torch.randn(6, 9, generator=g) if with_numerics != "none" else None
    numerics_mask = None
    if with_numerics == "rows":
        numerics_mask = torch.zeros_like(mask)
        numerics_mask[::3] = mask[::3]
    stats = C.logprob_stats(learner, sampler, mask, numerics, numerics_mask)
    expected, gaps = _stats_by_hand(learner, sampler, mask, numerics, numerics_mask)
    for key, value in expected.items():
        assert stats[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert stats["hist"] == C.delta_histogram(torch.tensor(gaps))
    assert sum(stats["hist"]) == stats["count"] == int(mask.sum())
    empty = C.logprob_stats(learner, sampler, torch.zeros_like(mask))
    assert empty["count"] == 0 and empty["hist"] == [0.0] * C.HIST_BINS and empty["where"] is None


def _both_paths(monkeypatch, *args):
    """logprob_stats through the compiled kernels and through the tensor operations."""
    native = C.logprob_stats(*args)
    with monkeypatch.context() as m:
        m.setattr(compare, "_native_lib", lambda: None)
        return native, C.logprob_stats(*args)


EXACT_STATS = ("count", "max", "where", "seqs", "covered", "numerics", "partial", "hist")  # the rest: sums and exp()


@pytest.mark.parametrize("case", ["plain", "numerics", "rows", "bool_mask", "float_mask", "strided", "one_token",
                                  "bf16", "edges"])
def test_the_compiled_statistics_equal_the_tensor_ones(monkeypatch, case):
    if compare._native_lib() is None:
        pytest.skip("no C compiler here: the compiled statistics are not built")
    from trl_fp8.sync_checks import tokenstats

    g = torch.Generator().manual_seed(len(case))
    learner = -4 * torch.rand(7, 11, generator=g)
    sampler = learner + 0.03 * torch.randn(7, 11, generator=g)
    mask = (torch.rand(7, 11, generator=g) > 0.3).long()  # TRL's completion_mask is int64
    mask[5] = 0  # a row without a token
    numerics = numerics_mask = None
    if case in ("numerics", "rows"):
        numerics = learner + 0.01 * torch.randn(7, 11, generator=g)
    if case == "rows":
        numerics_mask = torch.zeros_like(mask)
        numerics_mask[::3] = mask[::3]
    if case == "bool_mask":
        mask = mask.bool()
    if case == "float_mask":
        mask = mask.float()
    if case == "strided":
        learner, sampler = learner.t().contiguous().t(), sampler[:, :]  # a transposed layout: copied first
    if case == "one_token":
        mask = torch.zeros_like(mask)
        mask[3, 4] = 1
    if case == "bf16":
        learner, sampler = learner.bfloat16(), sampler.bfloat16()
    if case == "edges":  # gaps exactly on bin edges and past the last one: the same bin both ways
        edges = tokenstats._edges(torch.device("cpu"), torch.float64)
        picks = torch.tensor([0.0, 5e-6, 1.0, 1e3])
        on_edges = torch.cat([edges[::40].float(), picks]).reshape(1, -1)
        learner, sampler = on_edges, torch.zeros_like(on_edges)
        mask = torch.ones_like(on_edges, dtype=torch.long)
    assert tokenstats._native_stats(learner, sampler, mask, numerics, numerics_mask) is not None  # the compiled path ran
    native, tensor = _both_paths(monkeypatch, learner, sampler, mask, numerics, numerics_mask)
    assert native["count"] == int((mask != 0).sum()) > 0
    for key, value in tensor.items():
        if key in EXACT_STATS:
            assert native[key] == value, key
        else:
            assert native[key] == pytest.approx(value, rel=1e-12, abs=1e-300), key


def test_the_compiled_statistics_leave_a_gap_that_is_not_finite_to_the_tensor_path(monkeypatch):
    learner, sampler = torch.zeros(2, 3), torch.zeros(2, 3)
    sampler[1, 2] = float("-inf")
    mask = torch.ones(2, 3, dtype=torch.long)
    from trl_fp8.sync_checks import tokenstats

    assert tokenstats._native_stats(learner, sampler, mask, None, None) is None
    native, tensor = _both_paths(monkeypatch, learner, sampler, mask)
    assert native["max"] == tensor["max"] == math.inf and native["where"] == tensor["where"] == 5
    assert native["hist"] == tensor["hist"]


def test_freshness_and_quant_parity_name_the_first_differing_tensor(monkeypatch, compare_path):
    monkeypatch.setattr(compare, "COMPARE_GROUP_ELEMENTS", 64)
    g = torch.Generator().manual_seed(0)
    learner = {f"w{i}": torch.randn(n, generator=g).bfloat16().float() for i, n in enumerate((8, 30, 100, 12))}
    served = {n: t.bfloat16() for n, t in learner.items()}
    sent = {n: t.clone() for n, t in served.items()}
    assert C.freshness(3, 3, sent, served.__getitem__, {}).passed
    r = C.quant_parity(list(learner), learner.__getitem__, served.__getitem__)
    assert r.passed and r.metrics["compared"] == 4
    stale = dict(served, w2=served["w2"].clone())
    stale["w2"][50] += 1
    r = C.freshness(3, 3, sent, stale.__getitem__, {})
    assert not r.passed and "'w2' is not what the sync sent" in r.message and "1 of 100 elements" in r.message
    r = C.quant_parity(list(learner), learner.__getitem__, stale.__getitem__)
    assert not r.passed and "'w2' differs" in r.message and "1 of 100 elements" in r.message
    wrong_dtype = dict(served, w3=served["w3"].double())  # wider than the reference: no exact widening
    r = C.quant_parity(list(learner), learner.__getitem__, wrong_dtype.__getitem__)
    assert not r.passed and "'w3': learner reference torch.float32" in r.message
    both = dict(stale, w3=served["w3"].double())  # an earlier tensor differs: it is named, not the later dtype
    r = C.quant_parity(list(learner), learner.__getitem__, both.__getitem__)
    assert not r.passed and "'w2' differs" in r.message
    r = C.freshness(3, 3, dict(sent, w1=sent["w1"].view(5, 6)), served.__getitem__, {})
    assert not r.passed and "'w1'" in r.message and "shape (5, 6) expected, (30,) found" in r.message

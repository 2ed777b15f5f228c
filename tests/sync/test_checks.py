"""The seven checks as pure functions: each passes on agreeing inputs and fails, naming the tensor and the
numbers, on the fault it targets."""

import math

import pytest
import torch

from trl_fp8.sync import checks as C
from trl_fp8.sync.samplers import dense_recipe


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
    learner = {"a.weight": {**dense_recipe(torch.bfloat16), "cast": "none"},
               "b.weight": {**dense_recipe(torch.bfloat16), "cast": "none"}}
    sampler = {"a.weight": {**dense_recipe(torch.bfloat16), "cast": "none"},
               "b.weight": {**dense_recipe(torch.float32), "cast": "none"}}
    assert C.recipe_parity(learner, learner).passed
    result = C.recipe_parity(learner, sampler)
    assert not result.passed
    assert "'b.weight': dtype learner='bfloat16' sampler='float32'" in result.message
    excluded = {**sampler, "b.weight": {**learner["b.weight"], "excluded": True}}
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


def test_quant_parity_skips_only_references_that_are_the_verified_sent_tensors():
    ref = {"w": torch.randn(8).to(torch.bfloat16)}
    wrong = {"w": ref["w"] + 1}
    assert C.quant_parity(["w"], ref.__getitem__, wrong.__getitem__, sent={"w": ref["w"]}).passed  # same object
    assert not C.quant_parity(["w"], ref.__getitem__, wrong.__getitem__, sent={"w": ref["w"].clone()}).passed


def test_logprob_band_calibrates_then_enforces():
    band = C.LogprobBand(factor=3.0, floor=0.01, calibration=2)
    mask = torch.ones(2, 5)
    base = torch.full((2, 5), -1.0)
    for gap in (0.004, 0.006):  # calibration: the larger mean gap
        assert band.check(base, base + gap, mask, 0).passed
    assert band.calibrated == pytest.approx(0.006, abs=1e-6)
    assert band.limit == pytest.approx(0.018, abs=1e-5)
    ok = band.check(base, base + 0.017, mask, 3)
    assert ok.passed and ok.metrics["logp_gap_mean"] == pytest.approx(0.017, abs=1e-6)
    r = band.check(base, base + 0.03, mask, 4)
    assert not r.passed and "exceeds the band 0.018" in r.message and "step 4" in r.message
    masked = torch.zeros(2, 5)
    masked[0, 0] = 1
    assert band.check(base, base + 5.0 * (1 - masked), masked, 5).passed  # only unmasked tokens count


def test_logprob_ceiling_applies_even_during_calibration():
    band = C.LogprobBand()
    r = band.check(torch.zeros(1, 4), torch.full((1, 4), -0.1), torch.ones(1, 4), 0)
    assert not r.passed and f"exp(mean gap) = {math.exp(0.1):.4f} > 1.05" in r.message


def test_cache_hygiene():
    assert C.cache_hygiene(3, True, 0).passed
    assert C.cache_hygiene(3, None, None).passed
    r = C.cache_hygiene(3, True, 2)
    assert not r.passed and "2 prefix-cache block(s)" in r.message and "step 3" in r.message
    assert "refused to reset" in C.cache_hygiene(3, False, 0).message

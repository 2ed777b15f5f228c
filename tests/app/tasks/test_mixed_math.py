"""The mixed-difficulty task: problems, bands, the zero-variance fraction, the stored calibration, and the pruned
sampler (the same completions as ``generate``)."""

import random

import pytest
import torch

from trl_fp8.app.tasks import mixed_math as mm


def test_problems_of_every_kind_are_right_and_candidates_distinct():
    rng = random.Random(0)
    for kind, (_, _, op) in mm.KINDS.items():
        question, answer = mm.make_problem(rng, kind)
        a, shown, b = question[len("What is "):-1].split(" ")
        expected = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert answer == str(expected) and shown == ("×" if op == "*" else op)
    pool = mm.candidates(5, seed=1)
    assert len(pool) == 5 * len(mm.KINDS) and len({p["question"] for p in pool}) == len(pool)
    assert pool == mm.candidates(5, seed=1)  # seeded
    with pytest.raises(ValueError, match="kind must be one of"):
        mm.make_problem(rng, "division")
    with pytest.raises(ValueError, match="per_kind must be >= 1"):
        mm.candidates(0)


def test_bands_and_expected_zero_variance_fraction():
    assert [mm.band(p) for p in (1.0, 0.9, 0.85, 0.5, 0.2, 0.1, 0.05, 0.0)] == [
        "easy", "easy", "between", "medium", "medium", "between", "hard", "hard"]
    assert mm.zero_variance_fraction([0.5], 8) == pytest.approx(2 * 0.5 ** 8)
    assert mm.zero_variance_fraction([0.9], 8) == pytest.approx(0.9 ** 8 + 0.1 ** 8)  # 0.43, the figure
    assert mm.zero_variance_fraction([0.0, 1.0, 0.5], 4) == pytest.approx((1 + 1 + 2 / 16) / 3)
    with pytest.raises(ValueError, match="pass_rates must lie in"):
        mm.zero_variance_fraction([1.5])
    with pytest.raises(ValueError, match="must not be empty"):
        mm.zero_variance_fraction([])


def test_dataset_from_a_calibration():
    calibration = {"prompts": [
        {"id": "a", "kind": "add_1d", "question": "What is 2 + 3?", "answer": "5", "passes": 16, "samples": 16},
        {"id": "b", "kind": "mul_2d2d", "question": "What is 12 × 34?", "answer": "408", "passes": 0, "samples": 16},
    ], "train": ["a"], "heldout": ["b"]}
    train = mm.make_mixed_math_dataset("train", calibration)
    assert train["answer"] == ["5"] and train["pass_rate"] == [1.0]
    assert train["prompt"][0][-1] == {"role": "user", "content": "What is 2 + 3? " + mm.INSTRUCTION}
    assert train["prompt"][0][:2] == [dict(m) for m in mm.EXAMPLE]
    assert mm.make_mixed_math_dataset("heldout", calibration)["kind"] == ["mul_2d2d"]
    with pytest.raises(ValueError, match="split must be 'train' or 'heldout'"):
        mm.make_mixed_math_dataset("test", calibration)


def test_the_stored_calibration_meets_the_task_contract():
    """The shipped calibration: >= 16 samples a prompt, a held-out set of >= 100 prompts that are not easy (medium,
    hard, and the scarce-medium gaps 0.05-0.2 / 0.8-0.9) disjoint from the pool, and a pool whose expected
    zero-variance fraction at G = 8 is 40-60 %, mixing easy, informative and hard prompts."""
    calibration = mm.load_calibration()
    by_id = {p["id"]: p for p in calibration["prompts"]}
    assert all(p["samples"] >= 16 for p in calibration["prompts"])
    train, heldout = calibration["train"], calibration["heldout"]
    assert not set(train) & set(heldout) and len(heldout) >= 100
    assert "easy" not in {mm.band(by_id[i]["passes"] / by_id[i]["samples"]) for i in heldout}
    assert {mm.band(by_id[i]["passes"] / by_id[i]["samples"]) for i in train} >= {"easy", "medium", "hard"}
    assert 0.4 <= mm.zero_variance_fraction([by_id[i]["passes"] / by_id[i]["samples"] for i in train], 8) <= 0.6


def test_pruned_sampler_gives_generates_greedy_completions(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = ["12+3=", "4+56=", "7+8="]  # unequal lengths: left padding
    eos = tok.eos_token_id
    ours = mm.sample_completions(model, tok, texts, samples=2, max_new_tokens=12, temperature=None,
                                 eos_token_ids=[eos])
    tok.padding_side = "left"
    enc = tok([t for t in texts for _ in range(2)], return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        ref = model.generate(**enc, do_sample=False, max_new_tokens=12, pad_token_id=tok.pad_token_id,
                             eos_token_id=eos)
    for row, ids in zip(ref[:, enc["input_ids"].shape[1]:].tolist(), ours, strict=True):
        expected = row[:row.index(eos) + 1] if eos in row else row
        assert ids == expected
    assert ours[0] == ours[1]  # greedy: the two samples of a prompt agree


def test_pruned_sampler_drops_finished_rows_mid_batch_and_validates(tiny_model_dir):
    """End-of-sequence chosen as a token one row emits early: that row stops there (and is dropped from the cache),
    the others go on exactly as ``generate`` runs them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = ["12+3=", "4+56=", "7+8="]
    free = mm.sample_completions(model, tok, texts, 1, 12, None, eos_token_ids=[-1])
    assert all(len(ids) == 12 for ids in free)
    eos = free[0][2]
    ours = mm.sample_completions(model, tok, texts, 1, 12, None, eos_token_ids=[eos])
    for ids, full in zip(ours, free, strict=True):
        assert ids == (full[:full.index(eos) + 1] if eos in full else full)
    assert len(ours[0]) <= 3
    with pytest.raises(ValueError, match="samples must be >= 1"):
        mm.sample_completions(model, tok, texts, 0)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        mm.sample_completions(model, tok, texts, 1, 0)

"""benchmarks/duet_race.py --report: read from raw records only, on partial records (units marked, the headline
n/a with the reason) and on complete ones (the pre-registered target, tokens to target, the ratios, the last two
lines); the pure pieces (first crossing, area, bootstrap) exactly."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import duet_race  # noqa: E402


def _write(path, arm, seed, accs, tokens_per_step, done=True, upto=None):
    """A run of ``arm``: ``accs`` at step 0 and every EVAL_EVERY steps; each step generates ``tokens_per_step``."""
    key = duet_race._key(arm, seed)
    steps = duet_race.STEPS if upto is None else upto
    rows = duet_race.PROMPTS * duet_race.ARMS[arm]["num_generations"]
    recs = [{**key, "kind": "start", "from_step": 0}, {**key, "kind": "eval", "step": 0, "heldout": accs[0]}]
    for s in range(1, steps + 1):
        rec = {**key, "kind": "step", "step": s, "seconds": 1.0,
               "grad_norm": 0.0 if arm.startswith("duet") and s % 2 else 1.0}  # DUET: every other step no gradient
        if arm.startswith("duet"):
            rec.update({"duet/tokens": tokens_per_step, "duet/abort_frac": 0.0, "n_q": [2, 6, 0, 8],
                        "duet/zero_std_groups_frac": 0.25})
        else:
            rec.update({"completions/mean_length": tokens_per_step / rows, "frac_reward_zero_std": 0.5})
        recs.append(rec)
        if s % duet_race.EVAL_EVERY == 0:
            recs.append({**key, "kind": "eval", "step": s, "heldout": accs[s // duet_race.EVAL_EVERY]})
    if done:
        recs.append({**key, "kind": "done"})
    with open(path, "a") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")


def test_pieces():
    points = [(0, 0.0, 0, 0, 0.1), (6, 100.0, 0, 0, 0.3), (12, 200.0, 0, 0, 0.5)]
    assert duet_race.first_reaching(points, 0.3) == points[1]
    assert duet_race.first_reaching(points, 0.05) == points[1]  # step 0 never counts
    assert duet_race.first_reaching(points, 0.6) is None
    assert duet_race.auc(points, 200.0) == pytest.approx((0.2 * 100 + 0.4 * 100) / 200)
    assert duet_race.auc(points, 150.0) == pytest.approx((0.2 * 100 + 50 * (0.3 + 0.4) / 2) / 150)
    assert duet_race.auc(points, 300.0) is None
    lo, hi = duet_race.bootstrap_mean([1.0, 1.0, 1.0])
    assert lo == hi == 1.0
    lo, hi = duet_race.bootstrap_mean([0.2, 0.4, 0.6])
    assert 0.2 <= lo < 0.4 < hi <= 0.6


def test_partial_records_report_pending_units_and_na(tmp_path):
    path = str(tmp_path / "race.jsonl")
    n_evals = duet_race.STEPS // duet_race.EVAL_EVERY + 1
    _write(path, "grpo8", 0, [0.1 + 0.01 * i for i in range(n_evals)], 640.0)
    _write(path, "duet", 0, [0.1] * n_evals, 320.0, done=False, upto=7)
    lines = duet_race.report(path, plot=None)
    assert "grpo8/0: done" in lines[2] and f"duet/0: partial (7/{duet_race.STEPS} steps)" in lines[2]
    assert "grpo4/1: not run" in lines[2]
    assert lines[3].startswith(f"target: pending (GRPO-8 has reached step {duet_race.STEPS // 2} on 1 of 3 seeds)")
    assert lines[-2].startswith("duet_tokens_to_target_over_grpo4: n/a (seed 0: pending")
    assert lines[-1].startswith("duet_tokens_to_target_over_grpo8: n/a (seed 0: pending")


def test_complete_records_give_the_pre_registered_target_and_the_ratios(tmp_path):
    path = str(tmp_path / "race.jsonl")
    every, half = duet_race.EVAL_EVERY, duet_race.STEPS // 2
    n_evals = duet_race.STEPS // every + 1
    grpo = [0.1 + 0.05 * i for i in range(n_evals)]
    target = grpo[half // every]  # GRPO-8 at half its steps, on every seed
    for seed in duet_race.SEEDS:
        _write(path, "grpo8", seed, grpo, 640.0)
        _write(path, "grpo4", seed, grpo, 320.0)  # same curve per step, half the tokens: the target at `half` too
        _write(path, "duet", seed, [0.1, target + 0.01] + [target + 0.02] * (n_evals - 2), 320.0)  # at step `every`
    _write(path, "duet_refill", 0, [0.1, 0.1, target] + [target] * (n_evals - 3), 320.0)  # at 2 * every, seed 0 only
    _write(path, "duet_passrate", 1, [0.1, 0.1, 0.1, target] + [target] * (n_evals - 4), 320.0)  # at 3 * every
    lines = duet_race.report(path, plot=None)
    assert lines[3].startswith(f"target: {target:.4f} (GRPO-8 at step {half}")
    pr8, pr4 = 3 * every * 320 / (half * 640), 3 * every * 320 / (half * 320)
    rf8, rf4 = 2 * every * 320 / (half * 640), 2 * every * 320 / (half * 320)
    # one seed reached it of three: the mean, then the other seeds' bounds
    assert lines[-5] == f"duet_passrate_tokens_to_target_over_grpo8: {pr8:.3f} (1 of 3 seeds; seed 0: pending; seed 2: pending)"
    assert lines[-6] == f"duet_passrate_tokens_to_target_over_grpo4: {pr4:.3f} (1 of 3 seeds; seed 0: pending; seed 2: pending)"
    assert any(line.startswith("| duet_passrate | 1 |") for line in lines)
    assert lines[-3] == f"duet_refill_tokens_to_target_over_grpo8: {rf8:.3f} (1 of 3 seeds; seed 1: pending; seed 2: pending)"
    assert lines[-4] == f"duet_refill_tokens_to_target_over_grpo4: {rf4:.3f} (1 of 3 seeds; seed 1: pending; seed 2: pending)"
    summary = next(line for line in lines if line.startswith("| duet | 0, 1, 2 |"))  # the per-arm table over seeds
    assert summary.endswith(f"| 0.50 ± 0.00 [0.50, 0.50] | {every * 320:,.0f} ± 0 [{every * 320:,.0f}, "
                            f"{every * 320:,.0f}] (3 of 3) |")  # steps without gradient, then tokens to target
    grpo8 = next(line for line in lines if line.startswith("| grpo8 | 0, 1, 2 |"))
    assert "| 0.00 ± 0.00 [0.00, 0.00] |" in grpo8
    assert any(line.startswith("| duet_refill | 0 |") for line in lines)
    per_seed = f"duet_refill / grpo8 tokens to target, per seed: {2 * every * 320 / (half * 640):.3f}; "
    assert any(line.startswith(per_seed) and "seed 1: pending" in line for line in lines)
    row = next(line for line in lines if line.startswith("| duet | 0 |"))
    assert f"| {every * 320:,} | {every * 16} | {every} |" in row  # tokens, rollouts (16 a step from n_q), seconds
    assert lines[-2] == f"duet_tokens_to_target_over_grpo4: {every * 320 / (half * 320):.3f}"
    assert lines[-1] == f"duet_tokens_to_target_over_grpo8: {every * 320 / (half * 640):.3f}"
    assert any(line.startswith("duet n_q histogram (prompts): 0: 0.250, 2: 0.250, 6: 0.250, 8: 0.250")
               for line in lines)


def test_a_grpo8_that_has_not_learnt_does_not_make_a_target_noise_reaches(tmp_path):
    path = str(tmp_path / "race.jsonl")
    every, half = duet_race.EVAL_EVERY, duet_race.STEPS // 2
    n_evals = duet_race.STEPS // every + 1
    late = n_evals - 1  # GRPO-8 gets above the floor only at its last evaluation
    flat = [0.2] * n_evals
    flat[late] = 0.2 + duet_race.MIN_GAIN + 0.01
    for seed in duet_race.SEEDS:
        _write(path, "grpo8", seed, flat, 640.0)
        _write(path, "duet", seed, [0.2, 0.22] + [0.2] * (n_evals - 2), 320.0)
    lines = duet_race.report(path, plot=None)
    assert lines[3].startswith(f"target: {0.2 + duet_race.MIN_GAIN:.4f} (GRPO-8 at step {half} 0.2000")
    grpo_tokens = late * every * 640
    assert next(line for line in lines if line.startswith("| grpo8 | 0 |")).split(" | ")[3] == f"{grpo_tokens:,}"
    duet_total = duet_race.STEPS * 320
    assert next(line for line in lines if line.startswith("| duet | 0 |")).split(" | ")[3] == f">= {duet_total:,}"
    bound = f">= {duet_total / grpo_tokens:.2f} (duet did not reach it)"
    assert lines[-1] == f"duet_tokens_to_target_over_grpo8: n/a (seed 0: {bound}; seed 1: {bound}; seed 2: {bound})"


def test_the_docs_table_is_replaced_between_its_markers_only(tmp_path):
    doc = tmp_path / "duet.md"
    doc.write_text("# DUET\n\nbefore\n<!-- race-table: a note -->\n| old |\n<!-- /race-table -->\nafter\n")
    lines = ["title", "units (arm, seed): grpo8/0: done", "", "| arm | seeds done | x |", "|---|---|---|",
             "| grpo8 | 0 | 1 |", "", "| arm | seed | other table |"]
    duet_race.write_docs_table(lines, str(doc))
    assert doc.read_text() == ("# DUET\n\nbefore\n<!-- race-table: a note -->\n| arm | seeds done | x |\n|---|---|---|\n"
                               "| grpo8 | 0 | 1 |\n\nunits (arm, seed): grpo8/0: done\n<!-- /race-table -->\nafter\n")
    (tmp_path / "bare.md").write_text("no markers\n")
    with pytest.raises(ValueError, match="race-table markers"):
        duet_race.write_docs_table(lines, str(tmp_path / "bare.md"))

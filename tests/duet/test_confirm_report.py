"""benchmarks/duet_confirm.py --report: the pre-registered decision rule applied to raw records (synthetic here), on
partial records (pending) and complete ones (adopt, or keep the default and name the group size that won)."""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import duet_confirm  # noqa: E402
import duet_race  # noqa: E402


def _write(path, arm, seed, reach_at, tokens_per_step, done=True):
    """``arm`` reaches the target at evaluation step ``reach_at`` (None: never), generating ``tokens_per_step``."""
    key = duet_confirm.key(arm, seed)
    rows = duet_race.PROMPTS * duet_confirm.ARMS[arm]["num_generations"]
    recs = [{**key, "kind": "start", "from_step": 0, "commit": "abc"}, {**key, "kind": "eval", "step": 0,
                                                                         "heldout": 0.2}]
    for s in range(1, duet_race.STEPS + 1):
        rec = {**key, "kind": "step", "step": s, "seconds": 1.0, "grad_norm": 1.0}
        if arm.startswith("passrate"):
            rec.update({"duet/tokens": tokens_per_step, "n_q": [8, 8, 0, 0]})
        else:
            rec.update({"completions/mean_length": tokens_per_step / rows})
        recs.append(rec)
        if s % duet_race.EVAL_EVERY == 0:
            acc = duet_confirm.TARGET + 0.01 if reach_at is not None and s >= reach_at else 0.3
            recs.append({**key, "kind": "eval", "step": s, "heldout": acc})
    if done:
        recs.append({**key, "kind": "done"})
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs))


def _race(path, passrate_at, grpo4_at, grpo2_at=8, seeds=duet_confirm.SEEDS, noscreen_at=None):
    for seed in seeds:
        _write(path, "grpo4", seed, grpo4_at, 400)
        _write(path, "grpo2", seed, grpo2_at, 200)
        _write(path, "passrate", seed, passrate_at, 300)
        _write(path, "passrate_noscreen", seed, noscreen_at, 300)


def test_a_partial_race_is_pending(tmp_path):
    path = str(tmp_path / "r.jsonl")
    _race(path, 8, 8, seeds=(3,))
    lines = duet_confirm.report(path, plot=None)
    assert "decision (pre-registered rule): pending" in "\n".join(lines)
    assert lines[-2].startswith("passrate_confirm_over_grpo4: ") and lines[-1].startswith("passrate_confirm_over_grpo2: ")


def test_the_allocator_is_adopted_only_below_one_on_every_seed(tmp_path):
    win = str(tmp_path / "win.jsonl")
    _race(win, passrate_at=4, grpo4_at=8)  # 4 × 300 tokens against 8 × 400: ratio 0.375 on every seed
    curves = duet_race.curves_from(duet_confirm._runlog_runs(win), duet_confirm.ARMS)
    decided = duet_confirm.decide(curves)
    assert decided["adopt"] and decided["better"] == "passrate" and not decided["pending"]
    assert duet_confirm.report(win, plot=None)[-2] == "passrate_confirm_over_grpo4: 0.375 [0.375, 0.375]"
    tie = str(tmp_path / "tie.jsonl")
    _race(tie, passrate_at=12, grpo4_at=8)  # 12 × 300 against 8 × 400: ratio 1.125, and G = 2 reaches first
    curves = duet_race.curves_from(duet_confirm._runlog_runs(tie), duet_confirm.ARMS)
    decided = duet_confirm.decide(curves)
    assert not decided["adopt"] and decided["winner_group"] == "grpo2"
    assert "the default stays" in decided["why"]

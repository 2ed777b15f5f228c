"""benchmarks/_runlog.py: one trajectory per resumed run, and the real-model reports read from raw records only."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import _runlog  # noqa: E402


def write(path, records):
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def test_a_restart_discards_the_later_steps_of_the_dead_session(tmp_path):
    path = str(tmp_path / "r.jsonl")
    key = {"bench": "b", "seed": 0}
    write(path, [{**key, "kind": "start", "from_step": 0}]
          + [{**key, "kind": "step", "step": s, "x": s} for s in (1, 2, 3)]
          + [{**key, "kind": "eval", "step": s, "acc": 0.1} for s in (0, 2)]
          # the session died after step 3; the checkpoint was at step 1: steps 2-3 are redone
          + [{**key, "kind": "start", "from_step": 1}, {**key, "kind": "step", "step": 2, "x": 20}])
    (run,) = _runlog.load_runs(path, ("bench", "seed")).values()
    assert run["steps"] == {1: {**key, "kind": "step", "step": 1, "x": 1}, 2: {**key, "kind": "step", "step": 2,
                                                                              "x": 20}}
    assert sorted(run["evals"]) == [0]
    assert not run["done"] and not _runlog.is_done(path, key)
    write(path, [{**key, "kind": "done"}])
    assert _runlog.is_done(path, key)
    assert not _runlog.is_done(path, {**key, "seed": 1})


def test_a_cut_line_is_named(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"bench": "b", "kind": "start", "from_step": 0}\n{"bench": "b", "ki')
    with pytest.raises(ValueError, match=r"r\.jsonl:2 is not JSON"):
        _runlog.load_runs(str(path), ("bench",))


def test_append_and_run_name(tmp_path):
    path = str(tmp_path / "sub" / "r.jsonl")
    _runlog.append(path, {"a": 1})
    assert json.loads(open(path).read()) == {"a": 1}
    assert _runlog.run_name({"bench": "x", "lr": 5e-6, "mode": "rtn"}) == "lr5e-06-modertn"


def _fair_cast_records(lr, seed, mode, reward, model="trl-fp8:smollm2"):
    key = {"bench": "fair_cast", "model": model, "lr": lr, "seed": seed, "mode": mode, "steps": 4}
    recs = [{**key, "kind": "start", "from_step": 0}]
    for s in range(1, 5):
        recs.append({**key, "kind": "step", "step": s, "seconds": 30.0, "rewards/correctness_reward/mean": reward * s,
                     "fair_cast/visible_update_frac": 0.01 if mode == "rtn" else 0.3,
                     "fair_cast/lag_steps": None if s == 1 else (-2.0 if mode == "rtn" else 0.5)})
    recs += [{**key, "kind": "eval", "step": s, "heldout_sampled": reward * s, "heldout_greedy": 0.5}
             for s in (0, 2, 4)]
    return recs + [{**key, "kind": "done"}]


def test_fair_cast_report_pairs_rules_per_seed(tmp_path, capsys):
    import fair_cast_lag

    path = str(tmp_path / "fc.jsonl")
    for seed in range(3):
        for mode, reward in (("rtn", 0.1), ("stochastic", 0.15), ("error_feedback", 0.12)):
            write(path, _fair_cast_records(5e-6, seed, mode, reward))
    fair_cast_lag.report_real(path, str(tmp_path / "fc.png"))
    out = capsys.readouterr().out
    # visible fraction, mean |lag| and the signed lag of the last steps, over 3 seeds
    assert ("| rtn | 3 | 0.0100 ± 0.0000 [0.0100, 0.0100] (n=3) | 2.0 ± 0.0 [2.0, 2.0] (n=3) | "
            "-2.0 ± 0.0 [-2.0, -2.0] (n=3) |") in out
    assert "| stochastic | 3 | 0.3000 ± 0.0000 [0.3000, 0.3000] (n=3) | 0.5 ± 0.0 [0.5, 0.5] (n=3) | +0.5 " in out
    assert "| 0.00 / 0.20 / 0.40 |" in out  # rtn's held-out sampled at steps 0, 2, 4 (mean over seeds)
    assert "stochastic − rtn, heldout_sampled at step 4, paired per seed: +0.200, +0.200, +0.200" in out
    assert out.rstrip().splitlines()[-1] == "sr_minus_rtn_heldout_at_5e-06: +0.200"
    assert os.path.getsize(tmp_path / "fc.png") > 0


def test_fair_cast_report_separates_the_bf16_grid_start(tmp_path, capsys):
    import fair_cast_lag

    path = str(tmp_path / "fc.jsonl")
    for seed in range(3):
        for mode, reward in (("rtn", 0.1), ("stochastic", 0.15)):
            write(path, _fair_cast_records(1e-6, seed, mode, reward))
        for mode, reward in (("rtn", 0.1), ("stochastic", 0.05)):  # same lr, seeds, rules: only the start differs
            write(path, _fair_cast_records(1e-6, seed, mode, reward, model="trl-fp8:smollm2-bf16grid"))
    fair_cast_lag.report_real(path, str(tmp_path / "fc.png"))
    out = capsys.readouterr().out
    tables = out.split("\nSmolLM2-135M-Instruct")[1:]
    assert len(tables) == 2
    assert "checkpoint as loaded" in tables[0] and "starts on the bf16 grid" in tables[1]
    assert "paired per seed: +0.200, +0.200, +0.200" in tables[0]
    assert "paired per seed: -0.200, -0.200, -0.200" in tables[1]  # not mixed with the other start's runs
    assert out.rstrip().splitlines()[-1] == "sr_minus_rtn_heldout_at_1e-06_bf16grid: -0.200"


def test_bf16_grid_model_rounds_the_weights_once(tmp_path):
    import fair_cast_lag
    import torch
    from safetensors.torch import load_file, save_file

    src, dst = tmp_path / "src", tmp_path / "grid"
    src.mkdir()
    w = torch.tensor([1.0, 1.0 + 2**-10, -3.0e-3, 0.1], dtype=torch.float32)  # 1 + 2^-10 is between bf16 values
    save_file({"w": w, "ids": torch.arange(3)}, str(src / "model.safetensors"))
    (src / "config.json").write_text("{}")
    assert fair_cast_lag.on_bf16_grid({"w": w}) == 0.25
    assert fair_cast_lag.bf16_grid_model(str(src), str(dst)) == str(dst)
    out = load_file(str(dst / "model.safetensors"))
    assert out["w"].dtype == torch.float32 and torch.equal(out["w"], w.to(torch.bfloat16).float())
    assert torch.equal(out["ids"], torch.arange(3)) and (dst / "config.json").read_text() == "{}"
    assert fair_cast_lag.on_bf16_grid(out) == 1.0 and not (tmp_path / "grid.tmp").exists()
    stamp = os.path.getmtime(dst / "model.safetensors")
    fair_cast_lag.bf16_grid_model(str(src), str(dst))  # reused, not rewritten
    assert os.path.getmtime(dst / "model.safetensors") == stamp
    with pytest.raises(SystemExit, match="no model.safetensors"):
        fair_cast_lag.bf16_grid_model(str(tmp_path / "config-only"), str(tmp_path / "x"))


def test_duet_report_counts_tokens_to_target(tmp_path, capsys):
    import duet_budget

    path = str(tmp_path / "d.jsonl")
    every = duet_budget.REAL["eval_every"]
    for seed in range(3):
        for arm, tokens in (("grpo", 400.0), ("duet_0.5", 150.0)):
            key = {"bench": "duet", "model": "trl-fp8:smollm2", "arm": arm, "seed": seed, "steps": 2 * every,
                   "pool": 16}
            recs = [{**key, "kind": "start", "from_step": 0}, {**key, "kind": "eval", "step": 0,
                                                               "heldout_sampled": 0.3}]
            for s in range(1, 2 * every + 1):
                step = {**key, "kind": "step", "step": s, "seconds": 10.0, "rewards/correctness_reward/mean": 0.5}
                if arm == "grpo":
                    step["completions/mean_length"] = tokens / 16
                else:
                    step["duet/tokens"] = tokens
                recs.append(step)
            recs += [{**key, "kind": "eval", "step": every, "heldout_sampled": 0.5},
                     {**key, "kind": "eval", "step": 2 * every, "heldout_sampled": 0.7}, {**key, "kind": "done"}]
            write(path, recs)
    duet_budget.report_real(path, 0.6, str(tmp_path / "rt.png"))
    out = capsys.readouterr().out
    # both reach 0.6 at the second evaluation: tokens to target are 2 * every steps' tokens
    assert f"| grpo | 0 | {800 * every:,.0f} | {20 * every:.0f} | {2 * every} |" in out
    assert "duet_0.5 / grpo tokens to target 0.6, per seed where both reached it: 0.38, 0.38, 0.38;" in out
    assert out.rstrip().splitlines()[-1] == "duet05_tokens_to_target_over_grpo: 0.38"


def test_duet_report_bounds_a_seed_that_missed_the_target(tmp_path, capsys):
    """A seed where DUET never reached the target is not dropped from the ratio: it is a lower bound, and the
    headline is then n/a rather than a mean over the seeds that flatter it."""
    import duet_budget

    path = str(tmp_path / "d.jsonl")
    every = duet_budget.REAL["eval_every"]
    for seed in range(3):
        for arm in ("grpo", "duet_0.5"):
            key = {"bench": "duet", "model": "trl-fp8:smollm2", "arm": arm, "seed": seed, "steps": 2 * every,
                   "pool": 16}
            recs = [{**key, "kind": "start", "from_step": 0},
                    {**key, "kind": "eval", "step": 0, "heldout_sampled": 0.3}]
            for s in range(1, 2 * every + 1):
                recs.append({**key, "kind": "step", "step": s, "seconds": 10.0,
                             "rewards/correctness_reward/mean": 0.5, "completions/mean_length": 25.0,
                             **({"duet/tokens": 200.0} if arm != "grpo" else {})})
                if arm != "grpo" and seed == 0 and s == 1:  # DUET planned no rollout: no reward is logged
                    del recs[-1]["rewards/correctness_reward/mean"]
                    recs[-1]["duet/tokens"] = 0.0
            last = 0.5 if (arm, seed) == ("duet_0.5", 2) else 0.7  # seed 2: DUET stays below 0.6
            recs += [{**key, "kind": "eval", "step": every, "heldout_sampled": 0.5},
                     {**key, "kind": "eval", "step": 2 * every, "heldout_sampled": last}, {**key, "kind": "done"}]
            write(path, recs)
    duet_budget.report_real(path, 0.6, str(tmp_path / "rt.png"))
    out = capsys.readouterr().out
    assert "per seed where both reached it: 0.44, 0.50;" in out  # seed 0: a step without rollouts, 7 x 200 tokens
    assert "reached by one of the two only (bounds): seed 2 >= 0.50" in out
    assert out.rstrip().splitlines()[-1] == "duet05_tokens_to_target_over_grpo: n/a"

"""The benchmark scripts' --quick smoke modes run end to end on the CPU and end with a `name: value` headline."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WITH_PLOT = {"fair_cast_lag.py", "duet_budget.py"}  # scripts that also write a plot (--output)


@pytest.mark.parametrize("script, headline, expected", [
    ("mxfp8_consistency.py", "mxfp8_matched_gap_bf16act:", ()),
    ("fair_cast_lag.py", "rtn_lag_over_sr_lag:", ()),
    ("duet_budget.py", "duet05_tokens_to_target_over_grpo:", ()),
    ("duet_budget.py --task reasoning", "duet05_tokens_to_target_over_grpo:",
     ("task reasoning;", "duet_0.3 / grpo tokens to target", "aborted / rollouts")),
    ("checkpoint_save.py", "atomic_save_over_trl:", ("checkpoint size:", "trl_fp8  save: median")),
    ("duet_boundary.py", "duet_boundary_copy_over_journal:", ("equal to the copy: True",)),
    ("sigterm_grace.py", "sigterm_grace_s:", ("boundary: grace median", "step_end: grace median",
                                              "incomplete checkpoints 0")),
    ("qlora_speed.py", "qlora_step_ratio_vs_lora16:",
     ("(b) QLoRA (TRL today)", "generation time, speed-up (b)/(c):", "dequantizations per step (b)/(c):",
      "losses identical True, adapter weights after the steps identical True", "greedy completions identical",
      "step time (c)/(a) so far, median of 1 repetition(s):")),
    ("server_push.py", "server_push_seconds_40M:",  # no server (.venv has no vLLM): the full-size write only
     ("measured at full size (28 layers, 40.4 M, no server): (a) serialise + encode, no transfer", "no server run")),
])
def test_benchmark_quick_mode(tmp_path, script, headline, expected):
    script, *extra = script.split()
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", script), "--quick", *extra]
    if script in WITH_PLOT:
        cmd += ["--output", str(tmp_path / "plot.png")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    last = result.stdout.rstrip().splitlines()[-1]
    assert last.startswith(headline)
    value = last.removeprefix(headline).strip()
    if value != "n/a":  # a script may have nothing to divide by in a smoke run, and says so
        float(value)
    for text in expected:  # the figures on stdout; progress lines (a headline so far) on stderr
        assert text in result.stdout + result.stderr, text


@pytest.mark.parametrize("argv, message", [
    (["--reps", "2"], "--reps must be >= 5"),
    (["--hidden", "100"], "--hidden must be a positive multiple of 64"),
    (["--layers", "0"], "--layers must be >= 1"),
    (["--steps", "1"], "--steps must be >= 2"),
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["--cache-gb", "-1"], "--cache-gb must be a number of GiB >= 0"),
])
def test_qlora_speed_rejects_bad_arguments(argv, message):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "qlora_speed.py"), *argv],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert message in result.stderr


@pytest.mark.parametrize("script, argv, message", [
    ("fair_cast_lag.py", ["--model", "smollm2", "--modes", "stochastic"], "--modes must include rtn"),
    ("duet_budget.py", ["--model", "smollm2", "--arms", "duet_0.5"], "--arms must include grpo"),
])
def test_real_model_benchmarks_refuse_a_run_without_its_baseline(tmp_path, script, argv, message):
    # records and checkpoints under tmp_path: a run that were wrongly started would not touch benchmarks/results/
    argv += ["--jsonl", str(tmp_path / "runs.jsonl"), "--output-dir", str(tmp_path / "runs")]
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *argv],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert message in result.stderr

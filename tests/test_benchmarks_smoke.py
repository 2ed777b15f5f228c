"""The benchmark scripts' --quick smoke modes run end to end on the CPU and end with a `name: value` headline."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("script, headline", [
    ("mxfp8_consistency.py", "mxfp8_matched_gap_bf16act:"),
    ("fair_cast_lag.py", "rtn_lag_over_sr_lag:"),
    ("duet_budget.py", "duet05_tokens_to_target_over_grpo:"),
])
def test_benchmark_quick_mode(tmp_path, script, headline):
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", script), "--quick"]
    if script != "mxfp8_consistency.py":
        cmd += ["--output", str(tmp_path / "plot.png")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.rstrip().splitlines()[-1].startswith(headline)

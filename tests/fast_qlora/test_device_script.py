"""The prepared device check (benchmarks/gpu/qlora_check.py) without a GPU and without --quick says so. Its CPU smoke
run is checked in tests/test_device_run_all.py (run_all.sh runs it)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu", "qlora_check.py")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def test_device_check_without_cuda_says_so_and_exits_cleanly():
    result = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=120,
                            env={**ENV, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "no CUDA device here" in result.stdout and "--quick" in result.stdout

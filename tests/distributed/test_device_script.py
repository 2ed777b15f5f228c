"""The prepared device check (benchmarks/gpu/many_processes_check.py) runs end to end; here on the CPU, quick."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiprocess
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_device_check_script_smoke_runs_on_cpu():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu", "many_processes_check.py"),
                             "--device", "cpu", "--quick"], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "fsdp2 |     stochastic |               True |         True" in out
    assert "FSDP2: fair_cast refused: fair_cast is not supported with FSDP2" in out
    assert out.rstrip().endswith("many_processes_device_check: done")

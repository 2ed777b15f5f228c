"""The prepared device check (benchmarks/gpu/mxfp8_check.py) runs end to end; here on the CPU with tiny sizes."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_device_check_script_smoke_runs_on_cpu():
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu", "mxfp8_check.py"), "--device",
                             "cpu", "--quick"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "sampler mxfp8 / learner mxfp8" in out and "mxfp8/bf16" in out and "Fair Cast SR export" in out
    assert out.rstrip().endswith("mxfp8_device_check: done")

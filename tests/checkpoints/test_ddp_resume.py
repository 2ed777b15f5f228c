"""Two data-parallel processes (torchrun, gloo on CPU): every process writes its own files (RNG state, TRL's
generation buffer) into the temporary folder before the main process completes and renames it, and a resume from a
checkpoint between two generations ends where the uninterrupted run ends."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _torchrun(*args, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
           "KMP_BLOCKTIME": "0",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(HERE)), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           os.path.join(HERE, "ddp_session.py"), *map(str, args)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


@pytest.mark.slow
def test_two_process_checkpoints_resume_exactly(tmp_path):
    from tests.checkpoints.kill_runner import build_model

    model = tmp_path / "model"
    build_model(str(model))
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _torchrun(straight, model, 4, cwd=tmp_path)
    checkpoint = straight / "checkpoint-3"  # between two generations (steps_per_generation=2)
    names = set(os.listdir(checkpoint))
    assert {"rng_state_0.pth", "rng_state_1.pth", "grpo_generation_state_0.pt", "grpo_generation_state_1.pt",
            "trl_fp8_complete.json"} <= names
    assert sorted(n for n in os.listdir(straight) if "checkpoint" in n) == ["checkpoint-3", "checkpoint-4"]
    resumed.mkdir()
    shutil.copytree(checkpoint, resumed / "checkpoint-3")
    _torchrun(resumed, model, 4, cwd=tmp_path)
    a, b = torch.load(straight / "final.pt"), torch.load(resumed / "final.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

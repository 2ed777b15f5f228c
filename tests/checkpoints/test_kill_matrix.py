"""The kill -9 matrix: for each configuration, a run killed three times at chosen points (inside a step, during a
generation, at every stage of a save and of the rotation after it) and resumed each time with
``resume_from_checkpoint="auto"`` ends bit for bit where the uninterrupted run ends — weights, optimizer state, every
capability's state, RNG states — and with the same per-step metrics in metrics.jsonl.

Each configuration runs in one subprocess (``kill_runner.py``) that forks a real process per session and kills it
with SIGKILL at the chosen point; see that file for the kill points."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from trl_fp8.app.report import read_metrics

RUNNER = os.path.join(os.path.dirname(__file__), "kill_runner.py")
# Per configuration: where each of its sessions dies (the session after the last one runs to the end). Together they
# cover a step, a generation, each stage of a save (model, optimizer, RNG, every file but the marker, marker but not
# renamed), the rotation, a first save killed (no complete checkpoint: a fresh start), and a checkpoint taken between
# two generations.
MATRIX = {
    "plain": ["save:3:rng", "gen:5:3", "save:6:marker"],
    "fair_cast_sr": ["step:3", "save:4:rotate", "gen:6:7"],
    "fair_cast_ef": ["save:2:optimizer", "save:4:rename", "step:6"],
    "duet": ["gen:2:4", "save:4:model", "step:5"],
    "mxfp8": ["save:2:marker", "gen:3:5", "step:4"],
    "lora": ["step:2", "save:4:rotate", "gen:5:3"],
}
TIMING = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}


def _differences(a, b, path="") -> list[str]:
    """Where two nested states differ; tensors compared bit for bit (dtype, shape, every bit, NaNs alike)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        if not (torch.is_tensor(a) and torch.is_tensor(b)):
            return [f"{path}: tensor vs {type(b if torch.is_tensor(a) else a).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"]
        if a.is_floating_point():
            a, b = a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8)
        return [] if torch.equal(a, b) else [f"{path}: values differ"]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, set(a) ^ set(b)))[:5]} in one only"]
        return [d for k in a for d in _differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}[{i}]")]
    if hasattr(a, "shape") and hasattr(a, "tolist"):  # numpy arrays (the numpy RNG state)
        return [] if a.tolist() == b.tolist() else [f"{path}: values differ"]
    same = a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
    return [] if same else [f"{path}: {a!r} vs {b!r}"]


def _step_records(path) -> list[dict]:
    """The per-step records of a metrics file, timings left out (the final summary's train_loss averages over the
    last session only, as in transformers, so that record is left out too)."""
    return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(path) if "train_runtime" not in r]


@pytest.mark.slow
@pytest.mark.parametrize("config", list(MATRIX))
def test_killed_and_resumed_run_equals_the_uninterrupted_one(tmp_path, config):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
           "KMP_BLOCKTIME": "0", "PYTHONPATH": os.pathsep.join(
               [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, RUNNER, config, str(tmp_path), *MATRIX[config]], env=env,
                          capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "result.json") as f:
        result = json.load(f)

    def log(name):
        with open(tmp_path / f"{name}.log", errors="replace") as f:
            return f.read()[-3000:]

    assert result["model"] == 0, log("model")
    assert result["reference"] == 0, log("reference")
    sessions = result["sessions"]
    for i, s in enumerate(sessions[:-1]):  # each kill point was reached, and nothing else stopped the session
        assert s["status"] == -9, (s, log(f"session-{i}"))
    assert sessions[-1]["status"] == 0, log(f"session-{len(sessions) - 1}")
    assert not [n for n in sessions[-1]["checkpoints"] if n.startswith("_tmp-")]

    reference = torch.load(tmp_path / "reference" / "final_state.pt", weights_only=False)
    resumed = torch.load(tmp_path / "killed" / "final_state.pt", weights_only=False)
    assert reference["global_step"] == resumed["global_step"] > 0
    differences = _differences(reference, resumed)
    assert not differences, "\n".join(differences[:20])
    assert _step_records(tmp_path / "killed" / "metrics.jsonl") == _step_records(tmp_path / "reference" /
                                                                                 "metrics.jsonl")
    records = _step_records(tmp_path / "reference" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, reference["global_step"] + 1))  # each step once
    assert any(r["grad_norm"] > 0 for r in records) and reference["optimizer"]["state"]  # the weights did move

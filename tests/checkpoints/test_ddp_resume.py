"""Two data-parallel processes (torchrun, gloo on CPU): every process writes its own files (RNG state, TRL's
generation buffer) into the temporary folder before the main process completes and renames it, and a resume from a
checkpoint between two generations ends where the uninterrupted run ends."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _torchrun(*args, cwd, timeout=900):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
           "KMP_BLOCKTIME": "0",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(HERE)), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             os.path.join(HERE, "ddp_session.py"), *map(str, args)], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:  # a hang: stop torchrun and its workers (their own process group), then fail
        os.killpg(proc.pid, signal.SIGKILL)
        log = proc.communicate()[0]
        raise AssertionError(f"torchrun did not finish in {timeout} s (a hang):\n{log[-4000:]}") from None
    assert proc.returncode == 0, log[-4000:]


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


@pytest.mark.slow
def test_save_on_each_node_on_shared_storage_commits_each_checkpoint_once(tmp_path):
    """Two single-process "nodes" on one machine (torchrun --nnodes 2): with save_on_each_node=True both are savers
    and share the run folder, as nodes on a network filesystem do. Only the main process commits and rotates; before,
    both did (the second commit found its staging folder renamed away)."""
    import socket

    from tests.checkpoints.kill_runner import build_model

    model, out = tmp_path / "model", tmp_path / "run"
    build_model(str(model))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
           "KMP_BLOCKTIME": "0",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(HERE)), os.environ.get("PYTHONPATH", "")])}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank",
                               str(rank), "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port",
                               str(port), os.path.join(HERE, "ddp_session.py"), str(out), str(model), "3",
                               "each_node"], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True) for rank in (0, 1)]
    try:
        logs = [node.communicate(timeout=600)[0] for node in nodes]
    except subprocess.TimeoutExpired:  # a hang: stop both nodes' agents and workers, then fail
        for node in nodes:
            os.killpg(node.pid, signal.SIGKILL)
        raise AssertionError("the two nodes did not finish in 600 s (a hang)") from None
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(log[-3000:] for log in logs)
    from trl_fp8.checkpoints import check_complete

    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-2", "checkpoint-3"]
    assert all(check_complete(str(out / n)).complete for n in ("checkpoint-2", "checkpoint-3"))
    assert not [n for n in os.listdir(out) if n.startswith("_tmp-")]  # no staging or probe left behind
    assert (out / "final.pt").is_file()
    # the rest of the path: the final model saved once, and node 1's saver (process 1) neither cleaned up at start
    # (with the main process, at once) nor wrote model, optimizer or trainer state into the main's staging folders
    assert (out / "final_model" / "model.safetensors").is_file()
    assert not [n for n in os.listdir(out / "final_model") if n.startswith("_tmp-")]
    savers = [json.loads((out / f"savers-{rank}.json").read_text()) for rank in (0, 1)]
    assert [s["clean_stale"] for s in savers] == [1, 0]
    assert savers[0]["saved_as_saver"] == ["_tmp-checkpoint-1", "_tmp-checkpoint-2", "_tmp-checkpoint-3",
                                           "_tmp-final-model"]
    assert savers[1]["saved_as_saver"] == []


@pytest.mark.slow
def test_save_on_each_node_with_two_processes_on_a_node_saves_every_checkpoint(tmp_path):
    """save_on_each_node=True with two processes on one node: only local rank 0 saves, but every process takes part
    in the shared-storage probe's collectives. Before, the other local rank skipped the probe and waited at the next
    barrier while local rank 0 waited in the probe's broadcast: the run hung at the first checkpoint."""
    from tests.checkpoints.kill_runner import build_model

    from trl_fp8.checkpoints import check_complete

    model, out = tmp_path / "model", tmp_path / "run"
    build_model(str(model))
    _torchrun(out, model, 3, "each_node", cwd=tmp_path, timeout=420)  # a hang fails here (TimeoutExpired)
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-2", "checkpoint-3"]
    assert all(check_complete(str(out / n)).complete for n in ("checkpoint-2", "checkpoint-3"))
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(os.listdir(out / "checkpoint-3"))
    assert not [n for n in os.listdir(out) if n.startswith("_tmp-")]
    assert (out / "final.pt").is_file()

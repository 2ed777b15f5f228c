"""The save path with 2 real processes (torchrun, gloo, CPU): a check that fails on one rank (the saver finds another
live process writing the final model) fails on every rank instead of leaving the others in a collective, and the
stopped-step save is one decision all ranks take (each rank's own view of the disk could differ). A write or commit
that fails on the saving rank (a full disk, an fsync EIO) is raised on every rank: before, the other rank waited in the
save's next barrier until the process group's timeout (30 s here; a launcher's at worst)."""

import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiprocess
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("agreement")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
                "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(port), os.path.join(HERE, "save_agreement_worker.py"), str(out)],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]


def test_a_final_save_refused_on_the_saver_is_refused_on_every_rank(records):
    saver, other = (r["final_save_refused_on_the_saver"] for r in records)
    assert saver.get("raised") == "StagingBusy", saver
    assert "being written by another process" in saver["message"]
    assert other.get("raised") == "RuntimeError", other  # not a collective's timeout
    assert "failed on process 0" in other["message"] and "being written by another process" in other["message"]
    assert saver["saved"] == other["saved"] == []  # neither went on to write


def test_the_stopped_step_save_is_one_decision_on_every_rank(records):
    assert [r["stopped_save_decided_together"] for r in records] == [{"save": True}, {"save": True}]


def test_a_final_save_that_fails_on_the_saver_stops_every_rank(records):
    saver, other = (r["final_save_fails_on_the_saver"] for r in records)
    assert saver.get("raised") == "OSError" and "No space left on device" in saver["message"], saver
    assert other.get("raised") == "RuntimeError", other  # not a collective's timeout
    assert "saving a final model failed on process 0" in other["message"], other
    assert "No space left on device" in other["message"]


def test_a_commit_that_fails_on_the_saver_stops_every_rank(records):
    saver, other = (r["checkpoint_commit_fails_on_the_saver"] for r in records)
    assert saver.get("raised") == "OSError" and "Input/output error" in saver["message"], saver
    assert other.get("raised") == "RuntimeError", other
    assert "saving checkpoint checkpoint-3 failed on process 0" in other["message"], other
    assert not saver["final"] and not other["final"]

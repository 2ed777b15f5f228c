"""Sharded Fair Cast on two gloo ranks (CPU): torch's ``fully_shard`` (FSDP2) and ``deepspeed.initialize`` ZeRO-1/2/3
(bf16, ``DS_ACCELERATOR=cpu``). For SR and EF, over four optimizer steps: the served copy assembled from the shards,
and the weights the engine's all-gather hands the forward, equal bit for bit the one-process export of the assembled
fp32 master; a run resumed from a checkpoint of step 2 (the engine's own checkpoint plus each rank's Fair Cast state
file) serves the same bits as the uninterrupted one. See ``shard_worker.py``. About 10 s per launch."""

import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiprocess
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MODES = ("stochastic", "error_feedback")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(out, engines):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
           "KMP_BLOCKTIME": "0", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(_free_port()), os.path.join(HERE, "shard_worker.py"), str(out), ",".join(engines),
         ",".join(MODES)], capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    for engine in engines:
        for mode in MODES:
            a, b = (json.load(open(os.path.join(out, f"{engine}-{mode}.rank{r}.json"))) for r in range(2))
            assert a["errors"] == [] and b["errors"] == [], (engine, mode, a["errors"][:5])
            assert len(a["straight"]) == 4 and len(set(a["straight"])) == 4  # the served copy moved every step
            assert a["resumed"] == a["straight"], (engine, mode)  # through a checkpoint, bit for bit
            assert a["straight"] == b["straight"]  # rank 0 and rank 1 assembled the same copy


def test_fsdp2_shards_serve_the_one_process_bits(tmp_path):
    _launch(tmp_path, ["fsdp2"])


def test_deepspeed_partitions_serve_the_one_process_bits(tmp_path):
    pytest.importorskip("deepspeed")
    _launch(tmp_path, ["zero1", "zero2", "zero3"])

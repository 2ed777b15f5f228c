"""trl_fp8.GRPOTrainer under DeepSpeed ZeRO-2 and ZeRO-3 with two CPU ranks: ``torchrun`` with the environment
``accelerate launch --config_file zero2.yaml`` sets, ``DS_ACCELERATOR=cpu``, gloo, bf16.

Fair Cast replaces DeepSpeed's fp32 -> bf16 partition copy, so the weights the forward runs on are the served copy —
after every step, the one-process SR export of the fp32 master assembled from both ranks' partitions, bit for bit —
the in-process twin serves them with every weight-sync check passing on both ranks, and a run resumed from
checkpoint-2 serves step 3's bits again (SR and EF). DUET makes one plan for the global batch under ZeRO-2 and MXFP8
composes with it; under ZeRO-3 (partitioned parameters) Fair Cast SR/EF and the checks run the same way. About 30 s
per launch (two launches)."""

import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiprocess
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _launch(out, stage, names):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
           "KMP_BLOCKTIME": "0", "DS_ACCELERATOR": "cpu", "ACCELERATE_USE_DEEPSPEED": "true",
           "ACCELERATE_DEEPSPEED_ZERO_STAGE": str(stage),
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(port), os.path.join(HERE, "ddp_worker.py"), str(out), ",".join(names)],
        capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    return {name: [json.load(open(os.path.join(out, f"{name}.rank{r}.json"))) for r in range(2)] for name in names}


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    pytest.importorskip("deepspeed")
    return _launch(tmp_path_factory.mktemp("zero2"), 2, ["zero2_sr", "zero2_ef", "zero2_duet", "zero2_mxfp8"])


@pytest.fixture(scope="module")
def records3(tmp_path_factory):
    pytest.importorskip("deepspeed")
    return _launch(tmp_path_factory.mktemp("zero3"), 3, ["zero3_sr", "zero3_ef"])


@pytest.mark.parametrize("name", ["zero2_sr", "zero2_ef", "zero2_duet", "zero2_mxfp8"])
def test_fair_cast_and_the_checks_run_under_zero2(records, name):
    _fair_cast_and_checks(records[name], name)


@pytest.mark.parametrize("name", ["zero3_sr", "zero3_ef"])
def test_fair_cast_and_the_checks_run_under_zero3(records3, name):
    """ZeRO-3: the twin is built from the gathered weights, the served copy streams gathered one tensor at a time."""
    _fair_cast_and_checks(records3[name], name)
    a, b = records3[name]
    assert a["resumed"]["served"] == b["resumed"]["served"] == [a["served"][2]]  # resumed from checkpoint-2


def _fair_cast_and_checks(pair, name):
    a, b = pair
    assert a["deepspeed"] and b["deepspeed"] and a["error"] is None
    assert {"fair_cast", "sync_checks"} <= set(a["capabilities"])
    steps = 2 if name == "zero2_mxfp8" else 3
    assert len(a["served"]) == steps and len(set(a["served"])) == steps and a["served"] == b["served"]
    assert a["reference_ok"] == ([True] * steps if not name.endswith("_ef") else [])
    for summary in (a["checks"], b["checks"]):
        assert not summary["failed"]
        for check in ("recipe_parity", "coverage", "freshness", "quant_parity", "logprob_agreement"):
            assert summary["compared"].get(check), (check, summary)
    for key in ("fair_cast/visible_update_frac", "fair_cast/max_abs_err_ulps", "sync/logp_gap_mean"):
        series = [[h[key] for h in r["logs"] if key in h] for r in (a, b)]
        assert series[0] and series[0] == series[1], key  # reduced once over the ranks: the same on both


def test_sr_serves_the_one_process_export_and_resumes_exactly(records):
    a, b = records["zero2_sr"]
    assert a["reference_ok"] == b["reference_ok"] == [True, True, True]
    assert a["resumed"]["reference_ok"] == [True]
    assert a["resumed"]["served"] == [a["served"][2]]  # step 3 after resuming from checkpoint-2: the same bits


def test_duet_plans_the_global_batch_under_zero2(records):
    a, b = records["zero2_duet"]
    assert {"duet", "fair_cast", "sync_checks"} <= set(a["capabilities"]) and a["reference_ok"] == [True] * 3
    assert len(a["duet"]) == 3
    for da, db in zip(a["duet"], b["duet"], strict=True):
        assert da["counts"] == db["counts"] and da["global"] == db["global"]
        assert da["local"] + db["local"] == da["global"] and sum(da["counts"]) < 8


def test_ef_resumes_exactly_from_each_ranks_state_file(records):
    a, b = records["zero2_ef"]
    assert a["resumed"]["served"] == b["resumed"]["served"] == [a["served"][2]]
    # every rank's EF state is staged inside the checkpoint before its completion marker, so the marker covers it
    assert {"fair_cast_state.rank0.pt", "fair_cast_state.rank1.pt"} <= set(a["checkpoint_files"])

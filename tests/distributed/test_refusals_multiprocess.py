"""The FSDP2 and DeepSpeed ZeRO-3 refusals with real ranks: ``torchrun --nproc_per_node 2`` on CPU (gloo), with the
environment ``accelerate launch --config_file fsdp2.yaml`` / ``zero3.yaml`` sets. Every rank must refuse, with the
same message, at the same stage (the config, or the trainer's start), and the launch must end (no rank left waiting
in a collective the others never reach). ``tests/distributed/test_guards.py`` checks the same refusals in one
process; this is what a user's multi-process launch sees.

One launch per engine (``refusal_worker.py`` runs every case in turn): about 45 s for FSDP2 and 1-4 min for ZeRO-3
(DeepSpeed builds its CPU communication op on first use) on 2 busy cores. DeepSpeed runs here on CPU
(``DS_ACCELERATOR=cpu``), so ZeRO-3 is launched for real; without the ``deepspeed`` package its tests skip."""

import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiprocess
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

FSDP2 = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
ZERO3 = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "DS_ACCELERATOR": "cpu"}
FSDP2_CASES = ["config_fair_cast", "config_duet", "config_mxfp8", "config_fast_qlora", "config_sync_checks",
               "trainer_fair_cast", "default_checks"]
ZERO3_CASES = ["config_duet", "config_mxfp8", "config_fast_qlora", "trainer_duet", "zero3_peft_fair_cast"]
OFF_HINTS = {"fair_cast": "fair_cast='off'", "duet": "duet=False", "mxfp8": "mxfp8=False",
             "fast_qlora": "fast_qlora='off'", "sync_checks": "sync_checks='off'"}


def _launch(out, engine_env, cases):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in (*FSDP2, *ZERO3, "WORLD_SIZE", "RANK")}
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0",
                "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **engine_env})
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(port), os.path.join(HERE, "refusal_worker.py"), str(out), ",".join(cases)],
        capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    return {case: [json.load(open(os.path.join(out, f"{case}.rank{r}.json"))) for r in range(2)] for case in cases}


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("fsdp2"), FSDP2, FSDP2_CASES)


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    pytest.importorskip("deepspeed")
    return _launch(tmp_path_factory.mktemp("zero3"), ZERO3, ZERO3_CASES)


def _same_refusal_on_every_rank(records, stage):
    assert [r["world"] for r in records] == [2, 2]
    assert all(r["stage"] == stage and r.get("error") == "ValueError" for r in records), records
    assert records[0]["message"] == records[1]["message"], records
    return records[0]["message"]


@pytest.mark.parametrize("case", [c for c in FSDP2_CASES if c != "default_checks"])
def test_every_rank_refuses_under_fsdp2(fsdp2, case):
    stage, name = case.split("_", 1)
    message = _same_refusal_on_every_rank(fsdp2[case], stage)
    assert message.startswith(f"{name} is not supported with FSDP2 (asked for by an accelerate config "
                              "(ACCELERATE_USE_FSDP in the environment"), message
    assert OFF_HINTS[name] in message and "Run it on one process or with DDP" in message
    # stage "trainer": accelerate does not act on FSDP on a CPU machine; the request is refused all the same, when the
    # trainer checks its config again (GRPOConfig.validate_trl_fp8) or at its own start


def test_the_defaults_are_not_refused_on_any_rank_under_fsdp2(fsdp2):
    # every field at its default (the checks on by default, nothing for them to check with TRL's own sampler): the
    # run is admitted on both ranks, without a line (the one-line switch-off needs a sampler to check: vLLM, which
    # is not installed here, or Fair Cast, refused under FSDP2; test_guards.py checks that line in one process)
    records = fsdp2["default_checks"]
    assert all(r["stage"] == "ran" and r["warnings"] == [] and r["sync_checks"] == "default" for r in records), records


@pytest.mark.parametrize("case", [c for c in ZERO3_CASES if c != "zero3_peft_fair_cast"])
def test_every_rank_refuses_under_zero3(zero3, case):
    stage, name = case.split("_", 1)
    message = _same_refusal_on_every_rank(zero3[case], stage)
    assert message.startswith(f"{name} is not supported with DeepSpeed ZeRO-3 (asked for by an accelerate config "
                              "(ACCELERATE_USE_DEEPSPEED in the environment))"), message
    assert OFF_HINTS[name] in message
    if stage == "trainer":  # the trainer runs ZeRO-3 for real here: the refusal comes from its own view, not only env
        assert "not active in this trainer" not in message


def test_fair_cast_over_lora_is_refused_on_every_rank_under_zero3(zero3):
    message = _same_refusal_on_every_rank(zero3["zero3_peft_fair_cast"], "trainer")
    assert message.startswith("fair_cast under DeepSpeed ZeRO-3 runs with trl_fp8's in-process sampler and a full "
                              "model only"), message
    assert "use ZeRO-1/2 or DDP" in message

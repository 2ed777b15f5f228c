"""``trl-fp8 plan``: the must-show commands, JSON, and one-line errors naming the flag and the allowed values."""

import json
import subprocess
import sys

from trl_fp8.app.cli import config_choices, main
from trl_fp8.plan.command import FAIR_CAST as PLAN_FAIR_CAST, FAST_QLORA


def test_7b_qlora_on_a_t4_fits(capsys):
    assert main(["plan", "--model", "qwen2.5-7b", "--qlora", "--device", "t4"]) == 0
    out = capsys.readouterr().out
    assert "fits: yes" in out.splitlines()
    total = next(line for line in out.splitlines() if line.startswith("total (trainer card)"))
    used, usable = (float(x.split()[0]) for x in total.split(": ", 1)[1].split(" of "))
    assert used < usable == 14.70
    for item in ("base weights, 4-bit", "LoRA adapters", "AdamW state", "activations", "completion logits",
                 "KV cache", "Fair Cast served adapters", "CUDA context"):
        assert item in out, item


def test_7b_full_fine_tuning_on_a_t4_does_not(capsys):
    assert main(["plan", "--model", "qwen2.5-7b", "--device", "t4"]) == 0
    out = capsys.readouterr().out
    assert "fits: no" in out.splitlines()
    assert "largest items: AdamW state" in out and "--qlora" in out


def test_json(capsys):
    assert main(["plan", "--model", "smollm2-135m", "--full", "--fair-cast", "rtn", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is True and data["settings"]["fair_cast"] == "rtn" and data["method"] == "full fine-tuning"


def test_bad_input_is_one_line_naming_the_flag(capsys):
    assert main(["plan", "--model", "qwen9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trl-fp8 plan: error: --model: unknown model 'qwen9'") and "qwen2.5-7b" in err
    assert main(["plan", "--model", "qwen2.5-7b", "--device", "k80"]) == 2
    err = capsys.readouterr().err
    assert ("--device: device 'k80' is not valid: allowed values are t4, 2xt4, l4, a10g, a100-40, l40s, a100-80, "
            "h100-80, h200") in err
    assert main(["plan", "--model", "qwen2.5-7b", "--qlora", "--vllm", "server"]) == 2
    assert "second GPU" in capsys.readouterr().err
    assert main(["plan", "--model", "qwen2.5-7b", "--full", "--lora-r", "8"]) == 2
    assert main(["plan", "--model", "qwen2.5-7b", "--fair-cast", "sr"]) == 2
    assert "invalid choice: 'sr'" in capsys.readouterr().err


def test_fair_cast_choices_are_the_config_s():
    assert list(PLAN_FAIR_CAST) == config_choices("fair_cast")


def test_the_console_script_exits_0_and_prints_the_verdict():
    done = subprocess.run([sys.executable, "-m", "trl_fp8.app.cli", "plan", "--model", "smollm2-135m", "--qlora",
                           "--device", "t4"], capture_output=True, text=True)
    assert done.returncode == 0 and "fits: yes" in done.stdout


def test_fast_qlora_choices_are_the_config_s():
    assert list(FAST_QLORA) == config_choices("fast_qlora")


def test_the_engine_share_is_honoured_for_a_server_too(capsys):
    """--vllm-gpu-memory-utilization sets the server's share of its card (default 0.9, trl-fp8 vllm-serve's) as it sets
    a colocated engine's (default 0.3, TRL's)."""
    import json

    shares = {}
    for value in (None, "0.8"):
        argv = ["plan", "--model", "qwen2.5-7b", "--qlora", "--device", "2xt4", "--vllm", "server", "--json"]
        assert main(argv + (["--vllm-gpu-memory-utilization", value] if value else [])) == 0
        shares[value] = json.loads(capsys.readouterr().out)["totals"]["1"]["total"]
    usable = 14.70 * 2**30
    assert abs(shares[None] / usable - 0.9) < 0.01 and abs(shares["0.8"] / usable - 0.8) < 0.01


def test_qwen3_8b_qlora_on_a_t4_is_planned_from_its_config_json_and_by_name():
    """The model of the Colab and Kaggle notebooks: its Hub config.json (a copy in tests/plan/fixtures) and its name,
    through the command as users run it. Both plan the same model: the q/k norms counted, nothing refused."""
    import os

    config = os.path.join(os.path.dirname(__file__), "fixtures", "qwen3-8b.json")
    outs = []
    for model in (config, "Qwen/Qwen3-8B"):
        run = subprocess.run([sys.executable, "-m", "trl_fp8.app.cli", "plan", "--model", model, "--qlora", "--device",
                              "t4", "--json"], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        outs.append(json.loads(run.stdout))
    by_file, by_name = outs
    assert by_file["total_bytes"] == by_name["total_bytes"] and by_file["fits"] == by_name["fits"]
    assert by_file["params"] == 8_190_735_360  # 8.19 B: Qwen3-8B's model card


def test_the_vllm_context_is_planned_and_a_whole_context_window_does_not_fit(capsys):
    """Llama-3.1-8B QLoRA, the server on the second T4: the plan sizes the engine for prompt + completion and prints
    the server's --max_model_len and the exact --kv_cache_memory_bytes; for the model's whole context (131,072
    tokens, what vLLM starts with when given no max_model_len) one request needs 16 GiB of KV cache against the
    7.0 GiB the card leaves, and the plan says the engine cannot start (vLLM's rule: tests/test_vllm_context.py)."""
    from trl_fp8.plan import MODELS
    from trl_fp8.plan.plan import vllm_kv_for_one_request

    assert main(["plan", "--model", "llama-3.1-8b", "--qlora", "--device", "2xt4", "--vllm", "server", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is True and data["settings"]["vllm_max_model_len"] == 256 + 512
    note = next(n for n in data["notes"] if n.startswith("vLLM context"))
    assert "--max_model_len 768 --kv_cache_memory_bytes " in note
    assert main(["plan", "--model", "llama-3.1-8b", "--qlora", "--device", "2xt4", "--vllm", "server",
                 "--vllm-max-model-length", "131072", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is False
    assert any("the vLLM engine cannot start: max_model_len 131072 needs 16.00 GiB" in p for p in data["problems"])
    # (⌈131072 / 16⌉ + 1) blocks × 32 layers × 16 tokens × 8 KV heads × 2 × 128 × 2 B
    assert vllm_kv_for_one_request(MODELS["llama-3.1-8b"], 131072) == 8193 * 32 * 16 * 8 * 2 * 128 * 2


def test_a_vllm_engine_holds_the_4bit_base_with_fp32_scales(capsys):
    """vLLM's bitsandbytes loader unpacks double quantization: every absmax fp32 (4 B a block of 64), so Qwen2.5-7B's
    engine weights are 5.45 GiB where the trainer's double-quantized base and 16-bit rest are 5.17."""
    from trl_fp8.plan.spec import QuantSpec

    q = QuantSpec()
    assert q.engine_weight_bytes(64 * 1000) == 32_000 + 4 * 1000 + 64
    assert q.weight_bytes(64 * 1000) < q.engine_weight_bytes(64 * 1000)
    assert main(["plan", "--model", "qwen2.5-7b", "--qlora", "--device", "2xt4", "--vllm", "server", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    engine = next(r for r in rows if r["item"].startswith("vLLM engine (server): weights"))
    assert round(engine["bytes"] / 2**30, 2) == 5.45


def test_lora_dropout_is_planned(capsys):
    """TRL's CLI runs lora_dropout 0.05: each LoRA layer then keeps the dropout's noise and its own lora_A input
    (counted exactly in tests/plan/test_activations.py); the plan says so in its method and counts more."""
    totals = []
    for dropout in ("0", "0.05"):
        assert main(["plan", "--model", "qwen2.5-1.5b", "--lora-r", "16", "--device", "t4", "--lora-dropout", dropout,
                     "--no-gradient-checkpointing", "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        totals.append(data["total_bytes"])
    assert data["method"].endswith(", dropout 0.05") and totals[1] > totals[0]
    assert main(["plan", "--model", "qwen2.5-1.5b", "--lora-r", "16", "--lora-dropout", "1"]) == 2
    assert "--lora-dropout must be a number in [0, 1), got 1.0" in capsys.readouterr().err


def test_a_merged_serving_server_is_told_to_serve_the_adapters(capsys):
    assert main(["plan", "--model", "qwen2.5-7b", "--qlora", "--device", "2xt4", "--vllm", "server",
                 "--lora-serving", "merged"]) == 0
    out = capsys.readouterr().out
    assert "fits: no" in out and "the one change that would make it fit: serve the adapters, not a merged copy " \
                                 "(--lora-serving adapters)" in out


def test_trl_s_bf16_qlora_factors_under_fp16_autocast_are_not_the_compute_dtype():
    """On a T4 (fp16 autocast) TRL keeps QLoRA factors in bf16: 16-bit, but not the compute dtype, so each LoRA input
    and factor is copied per op (measured: tests/plan/test_activations.py, ``qlora_bf16+fp16``)."""
    from trl_fp8.plan.activations import shape_of
    from trl_fp8.plan.plan import make_spec, plan_args

    def shape(device="t4", **fields):
        return shape_of(make_spec("qwen2.5-7b", plan_args(**fields), peft=16, quantization="nf4", device=device))

    assert shape(fair_cast="off").adapter_is_compute is False  # fp16 on a T4, bf16 factors
    assert shape(fair_cast="stochastic").adapter_is_compute is True  # Fair Cast's fp32 masters: counted as fp32
    assert shape(device="l4", fair_cast="off").adapter_is_compute is True  # bf16 autocast on an L4

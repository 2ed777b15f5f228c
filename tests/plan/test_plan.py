"""The memory plan's arithmetic and verdicts: the free-tier configurations, Fair Cast's serving modes, vLLM, the
suggestion, and every capability stating its rows."""

import importlib
import importlib.util
import subprocess
import sys

import pytest

from trl_fp8.plan import FREE_TIER, MODELS, decision_of, memory_plan
from trl_fp8.plan.devices import GIB, resolve_device
from trl_fp8.plan.spec import QuantSpec

A7 = 40_370_176  # Qwen2.5-7B LoRA r=16 on all seven projections (tests/plan/test_spec.py)
P7 = 7_615_616_512  # Qwen2.5-7B parameters


@pytest.fixture(scope="module")
def qlora_7b_t4():
    return memory_plan("qwen2.5-7b", FREE_TIER, peft=16, quantization="nf4", device="t4")


def test_7b_qlora_with_every_capability_fits_a_t4(qlora_7b_t4):
    plan = qlora_7b_t4
    assert plan.fits and plan.total < resolve_device("t4").usable == int(14.7 * GIB)
    rows = plan.by_category()
    linears = [t.numel for t in MODELS["qwen2.5-7b"].tensors() if t.role == "linear"]
    assert rows["base"] == sum(QuantSpec().weight_bytes(n) for n in linears) + 2 * (P7 - sum(linears))
    assert rows["adapters"] == 4 * A7  # fp32 masters: Fair Cast's adapter serving upcasts TRL's bf16 factors
    assert rows["fair_cast/master"] == 4 * A7 and rows["fair_cast/served"] == 2 * A7
    assert "fair_cast/twin" not in rows and "fair_cast/residual" not in rows  # SR, adapters: no copy of the base
    assert rows["optimizer"] == 8 * A7 + 4 * 2 * 7 * 28  # exp_avg, exp_avg_sq + a step per factor (392 factors)
    assert rows["gradients"] == 4 * A7
    items = [r.item for r in plan.rows]
    assert any("rollout cache" in i for i in items) and any("DUET" in i for i in items)
    # gradient checkpointing: 8 × 768 tokens × hidden 3584 × 28 blocks × 2 B of block inputs
    saved = next(r for r in plan.rows if r.item.startswith("activations: block inputs"))
    assert saved.bytes > 8 * 768 * 3584 * 28 * 2


def test_fair_cast_adds_at_most_three_times_the_adapters_fp32_bytes(qlora_7b_t4):
    fair = sum(r.bytes for r in qlora_7b_t4.rows if r.owner == "fair_cast")
    assert fair <= 3 * 4 * A7
    ef = memory_plan("qwen2.5-7b", {**FREE_TIER, "fair_cast": "error_feedback"}, peft=16, quantization="nf4")
    assert ef.by_category()["fair_cast/residual"] == 4 * A7


def test_7b_full_fine_tuning_does_not_fit_a_t4_and_says_what_would():
    plan = memory_plan("qwen2.5-7b", FREE_TIER, device="t4")
    assert not plan.fits
    rows = plan.by_category()
    assert rows["base"] == rows["gradients"] == 4 * P7 and rows["optimizer"] == 8 * P7 + 4 * 339
    # the twin: 2 B per parameter + its buffers (inv_freq, original_inv_freq: 64 fp32 each)
    assert rows["fair_cast/master"] == 4 * P7 and rows["fair_cast/twin"] == 2 * P7 + 512
    assert plan.largest(1)[0].item.startswith("AdamW")
    assert plan.suggestion.startswith("QLoRA") and "--qlora" in plan.suggestion


def test_merged_serving_costs_dense_copies_of_the_base():
    merged16 = memory_plan("smollm2-135m", {**FREE_TIER, "lora_serving": "merged"}, peft=16, base_dtype="float32")
    p = MODELS["smollm2-135m"].params
    rows = merged16.by_category()
    # the LoRA layers' fp32 base kept aside + the other tensors' fp32 masters = 4 B per base parameter
    assert rows["fair_cast/base_copy"] + rows["fair_cast/master"] == 4 * p and rows["fair_cast/served"] == 2 * p
    assert rows["fair_cast/base_copy"] < 4 * p  # embeddings and norms are not LoRA layers
    assert rows["fair_cast/twin"] == 2 * p + MODELS["smollm2-135m"].buffer_bytes()
    merged4 = memory_plan("qwen2.5-7b", {**FREE_TIER, "lora_serving": "merged"}, peft=16, quantization="nf4")
    assert "fair_cast/base_copy" not in merged4.by_category() and not merged4.fits
    assert "--lora-serving adapters" in merged4.suggestion


def test_checkpointing_and_chunked_logits_are_what_make_activations_small():
    on = memory_plan("smollm2-135m", FREE_TIER)
    off = memory_plan("smollm2-135m", FREE_TIER, gradient_checkpointing=False)
    assert off.totals[0]["training"] > 2 * on.totals[0]["training"]
    full_logits = memory_plan("smollm2-135m", FREE_TIER, chunked_logits=False)
    row = next(r for r in full_logits.rows if "not chunked" in r.item)
    assert row.bytes == 8 * 512 * 49152 * (2 + 4 + 4)  # logits, fp32 log-softmax, its gradient per token × vocab


def test_vllm_colocate_and_the_server_on_a_second_t4():
    colocate = memory_plan("qwen2.5-7b", FREE_TIER, peft=16, quantization="nf4", vllm="colocate")
    assert not colocate.fits and any("cannot start" in p for p in colocate.problems)
    assert "--vllm server" in colocate.suggestion  # the vLLM server on a second T4 fits (adapters pushed to it)
    # A `trl-fp8 vllm-serve` server is pushed adapter versions ('auto' = adapters): no merged copy on the trainer's
    # card, the server loads the 4-bit base plus two LoRA slots — the free-tier recipe fits both cards of 2×T4
    full = memory_plan("qwen2.5-7b", FREE_TIER, peft=16, quantization="nf4", vllm="server", device="2xt4")
    assert full.spec.lora_serving == "adapters" and full.fits and set(full.totals) == {0, 1}
    assert decision_of(full.spec).kind == "lora_server" and decision_of(full.spec).engine.weights == "nf4"
    engine = [r for r in full.rows if r.owner == "engine"]
    assert {r.gpu for r in engine} == {1}
    assert sum(r.bytes for r in engine) == int(0.9 * resolve_device("2xt4").usable)  # the reservation, split
    slots = next(r for r in engine if "LoRA slots" in r.item)
    assert slots.bytes == 2 * 2 * full.spec.adapter_params  # max_loras 2, 16-bit
    weights = next(r for r in engine if "weights" in r.item)
    assert weights.bytes < 6 * 2**30  # a 4-bit base, not 14 GiB of 16-bit weights
    assert not any("KV cache (in-process" in r.item for r in full.rows)  # the engine generates
    merged = memory_plan("qwen2.5-7b", {**FREE_TIER, "lora_serving": "merged"}, peft=16, quantization="nf4",
                         vllm="server", device="2xt4")
    assert decision_of(merged.spec).kind == "dense_stream" and not merged.fits  # a dense copy on the trainer's card
    with pytest.raises(ValueError, match="second GPU"):
        memory_plan("qwen2.5-7b", FREE_TIER, peft=16, quantization="nf4", vllm="server", device="t4")


def test_eight_bit_adamw_counts_blocks_and_small_tensors():
    plan = memory_plan("smollm2-135m", {"optim": "adamw_8bit"})
    tensors = MODELS["smollm2-135m"].tensors()
    big = [t.numel for t in tensors if t.numel >= 4096]
    small = sum(t.numel for t in tensors if t.numel < 4096)  # norms: fp32 state
    expected = sum(2 * n + 8 * -(-n // 256) for n in big) + 8 * small + 2 * 1024
    assert plan.by_category()["optimizer"] == expected


def test_inputs_are_checked_naming_what_is_allowed():
    with pytest.raises(ValueError, match="needs LoRA"):
        memory_plan("qwen2.5-7b", quantization="nf4")
    with pytest.raises(ValueError, match="allowed values are t4, 2xt4"):
        memory_plan("qwen2.5-7b", device="t5")
    with pytest.raises(ValueError, match="fp32 master weights"):
        memory_plan("qwen2.5-7b", FREE_TIER, base_dtype="bfloat16")
    with pytest.raises(ValueError, match="unknown GRPOConfig field"):
        memory_plan("qwen2.5-7b", {"fair_cats": "rtn"})
    assert memory_plan("smollm2-135m", device="24GB").device.usable == 24 * 10**9


def test_every_capability_states_what_it_allocates():
    from trl_fp8.registry import CAPABILITIES

    spec = memory_plan("qwen2.5-7b", FREE_TIER, peft=16, quantization="nf4").spec
    for capability in CAPABILITIES:
        package = capability.__module__.rpartition(".")[0]
        assert importlib.util.find_spec(f"{package}.memory") is not None, capability.name
        module = importlib.import_module(f"{package}.memory")
        assert capability.memory_rows(spec) == module.memory_rows(spec)
    owners = {r.owner for r in memory_plan("qwen2.5-7b", {**FREE_TIER, "mxfp8": True}).rows}
    assert {"fair_cast", "sync_checks", "duet", "mxfp8"} <= owners


def test_importing_the_plan_imports_neither_torch_nor_trl():
    code = "import sys, trl_fp8.plan; sys.exit(any(m in sys.modules for m in ('torch', 'trl', 'transformers')))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_json_is_what_the_table_shows(qlora_7b_t4):
    import json

    from trl_fp8.plan.render import as_json, markdown

    data = json.loads(as_json(qlora_7b_t4))
    assert data["fits"] is True and data["total_bytes"] == qlora_7b_t4.total
    assert sum(r["bytes"] for r in data["rows"]) == sum(r.bytes for r in qlora_7b_t4.rows)
    assert "**fits: yes**" in markdown(qlora_7b_t4)


def test_a_lora_config_peft_has_applied_is_planned_like_the_one_given():
    """PEFT rewrites a LoraConfig's target_modules into the layers' full names once it wraps a model; the plan takes the
    projection (the last component), so the trainer's own peft config can be passed back."""
    from peft import LoraConfig

    given = LoraConfig(r=16, target_modules=["q_proj", "v_proj"])
    applied = LoraConfig(r=16, target_modules={"model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.v_proj"})
    assert memory_plan("smollm2-135m", FREE_TIER, peft=applied).by_category() == \
        memory_plan("smollm2-135m", FREE_TIER, peft=given).by_category()
    with pytest.raises(ValueError, match="LoRA target_modules gate unknown"):
        memory_plan("smollm2-135m", FREE_TIER, peft=LoraConfig(r=16, target_modules=["model.layers.0.mlp.gate"]))

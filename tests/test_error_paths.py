"""The ValueError / TypeError paths that no other test reaches: each one, through the most public way in.

Config-time refusals go through ``trl_fp8.GRPOConfig``; PEFT set-ups Fair Cast cannot serve go through a
``trl_fp8.GRPOTrainer`` built on the tiny local model (construction only, no training); the rest are pure core
functions and classes, called directly. Every test matches the message that names the field or argument.
"""

import re
from types import SimpleNamespace

import pytest
import torch

import trl_fp8
from trl_fp8.duet.component import Duet
from trl_fp8.duet.surrogate import PromptStats
from trl_fp8.fair_cast.rounding import ErrorFeedback, error_feedback_round
from trl_fp8.fair_cast.served import ServedCopy
from trl_fp8.mxfp8.convert import MXRecipe
from trl_fp8 import numerics
from trl_fp8.numerics import TensorSpec, mx_fake_quantize, torch_dtype
from trl_fp8.sync_checks.logprobs import SampledLogprobTap
from trl_fp8.app.tasks.arithmetic import correctness_reward, make_arithmetic_dataset
from trl_fp8.tokenization import build_char_tokenizer


def _config(tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none", disable_tqdm=True,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=4, max_steps=1, save_strategy="no",
    )
    kwargs.update(overrides)
    return trl_fp8.GRPOConfig(**kwargs)


def _trainer(tmp_path, model, peft_config=None, trainer_kwargs=None, **overrides):
    return trl_fp8.GRPOTrainer(
        model=model, reward_funcs=[correctness_reward], args=_config(tmp_path, **overrides),
        train_dataset=make_arithmetic_dataset(8, seed=1), processing_class=build_char_tokenizer(),
        peft_config=peft_config, **(trainer_kwargs or {}),
    )


def _load(model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)


# -- GRPOConfig: field values and combinations refused at config time ----------------------------------------------
@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"duet": "yes"}, "duet must be True or False, got 'yes'."),
        ({"duet": True, "use_transformers_continuous_batching": True},
         "duet=True cannot be combined with use_transformers_continuous_batching=True: DUET plans"),
        ({"duet": True, "generation_kwargs": {"num_beams": 2}},
         "duet=True stops sampled rollouts one by one; it cannot run with beam search (generation_kwargs num_beams=2)."),
        ({"duet_markers": ["math", ""]}, "duet_markers: every marker must be a non-empty string, got ''."),
        ({"duet_markers": ["math", 3]}, "duet_markers: every marker must be a non-empty string, got 3."),
        ({"fair_cast": "rtn", "fp16": True},
         "fair_cast='rtn': fp16=True autocasts the learner to float16, which would re-round a "
         "served_dtype='bfloat16' copy."),
        ({"fair_cast": "stochastic", "fsdp": "full_shard"},
         "fair_cast is not supported with FSDP1 (asked for by args.fsdp): the trainer does not yet export"),
        ({"mxfp8": "yes"}, "mxfp8 must be True or False, got 'yes'."),
        ({"mxfp8_exclude": [1]}, "mxfp8_exclude must be a list of regular expressions, got [1]."),
        ({"mxfp8_exclude": 3}, "mxfp8_exclude must be a list of regular expressions, got 3."),
        ({"mxfp8": True, "use_transformers_continuous_batching": True},
         "mxfp8=True cannot be combined with use_transformers_continuous_batching=True: TRL"),
        ({"mxfp8": True, "fp16": True}, "mxfp8=True computes its GEMMs from bf16/fp32 inputs; use bf16=True or fp32"),
        ({"sync_checks": 3}, "sync_checks must be 'default', 'all', 'off' or a list of check names, got 3."),
        ({"sync_checks": {"coverage"}},
         "sync_checks must be 'default', 'all', 'off' or a list of check names, got {'coverage'}."),
    ],
    ids=[
        "duet_not_bool", "duet_with_continuous_batching", "duet_with_beam_search", "duet_markers_empty_string",
        "duet_markers_non_string", "fair_cast_fp16_with_bf16_served", "fair_cast_with_fsdp", "mxfp8_not_bool",
        "mxfp8_exclude_non_string_item", "mxfp8_exclude_not_a_list", "mxfp8_with_continuous_batching",
        "mxfp8_with_fp16", "sync_checks_not_str_or_list", "sync_checks_a_set",
    ],
)
def test_config_refuses_invalid_field_or_combination(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _config(tmp_path, **overrides)


def test_fair_cast_fp16_with_float16_served_is_accepted(tmp_path):
    """The counterpart of the fp16 refusal: fp16=True is fine when the served copy is float16."""
    config = _config(tmp_path, fair_cast="rtn", fp16=True, served_dtype="float16")
    assert (config.fp16, config.served_dtype) == (True, "float16")


# -- GRPOTrainer construction: set-ups refused when the capabilities are set up ------------------------------------
def test_duet_refuses_a_rollout_func(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # TRL's notice that rollout_func is experimental
    with pytest.raises(ValueError, match=re.escape("duet=True does not support tools, rollout_func or environments")):
        _trainer(tmp_path, tiny_model_dir, duet=True, trainer_kwargs={"rollout_func": lambda prompts, trainer: {}})


def test_merged_fair_cast_refuses_a_lora_model_with_a_bf16_base(tmp_path, tiny_model_dir):
    from peft import LoraConfig

    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], task_type="CAUSAL_LM")
    with pytest.raises(TypeError, match=re.escape(
            "Fair Cast needs an fp32 or bitsandbytes 4-bit base weight in LoRA layer "
            "'model.layers.0.self_attn.q_proj.weight', got torch.bfloat16")):
        _trainer(tmp_path, _load(tiny_model_dir, torch.bfloat16), peft_config=lora, fair_cast="rtn",
                 lora_serving="merged")


def test_fair_cast_refuses_a_merged_lora_model(tmp_path, tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_load(tiny_model_dir),
                           LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    model.merge_adapter()
    with pytest.raises(ValueError, match=re.escape(
            "LoRA layer 'model.layers.0.self_attn.q_proj.weight' is merged; Fair Cast needs unmerged adapters.")):
        _trainer(tmp_path, model, fair_cast="rtn", lora_serving="merged")


def test_fair_cast_refuses_learner_and_served_names_that_do_not_match(tmp_path, tiny_model_dir):
    """PEFT trainable tokens live in their own parameters, which merge_and_unload folds into the embedding: the
    learner's units and the served twin's parameters then differ, and Fair Cast says which."""
    from peft import LoraConfig

    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], task_type="CAUSAL_LM",
                      trainable_token_indices={"embed_tokens": [5, 6]})
    with pytest.raises(ValueError, match=re.escape(
            "Fair Cast could not match the learner's parameters to the served model's: only in the learner "
            "['model.embed_tokens.token_adapter.trainable_tokens_delta.default'")) as info:
        _trainer(tmp_path, tiny_model_dir, peft_config=lora, fair_cast="rtn", lora_serving="merged")
    assert "only served ['model.embed_tokens.weight']" in str(info.value)


# -- DUET capability: refusals of its set-up and generation hooks --------------------------------------------------
def test_duet_generate_refuses_image_prompts():
    with pytest.raises(ValueError, match=re.escape("duet=True supports text prompts only.")):
        Duet().generate(None, [[1, 2]] * 2, images=[["image"]] * 2, multimodal_fields=None, num_generations=2)


def test_duet_generate_refuses_a_partial_group():
    with pytest.raises(ValueError, match=re.escape("DUET expects whole groups of 4 slots, got 6 prompts.")):
        Duet().generate(None, [[1, 2]] * 6, images=None, multimodal_fields=None, num_generations=4)


def test_prompt_stats_refuses_zero_capacity():
    with pytest.raises(ValueError, match=re.escape("capacity must be >= 1, got 0")):
        PromptStats(capacity=0)


# -- Fair Cast cores -----------------------------------------------------------------------------------------------
def test_error_feedback_refuses_a_non_fp32_master():
    with pytest.raises(TypeError, match=re.escape("ErrorFeedback expects an fp32 master tensor, got torch.bfloat16")):
        ErrorFeedback(torch.zeros(4, dtype=torch.bfloat16))


def test_error_feedback_refuses_a_served_dtype_other_than_bf16_or_fp16():
    with pytest.raises(ValueError, match=re.escape(
            "ErrorFeedback: dtype must be torch.bfloat16 or torch.float16, got torch.float32")):
        ErrorFeedback(torch.zeros(4), dtype=torch.float32)


@pytest.mark.parametrize("src_dtype, residual_dtype", [(torch.float16, torch.float32), (torch.float32, torch.bfloat16)],
                         ids=["src_fp16", "residual_bf16"])
def test_error_feedback_round_refuses_non_fp32_src_or_residual(src_dtype, residual_dtype):
    with pytest.raises(TypeError, match=re.escape("error_feedback_round expects fp32 src and residual")):
        error_feedback_round(torch.zeros(4, dtype=src_dtype), torch.zeros(4, dtype=residual_dtype))


def test_served_copy_refuses_a_checkpoint_missing_a_tensor():
    lin = torch.nn.Linear(32, 32)
    state = ServedCopy.from_named_params([("weight", lin.weight)], "rtn").state_dict()
    both = ServedCopy.from_named_params(list(lin.named_parameters()), "rtn")
    with pytest.raises(ValueError, match=re.escape("Fair Cast checkpoint lacks the state of: bias")):
        both.load_state_dict(state)


# -- MXFP8 and numerics cores --------------------------------------------------------------------------------------
def test_mx_recipe_refuses_an_unresolved_kernel():
    with pytest.raises(ValueError, match=re.escape("MXFP8 kernel 'auto' is not valid; allowed: 'emulated', 'sm100'")):
        MXRecipe(kernel="auto")


@pytest.mark.parametrize("name", ["bfloat17", "Tensor"], ids=["unknown_name", "torch_attribute_not_a_dtype"])
def test_torch_dtype_refuses_a_name_that_is_not_a_dtype(name):
    with pytest.raises(ValueError, match=re.escape(f"{name!r} is not a torch dtype name")):
        torch_dtype(name)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"format": "nvfp4"}, "TensorSpec.format='nvfp4' is not valid; allowed: dense, mxfp8, engine."),
        ({"cast": "sr"}, "TensorSpec.cast='sr' is not valid; allowed: none, rtn."),
        ({"format": "mxfp8"}, "an MXFP8 TensorSpec needs scale_rounding in ('rceil', 'floor'), got None."),
        ({"format": "mxfp8", "scale_rounding": "even"},
         "an MXFP8 TensorSpec needs scale_rounding in ('rceil', 'floor'), got 'even'."),
    ],
    ids=["unknown_format", "unknown_cast", "mxfp8_without_scale_rounding", "mxfp8_unknown_scale_rounding"],
)
def test_tensor_spec_refuses_invalid_fields(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TensorSpec(dtype="bfloat16", **kwargs)


def test_mx_fake_quantize_refuses_an_unknown_scale_rounding():
    with pytest.raises(ValueError, match=re.escape("MXFP8 scale rounding 'even' is not valid; allowed: rceil, floor.")):
        mx_fake_quantize(torch.zeros(32), rounding="even")


# -- weight-sync checks: the sampler-side logprob tap --------------------------------------------------------------
def test_logprob_tap_refuses_a_completion_longer_than_the_recorded_steps():
    tap = SampledLogprobTap(temperature=1.0)
    tap(torch.tensor([[1]]), torch.zeros(1, 8))  # one decoding step recorded
    with pytest.raises(ValueError, match=re.escape(
            "the recorded logprobs are shorter than a completion: generate() did not run the tap")):
        tap.per_row([[1, 2, 3]])


def test_an_engine_quantized_spec_is_valid_but_has_no_reference_quantizer():
    spec = numerics.TensorSpec(dtype="bfloat16", format="engine", kernel="Fp8LinearMethod")
    with pytest.raises(ValueError, match=re.escape("no reference quantizer for an engine-quantized tensor "
                                                   "(method 'Fp8LinearMethod')")):
        numerics.quantize(torch.zeros(2, 2), spec)

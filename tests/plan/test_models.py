"""The plan's architecture numbers: the embedded table against transformers' own modelling (built on the meta device,
no weights), and resolving a model from a name, a config.json, a folder or a PretrainedConfig."""

import json

import pytest

from trl_fp8.plan.models import MODELS, Arch, arch_from_config, model_key, resolve_model


def _hf_model(arch: Arch):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    common = dict(hidden_size=arch.hidden, intermediate_size=arch.intermediate, num_hidden_layers=arch.layers,
                  num_attention_heads=arch.heads, num_key_value_heads=arch.kv_heads, head_dim=arch.head_dim,
                  vocab_size=arch.vocab, tie_word_embeddings=arch.tied)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(arch.model_type, **common))


@pytest.mark.parametrize("key", list(MODELS))
def test_embedded_configs_list_every_parameter_transformers_builds(key):
    arch = MODELS[key]
    model = _hf_model(arch)
    built = [(n, p.numel()) for n, p in model.named_parameters()]
    assert [(t.name, t.numel) for t in arch.tensors()] == built
    buffers = {b.untyped_storage()._cdata: b.numel() * b.element_size() for b in model.buffers()}
    assert sum(buffers.values()) == arch.buffer_bytes()


def test_public_parameter_counts():
    # the model cards' sizes: Qwen2.5-7B 7.61 B, Llama-3.1-8B 8.03 B, SmolLM2-135M 134.5 M (tied), Qwen2.5-0.5B 494 M
    assert MODELS["qwen2.5-7b"].params == 7_615_616_512
    assert MODELS["llama-3.1-8b"].params == 8_030_261_248
    assert MODELS["smollm2-135m"].params == 134_515_008
    assert MODELS["qwen2.5-0.5b"].params == 494_032_768
    # Qwen3-8B 8.2 B (6.95 B without embeddings), Phi-3-mini 3.8 B, Gemma-2-2B 2.6 B, Gemma-3-1B 1.0 B
    assert round(MODELS["qwen3-8b"].params / 1e9, 2) == 8.19
    assert round((MODELS["qwen3-8b"].params - 2 * 151936 * 4096) / 1e9, 2) == 6.95
    assert round(MODELS["phi-3-mini-4k"].params / 1e9, 2) == 3.82
    assert round(MODELS["gemma-2-2b"].params / 1e9, 2) == 2.61
    assert round(MODELS["gemma-3-1b"].params / 1e9, 2) == 1.0


def test_names_configs_and_folders(tmp_path):
    assert model_key("Qwen/Qwen2.5-7B-Instruct") == "qwen2.5-7b"
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") is MODELS["smollm2-135m"]
    config = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 128,
              "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    by_folder, by_file = resolve_model(tmp_path), resolve_model(str(tmp_path / "config.json"))
    assert by_folder == by_file
    assert (by_folder.hidden, by_folder.kv_heads, by_folder.head_dim, by_folder.tied, by_folder.qkv_bias) == \
        (64, 1, 32, False, True)


def test_a_pretrained_config_and_llama_defaults():
    from transformers import LlamaConfig

    arch = resolve_model(LlamaConfig(hidden_size=96, intermediate_size=256, num_hidden_layers=3,
                                     num_attention_heads=6, vocab_size=800))
    assert (arch.kv_heads, arch.head_dim, arch.qkv_bias) == (6, 16, False)
    assert arch.params == _count(_hf_model(arch))


def _count(model):
    return sum(p.numel() for p in model.parameters())


def test_unknown_model_names_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match=r"unknown model 'qwen9'.*qwen2\.5-7b.*llama-3\.1-8b"):
        resolve_model("qwen9")
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model(tmp_path)
    with pytest.raises(ValueError, match="lacks hidden_size"):
        arch_from_config({"model_type": "llama"})


_DENSE = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              vocab_size=100)


@pytest.mark.parametrize("config, said", [
    ({"text_config": {"text_config": dict(_DENSE)}}, "text_config holds another text_config"),
    ({"text_config": "llama"}, "text_config must be a JSON object"),
    (dict(_DENSE, num_hidden_layers=10_000), "num_hidden_layers must be an integer from 1 to 1024"),
    ({k: v for k, v in _DENSE.items() if k != "model_type"}, "lacks model_type"),
], ids=["nested_text_config", "text_config_not_an_object", "layers_typo", "no_model_type"])
def test_a_malformed_config_is_refused_by_name_at_once(config, said):
    """A text_config inside a text_config was followed down (a config whose text_config is itself: a RecursionError),
    10,000 layers hung the planner, a config without model_type was planned as llama: each is now one ValueError
    naming the field."""
    with pytest.raises(ValueError, match=said):
        arch_from_config(config)
    assert arch_from_config({"text_config": dict(_DENSE)}).layers == 2  # one level of text_config still plans


_SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=100)


@pytest.mark.parametrize("model_type", ["qwen3", "phi3", "gemma", "gemma2", "gemma3_text", "mistral"])
@pytest.mark.parametrize("tied", [True, False])
def test_a_config_json_of_each_known_type_lists_what_transformers_builds(model_type, tied):
    """A config.json as the Hub has it (no head_dim: each type's own default — Gemma 256, Qwen3 128, Phi-3 hidden /
    heads — and its other defaults): the plan's tensors, in order, and buffers are what transformers builds."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(_SMALL, model_type=model_type, tie_word_embeddings=tied, pad_token_id=0)
    arch = arch_from_config(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    assert [(t.name, t.numel) for t in arch.tensors()] == [(n, p.numel()) for n, p in model.named_parameters()]
    buffers = {b.untyped_storage()._cdata: b.numel() * b.element_size() for b in model.buffers()}
    assert sum(buffers.values()) == arch.buffer_bytes()


def test_phi3_lora_targets_are_its_fused_linears_and_unfused_names_reach_what_peft_reaches():
    from trl_fp8.plan.plan import make_spec

    phi3 = arch_from_config(dict(_SMALL, model_type="phi3"))
    assert phi3.projections == ("o_proj", "qkv_proj", "gate_up_proj", "down_proj")
    assert make_spec(phi3, peft=8, device="t4").lora.targets == phi3.projections  # all-linear
    # PEFT matches module names: q_proj/v_proj are not Phi-3 modules, o_proj is
    assert make_spec(phi3, peft={"r": 8, "target_modules": ["q_proj", "o_proj"]}, device="t4").lora.targets == \
        ("o_proj",)
    with pytest.raises(ValueError, match=r"q_proj, v_proj: none is a module of this phi3 model; its block linears "
                                         r"are o_proj, qkv_proj, gate_up_proj, down_proj"):
        make_spec(phi3, peft={"r": 8, "target_modules": ["q_proj", "v_proj"]}, device="t4")


def test_a_partial_rotary_config_is_refused_by_name():
    with pytest.raises(ValueError, match="partial_rotary_factor=0.75"):
        arch_from_config(dict(_SMALL, model_type="phi3", partial_rotary_factor=0.75))

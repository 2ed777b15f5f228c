"""The plan's activation rows against the tensors a real forward saves for backward, on CPU.

``saved_tensor_bytes`` sums the distinct storages autograd saves (``saved_tensors_hooks``) during one loss forward
through TRL 1.16's fused LM head, as the trainer runs it (autocast bf16, padding mask, completion-only labels). These
are *saved tensors*, not a peak: temporaries freed within the forward are not in them, and the transient rows of the
plan (one block recomputed, logits tiles, autocast's weight cache) are not compared here. Off CUDA TRL's head scores
every position (``compact_head=False``); on CUDA only the completion positions — the only difference in what is saved.

Tolerance: none. Both sides count the same storages of a deterministic graph (dtype and shape of each saved tensor
follow from the config and the settings), so the arithmetic must equal the count; a change in what torch, transformers,
PEFT or TRL save is meant to fail here, with the part that moved.
"""

import pytest
import torch

from trl_fp8.plan.activations import Shape, saved_bytes
from trl_fp8.plan.held import saved_tensor_bytes
from trl_fp8.plan.models import arch_from_config

TINY = dict(model_type="qwen2", vocab_size=1000, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)
# SmolLM2-135M's block and vocabulary (config.json numbers), two blocks deep
SMOLLM2_2L = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                  num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True)


def _split(mode: str) -> tuple[str, bool, bool]:
    """``mode`` -> (base mode, LoRA dropout 0.05, fp16 autocast over an fp16 base): ``qlora_bf16+dropout+fp16``."""
    base, *flags = mode.split("+")
    return base, "dropout" in flags, "fp16" in flags


def _model(config: dict, mode: str, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    mode, dropout, fp16 = _split(mode)
    half = torch.float16 if fp16 else torch.bfloat16
    cfg = AutoConfig.for_model(**config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    if mode.startswith("qlora"):
        from transformers import BitsAndBytesConfig

        from trl_fp8 import fourbit

        model.save_pretrained(tmp_path)
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=half)
        model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=q, dtype=half)
        fourbit.guard_cpu_repack(model)
    elif mode == "lora16":
        model = model.to(half)
    if mode != "full":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.05 if dropout else 0))
        if mode.startswith("qlora"):  # TRL keeps QLoRA factors in bf16 (under fp16 autocast too); Fair Cast's
            dtype = torch.bfloat16 if mode == "qlora_bf16" else torch.float32  # adapter serving in fp32
            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.to(dtype)
    return model


def _shape(config, mode, rows, seq, completion):
    mode, dropout, fp16 = _split(mode)
    residual = 4 if mode in ("full", "lora32") else 2
    arch = arch_from_config(config)
    return Shape(arch, rows, seq, rows * completion, residual_bytes=residual, compute_bytes=2,
                 full=mode == "full", lora_r=0 if mode == "full" else 8,
                 lora_targets=() if mode == "full" else arch.projections,
                 adapter_bytes=2 if mode == "qlora_bf16" else 4,
                 base_weight_bytes=0.5 if mode.startswith("qlora") else residual, compact_head=False,
                 lora_dropout=dropout, adapter_is_compute=not (fp16 and mode == "qlora_bf16"))


def _measure(model, config, checkpointing, rows, prompt, completion, mode="full"):
    from trl.trainer.utils import add_fused_lm_head

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    add_fused_lm_head(base, outputs=("log_probs", "entropy"))
    model.train()
    if checkpointing:  # as TRL enables it (non-reentrant; PEFT: input gradients on)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()
    seq = prompt + completion
    ids = torch.randint(0, config["vocab_size"], (rows, seq), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(rows, seq, dtype=torch.long)
    mask[0, :5] = 0  # a left-padded prompt
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-completion] = -100
    half = torch.float16 if _split(mode)[2] else torch.bfloat16
    with saved_tensor_bytes(exclude=list(model.parameters())) as saved, torch.autocast("cpu", dtype=half):
        model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    return saved["bytes"]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no_checkpointing", "checkpointing"])
@pytest.mark.parametrize("mode", ["full", "lora32", "lora16", "qlora_bf16", "qlora_fp32", "lora32+dropout",
                                  "qlora_bf16+dropout", "qlora_bf16+fp16", "qlora_bf16+dropout+fp16"])
def test_tiny_qwen2_saved_tensors_equal_the_plan(tmp_path, mode, checkpointing):
    """``+dropout``: PEFT's lora_dropout 0.05 (TRL's CLI default); ``+fp16``: an fp16 base under fp16 autocast with
    TRL's bf16 QLoRA factors (a T4), where the factors are 16-bit but not the compute dtype."""
    model = _model(TINY, mode, tmp_path)
    measured = _measure(model, TINY, checkpointing, rows=4, prompt=24, completion=40, mode=mode)
    predicted = saved_bytes(_shape(TINY, mode, 4, 64, 40), checkpointing)
    assert measured == sum(predicted.values()), predicted


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no_checkpointing", "checkpointing"])
@pytest.mark.parametrize("mode", ["full", "qlora_fp32"])
def test_smollm2_block_saved_tensors_equal_the_plan(tmp_path, mode, checkpointing):
    model = _model(SMOLLM2_2L, mode, tmp_path)
    measured = _measure(model, SMOLLM2_2L, checkpointing, rows=2, prompt=16, completion=32)
    predicted = saved_bytes(_shape(SMOLLM2_2L, mode, 2, 48, 32), checkpointing)
    assert measured == sum(predicted.values()), predicted
    if not checkpointing:  # checkpointing keeps a small fraction of it: the blocks' inputs only
        assert sum(saved_bytes(_shape(SMOLLM2_2L, mode, 2, 48, 32), True).values()) < measured / 3


# Each further dense type the plan knows, as small as the tiny Qwen2 (its own defaults: no head_dim for Phi-3)
_TYPES = {
    "qwen3": dict(TINY, model_type="qwen3"),
    "phi3": {k: v for k, v in dict(TINY, model_type="phi3", pad_token_id=0).items() if k != "head_dim"},
    "gemma2": dict(TINY, model_type="gemma2"),
    "gemma3_text": dict(TINY, model_type="gemma3_text"),
}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no_checkpointing", "checkpointing"])
@pytest.mark.parametrize("mode", ["full", "lora32", "lora16", "qlora_bf16"])
@pytest.mark.parametrize("model_type", list(_TYPES))
def test_each_known_type_saves_what_the_plan_counts(tmp_path, model_type, mode, checkpointing):
    config = _TYPES[model_type]
    model = _model(config, mode, tmp_path)
    measured = _measure(model, config, checkpointing, rows=4, prompt=24, completion=40)
    predicted = saved_bytes(_shape(config, mode, 4, 64, 40), checkpointing)
    assert measured == sum(predicted.values()), (measured - sum(predicted.values()), predicted)

"""Fabricate, in HF_HOME/hub, the Hub repositories TRL's GRPO tests load: tiny Qwen2 causal-LM and reward models
(``trl-internal-testing/tiny-Qwen2ForCausalLM-2.5``, ``...ForSequenceClassification-2.5``) with a small byte-level BPE
tokenizer trained here (not Qwen's) and a chat template, and the ``trl-internal-testing/zen`` prompt-only dataset
(standard and conversational). Weights are random and stored in bf16, as the real tiny repositories are."""

import hashlib
import os
import sys

import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM,
                          Qwen2ForSequenceClassification)

HF_HOME = sys.argv[1]
HUB = os.path.join(HF_HOME, "hub")
ZEN = [
    "Beautiful is better than", "Explicit is", "Simple is better", "Complex", "Flat is better than",
    "Sparse is better", "Readability", "Special cases aren't special", "Although practicality beats",
    "Errors should never", "Unless explicitly", "In the face of ambiguity, refuse",
    "There should be one-- and preferably", "Although that way may not be obvious at first unless you're", "Now is",
    "Although never is often", "If the implementation is hard to explain,", "If the implementation is easy",
    "Namespaces are one honking great",
]


def snapshot(kind: str, repo: str) -> str:
    """A snapshot folder for ``repo`` laid out as huggingface_hub's cache lays it out (refs/main -> a revision)."""
    revision = hashlib.sha1(repo.encode()).hexdigest()
    folder = os.path.join(HUB, f"{kind}s--" + repo.replace("/", "--"))
    os.makedirs(os.path.join(folder, "refs"), exist_ok=True)
    with open(os.path.join(folder, "refs", "main"), "w") as f:
        f.write(revision)
    path = os.path.join(folder, "snapshots", revision)
    os.makedirs(path, exist_ok=True)
    return path


def tokenizer() -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(ZEN * 20, trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  padding_side="left")
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] if m['content'] is string else m['content'][0]['text'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tok


def main() -> None:
    tok = tokenizer()
    torch.manual_seed(0)
    shared = dict(vocab_size=len(tok), num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                  intermediate_size=32, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  bos_token_id=None, max_position_embeddings=512)
    for repo, cls, extra in (
            ("trl-internal-testing/tiny-Qwen2ForCausalLM-2.5", Qwen2ForCausalLM, dict(hidden_size=8)),
            ("trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5", Qwen2ForSequenceClassification,
             dict(hidden_size=16, num_labels=1))):
        config = Qwen2Config(**shared, **extra)
        config.architectures = [cls.__name__]
        path = snapshot("model", repo)
        cls(config).to(torch.bfloat16).save_pretrained(path)
        tok.save_pretrained(path)
        if cls is Qwen2ForCausalLM:
            GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
                             do_sample=True).save_pretrained(path)
    path = snapshot("dataset", "trl-internal-testing/zen")
    configs = []
    for name, data in (("standard_prompt_only", {"prompt": ZEN}),
                       ("conversational_prompt_only", {"prompt": [[{"role": "user", "content": p}] for p in ZEN]})):
        ds = Dataset.from_dict(data)
        os.makedirs(os.path.join(path, name), exist_ok=True)
        ds.select(range(len(ds) - 2)).to_parquet(os.path.join(path, name, "train-00000-of-00001.parquet"))
        ds.select(range(len(ds) - 2, len(ds))).to_parquet(os.path.join(path, name, "test-00000-of-00001.parquet"))
        configs.append(f"- config_name: {name}\n  data_files:\n  - split: train\n    path: {name}/train-*\n"
                       f"  - split: test\n    path: {name}/test-*")
    with open(os.path.join(path, "README.md"), "w") as f:
        f.write("---\nconfigs:\n" + "\n".join(configs) + "\n---\n")
    open(os.path.join(HF_HOME, ".trl_fp8_hub_built"), "w").close()


if __name__ == "__main__":
    main()

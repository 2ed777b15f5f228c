import json

import pytest
import torch

from trl_fp8.app.demo import model as demo_model
from trl_fp8.app.demo.model import WarmupSettings, demo_model_path, train_demo_model


def test_shipped_model_loads_with_from_pretrained():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = demo_model_path()
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    cfg = model.config
    assert cfg.model_type == "qwen2"
    assert cfg.head_dim >= 32  # a vLLM CPU engine rejects smaller heads
    assert cfg.hidden_size // cfg.num_attention_heads == cfg.head_dim
    assert len(tokenizer) <= cfg.vocab_size
    enc = tokenizer(["12+34="], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=12, pad_token_id=tokenizer.pad_token_id)
    assert tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True) == "\\boxed{46}"


def test_shipped_model_sometimes_succeeds():
    """GRPO must start from a policy that sometimes, not always, solves the task when sampling."""
    summary = json.loads((demo_model.DEMO_MODEL_DIR / "warmup.json").read_text())
    assert 0.1 < summary["sampled_accuracy_t1"] < 0.7
    assert summary["greedy_accuracy"] > summary["sampled_accuracy_t1"]


def test_missing_model_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(demo_model, "DEMO_MODEL_DIR", tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="train_demo_model.py"):
        demo_model_path()


def test_train_demo_model_writes_a_complete_folder_and_replaces_atomically(tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "model"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    summary = train_demo_model(out, WarmupSettings(steps=3, batch_size=8), log=None)
    assert {"final_loss", "sampled_accuracy_t1", "greedy_accuracy", "num_parameters"} <= set(summary)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "warmup.json"} <= names
    assert "stale.txt" not in names
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temp or backup folders left
    AutoModelForCausalLM.from_pretrained(out)


def test_failed_save_leaves_the_old_model_untouched(tmp_path, monkeypatch):
    from transformers import PreTrainedTokenizerFast

    out = tmp_path / "model"
    out.mkdir()
    (out / "keep.txt").write_text("old")

    def broken_save(self, *a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", broken_save)
    with pytest.raises(OSError, match="disk full"):
        train_demo_model(out, WarmupSettings(steps=1, batch_size=4), log=None)
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert [p.name for p in out.iterdir()] == ["keep.txt"]

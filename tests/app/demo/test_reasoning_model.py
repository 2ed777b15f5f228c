import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trl_fp8.app.demo import reasoning_model as rm
from trl_fp8.app.demo.reasoning_model import (
    ReasoningWarmupSettings,
    evaluate_reasoning,
    held_out_problems,
    reasoning_model_path,
    train_reasoning_model,
)
from trl_fp8.tokenization import build_char_tokenizer

REPO = Path(__file__).resolve().parents[3]


def test_shipped_model_loads_and_covers_the_tokenizer():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = reasoning_model_path()
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    cfg = model.config
    assert cfg.model_type == "qwen2"
    assert cfg.head_dim >= 32  # a vLLM CPU engine rejects smaller heads
    assert cfg.hidden_size // cfg.num_attention_heads == cfg.head_dim
    assert len(tokenizer) <= cfg.vocab_size and len(build_char_tokenizer()) <= cfg.vocab_size
    assert cfg.tie_word_embeddings
    # a prompt of the longest chains plus the completion cap fits the positions
    assert 2 * rm.MAX_TERMS + rm.MAX_COMPLETION_LENGTH <= cfg.max_position_embeddings
    enc = tokenizer(["3+5="], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=48, pad_token_id=tokenizer.pad_token_id)
    assert tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True) == \
        "3+5=8. So the answer is \\boxed{8}"


def test_shipped_model_warmup_summary():
    """Greedy mostly right, sampling only sometimes (better on short chains), and some samples run off."""
    summary = json.loads((rm.REASONING_MODEL_DIR / "warmup.json").read_text())
    sampled, greedy = summary["sampled_t1"], summary["greedy"]
    assert 0.15 < summary["sampled_accuracy_t1"] < 0.6
    assert summary["greedy_accuracy"] > summary["sampled_accuracy_t1"]
    by = sampled["accuracy_by_difficulty"]
    assert by["easy"] > by["hard"]
    assert 0 < sampled["capped_without_marker_frac"] < 0.2
    assert sampled["length_by_difficulty"]["hard"]["p50"] > 2 * sampled["length_by_difficulty"]["easy"]["p50"]
    assert greedy["num_problems"] == sampled["num_problems"] == summary["settings"]["eval_problems"]
    assert summary["num_parameters"] > 0 and summary["train_seconds"] > 0


def test_missing_model_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(rm, "REASONING_MODEL_DIR", tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="train_reasoning_model.py"):
        reasoning_model_path()


def test_held_out_problems_spread_over_the_terms():
    problems = held_out_problems(26, seed=1)
    assert [n for _, _, n in problems] == list(range(2, 15)) * 2
    assert held_out_problems(26, seed=1) == problems


@pytest.mark.parametrize("field, value", [("steps", 0), ("batch_size", 1.5), ("lr", 0.0), ("label_smoothing", 1.0),
                                          ("max_terms", 1), ("eval_problems", 0)])
def test_settings_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        ReasoningWarmupSettings(**{field: value}).validate()


def test_evaluation_reports_lengths_and_capped_rollouts():
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(rm.build_reasoning_config())  # untrained: rambles
    stats = evaluate_reasoning(model, build_char_tokenizer(), num_problems=6, max_new_tokens=12)
    assert stats["num_problems"] == 6 and stats["max_new_tokens"] == 12
    assert set(stats["accuracy_by_terms"]) == {str(n) for n in range(2, 8)}
    assert 0 <= stats["length"]["p10"] <= stats["length"]["p50"] <= stats["length"]["p90"] <= 12
    assert 0.0 <= stats["capped_without_marker_frac"] <= 1.0


def test_warmup_script_smoke(tmp_path):
    """examples/train_reasoning_model.py, a few steps, into a temporary folder."""
    out = tmp_path / "model"
    cmd = [sys.executable, str(REPO / "examples" / "train_reasoning_model.py"), "--steps", "2", "--batch-size", "4",
           "--eval-problems", "3", "--output-dir", str(out)]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "saved to" in proc.stdout
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "warmup.json"} <= names
    summary = json.loads((out / "warmup.json").read_text())
    assert summary["settings"]["steps"] == 2 and summary["sampled_t1"]["num_problems"] == 3
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # written atomically: no temp folder left


def test_train_reasoning_model_in_process(tmp_path):
    summary = train_reasoning_model(tmp_path / "m", ReasoningWarmupSettings(steps=1, batch_size=2, eval_problems=2),
                                    log=None)
    assert {"final_loss", "sampled_accuracy_t1", "greedy_accuracy", "length", "accuracy_by_terms"} <= \
        set(summary) | set(summary["sampled_t1"])

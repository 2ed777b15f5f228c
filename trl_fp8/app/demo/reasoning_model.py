"""The embedded reasoning model: a small Qwen2 warmed up on the chained-arithmetic task, shipped in the package.

``python examples/train_reasoning_model.py`` (or :func:`train_reasoning_model`) rebuilds it from scratch with the
same character-level tokenizer and warm-up loop as the arithmetic demo model (:func:`trl_fp8.app.demo.model.warm_up`):
a 4-layer Qwen2 (hidden 128, 4 heads of 32, 2 KV heads, tied embeddings) trained on
:mod:`trl_fp8.app.tasks.reasoning` target completions. The warm-up is stopped early and label-smoothed: greedy decoding
is mostly right, but a sample at temperature 1 writes ~30-120 characters of steps and slips somewhere on most long
chains -- and sometimes loses the thread and runs to the length cap without an answer, which is what DUET's
marker-gated abort is for.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..tasks.reasoning import (
    DIFFICULTIES,
    MAX_TERMS,
    MIN_TERMS,
    correctness_reward,
    difficulty_of,
    extract_boxed,
    make_problem,
    target_completion,
)
from ...models import embedded_model_path
from .model import char_qwen2_config, generate_completions, save_model_folder, warm_up

REASONING_MODEL_DIR = Path(__file__).resolve().parents[2] / "assets" / "reasoning_model"
# Completion cap of the task: the longest target (14 terms) is ~155 characters; off-track rollouts run to the cap,
# and DUET aborts a marker-less rollout at K2 + duet_abort_grace (K2: 80th percentile of kept lengths, ~110 here;
# the grace defaults to ~16 tokens at this cap).
MAX_COMPLETION_LENGTH = 320


def reasoning_model_path() -> str:
    """Folder of the shipped reasoning model, for ``from_pretrained``."""
    return embedded_model_path(REASONING_MODEL_DIR, "reasoning model", "examples/train_reasoning_model.py")


def build_reasoning_config(vocab_size: int = 128):
    """Qwen2, 4 layers, hidden 128, 4 heads of 32, 2 KV heads, tied embeddings, 512 positions."""
    return char_qwen2_config(vocab_size, hidden=128, intermediate=384, layers=4, heads=4, kv_heads=2, positions=512)


@dataclass
class ReasoningWarmupSettings:
    # Stopped early: ~14 minutes on one CPU thread. Greedy decoding is then mostly right; sampling slips on long chains.
    steps: int = 680
    batch_size: int = 64
    lr: float = 3e-3
    # Over ~100 completion tokens a per-token slip probability of ~ε compounds: ε=0.01 keeps the sampled policy
    # diffuse enough that long chains mostly fail at temperature 1.
    label_smoothing: float = 0.01
    seed: int = 0
    max_terms: int = MAX_TERMS
    eval_problems: int = 390  # held-out problems, spread evenly over 2..max_terms terms

    def validate(self) -> None:
        for name in ("steps", "batch_size", "eval_problems"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing!r}")
        if not isinstance(self.max_terms, int) or not MIN_TERMS <= self.max_terms <= 30:
            raise ValueError(f"max_terms must be an integer in [{MIN_TERMS}, 30], got {self.max_terms!r}")


def held_out_problems(num_problems: int, seed: int = 1234, max_terms: int = MAX_TERMS) -> list[tuple[str, str, int]]:
    """``num_problems`` chains spread evenly over 2..``max_terms`` terms (problem i has 2 + i mod span terms)."""
    rng = random.Random(seed)
    span = max_terms - MIN_TERMS + 1
    return [make_problem(rng, max_terms, num_terms=MIN_TERMS + i % span) for i in range(num_problems)]


def _quantile(sorted_values: list[int], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return float(sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))])


def _length_stats(lengths: list[int]) -> dict:
    s = sorted(lengths)
    return {"mean": sum(s) / len(s) if s else float("nan"), "p10": _quantile(s, 0.1), "p50": _quantile(s, 0.5),
            "p90": _quantile(s, 0.9)}


def evaluate_reasoning(model, tokenizer, num_problems: int = 390, seed: int = 1234, temperature: float | None = 1.0,
                       max_new_tokens: int = MAX_COMPLETION_LENGTH, max_terms: int = MAX_TERMS,
                       batch_size: int = 130) -> dict:
    """One completion per held-out problem: accuracy overall, by number of terms and by difficulty; completion
    lengths (tokens = characters, eos excluded) overall and by difficulty; the fraction that ran to
    ``max_new_tokens`` without a ``\\boxed{}`` answer."""
    problems = held_out_problems(num_problems, seed, max_terms)
    generations = []
    for start in range(0, len(problems), batch_size):
        chunk = problems[start:start + batch_size]
        generations += generate_completions(model, tokenizer, [p for p, _, _ in chunk], temperature, max_new_tokens,
                                            seed + start)
    rewards = correctness_reward([g.text for g in generations], [a for _, a, _ in problems])
    by_terms, by_difficulty, lengths_by_difficulty = {}, {}, {}
    for (_, _, n), g, r in zip(problems, generations, rewards):
        by_terms.setdefault(n, []).append(r)
        d = difficulty_of(n, max_terms)
        by_difficulty.setdefault(d, []).append(r)
        lengths_by_difficulty.setdefault(d, []).append(g.num_tokens)
    capped = [not g.finished and extract_boxed(g.text) is None for g in generations]
    return {
        "accuracy": sum(rewards) / len(rewards),
        "accuracy_by_terms": {str(n): sum(v) / len(v) for n, v in sorted(by_terms.items())},
        "accuracy_by_difficulty": {d: sum(v) / len(v) for d in DIFFICULTIES if (v := by_difficulty.get(d))},
        "length": _length_stats([g.num_tokens for g in generations]),
        "length_by_difficulty": {d: _length_stats(v) for d in DIFFICULTIES if (v := lengths_by_difficulty.get(d))},
        "capped_without_marker_frac": sum(capped) / len(capped),
        "num_problems": len(problems),
        "max_new_tokens": max_new_tokens,
    }


def reasoning_accuracy(model, tokenizer, num_problems: int = 256, seed: int = 1234,
                       temperature: float | None = 1.0) -> float:
    """Fraction of held-out chains solved by one completion at ``temperature`` (None: greedy decoding)."""
    return evaluate_reasoning(model, tokenizer, num_problems, seed, temperature)["accuracy"]


def train_reasoning_model(output_dir, settings: ReasoningWarmupSettings | None = None, log=print) -> dict:
    """Build the tokenizer and model, warm them up on the reasoning task, measure and save them (atomically).

    Returns the summary that is also written to ``warmup.json``: final loss, sampled (temperature 1) and greedy
    held-out evaluations (:func:`evaluate_reasoning`), parameter count and training time.
    """
    settings = settings or ReasoningWarmupSettings()
    settings.validate()
    config = build_reasoning_config()

    def sample_pair(rng):
        prompt, _, _ = make_problem(rng, settings.max_terms)
        return prompt, target_completion(prompt)

    start = time.perf_counter()
    model, tokenizer, loss_value = warm_up(config, sample_pair, settings.steps, settings.batch_size, settings.lr,
                                           settings.label_smoothing, settings.seed, log=log, log_every=50)
    train_seconds = time.perf_counter() - start
    sampled = evaluate_reasoning(model, tokenizer, settings.eval_problems, max_terms=settings.max_terms)
    greedy = evaluate_reasoning(model, tokenizer, settings.eval_problems, temperature=None,
                                max_terms=settings.max_terms)
    summary = {
        "final_loss": loss_value,
        "sampled_accuracy_t1": sampled["accuracy"],
        "greedy_accuracy": greedy["accuracy"],
        "sampled_t1": sampled,
        "greedy": greedy,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "train_seconds": train_seconds,
        "torch_threads": _threads(),
        "settings": asdict(settings),
    }
    if log:
        log(f"accuracy: sampled at temperature 1 {sampled['accuracy']:.3f} (by difficulty "
            f"{sampled['accuracy_by_difficulty']}), greedy {greedy['accuracy']:.3f}; sampled lengths "
            f"{sampled['length']}, capped without an answer {sampled['capped_without_marker_frac']:.3f}; "
            f"trained in {train_seconds:.0f} s")
    save_model_folder(output_dir, model, tokenizer, summary)
    return summary


def _threads() -> int:
    import torch

    return torch.get_num_threads()

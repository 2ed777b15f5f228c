"""A verifiable arithmetic task built in code: ``"37+45="`` -> ``"\\boxed{82}"``.

The dataset is a :class:`datasets.Dataset` with a ``prompt`` column (standard, non-conversational text) and
an ``answer`` column. The reward functions follow TRL's signature
``f(prompts, completions, completion_ids, **columns) -> list[float | None]``.
"""

from __future__ import annotations

import random
import re

BOXED_RE = re.compile(r"\\boxed\{([^{}]*)\}")
# The whole completion must be exactly one boxed integer (surrounding whitespace tolerated).
FORMAT_RE = re.compile(r"^\s*\\boxed\{-?\d+\}\s*$")


def make_problem(rng: random.Random, max_operand: int = 99) -> tuple[str, str]:
    """One addition problem: (prompt, answer)."""
    a = rng.randint(0, max_operand)
    b = rng.randint(0, max_operand)
    return f"{a}+{b}=", str(a + b)


def target_completion(answer: str) -> str:
    """The completion a perfect policy writes for ``answer`` (used for supervised warm-up)."""
    return f"\\boxed{{{answer}}}"


def make_arithmetic_dataset(num_samples: int = 2000, seed: int = 0, max_operand: int = 99):
    """A ``datasets.Dataset`` of addition problems with ``prompt`` and ``answer`` columns.

    ``max_operand`` bounds both operands (inclusive). Problems are drawn from a seeded generator, so
    the same ``seed`` gives the same dataset.
    """
    from datasets import Dataset

    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if max_operand < 1:
        raise ValueError(f"max_operand must be >= 1, got {max_operand}")
    rng = random.Random(seed)
    prompts, answers = [], []
    for _ in range(num_samples):
        prompt, answer = make_problem(rng, max_operand)
        prompts.append(prompt)
        answers.append(answer)
    return Dataset.from_dict({"prompt": prompts, "answer": answers})


def _completion_text(completion) -> str:
    # TRL passes strings for standard prompts and message lists for conversational ones.
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TypeError(f"unsupported completion type: {type(completion).__name__}")


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text``, stripped, or None."""
    found = BOXED_RE.findall(text)
    return found[-1].strip() if found else None


def correctness_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the last boxed value equals the reference answer, else 0.0."""
    rewards = []
    for completion, ref in zip(completions, answer, strict=True):
        got = extract_boxed(_completion_text(completion))
        rewards.append(1.0 if got is not None and got == str(ref).strip() else 0.0)
    return rewards


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 when the completion is exactly one ``\\boxed{<integer>}``, else 0.0."""
    return [1.0 if FORMAT_RE.match(_completion_text(c)) else 0.0 for c in completions]

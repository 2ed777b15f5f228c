"""A verifiable chat task for a pretrained instruct model (SmolLM2-135M-Instruct): small arithmetic asked in words,
answered in ``\\boxed{}``.

A prompt is a conversation (TRL's conversational format): a system message asking for a short solution with the
final answer boxed, and a user question such as ``"What is 7 + 5?"``. Levels set the operands:

- ``1``: two one-digit numbers (``a + b``),
- ``2``: a two-digit and a one-digit number (``a + b`` or ``a - b``, never negative),
- ``3``: two two-digit numbers (``a + b``).

The dataset has ``prompt``, ``answer`` and ``level`` columns; rewards follow TRL's signature:
:func:`correctness_reward` (1.0 when the last boxed value is the answer) and :func:`boxed_format_reward`
(0.2 for a completion that boxes an integer, so a model that rambles is pulled towards a verifiable answer).
"""

from __future__ import annotations

import random
import re

from .arithmetic import _completion_text, correctness_reward, extract_boxed  # noqa: F401 - the same answer check

SYSTEM_PROMPT = "Solve the problem. Put the final answer in \\boxed{}."
LEVELS = (1, 2, 3)
BOXED_INT_RE = re.compile(r"\\boxed\{\s*-?\d+\s*\}")
FORMAT_WEIGHT = 0.2


def make_problem(rng: random.Random, level: int) -> tuple[str, str]:
    """One question of ``level``: (question text, answer)."""
    if level == 1:
        a, b, op = rng.randint(1, 9), rng.randint(1, 9), "+"
    elif level == 2:
        a, b, op = rng.randint(10, 99), rng.randint(1, 9), rng.choice("+-")
    elif level == 3:
        a, b, op = rng.randint(10, 99), rng.randint(10, 99), "+"
    else:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    answer = a + b if op == "+" else a - b
    return f"What is {a} {op} {b}?", str(answer)


def make_chat_math_dataset(num_samples: int = 1000, seed: int = 0, levels=LEVELS, system_prompt: str | None =
                           SYSTEM_PROMPT):
    """A ``datasets.Dataset`` of conversational prompts (levels drawn uniformly from ``levels``), seeded."""
    from datasets import Dataset

    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    levels = tuple(levels)
    if not levels or any(level not in LEVELS for level in levels):
        raise ValueError(f"levels must be a non-empty subset of {LEVELS}, got {levels!r}")
    rng = random.Random(seed)
    prompts, answers, drawn = [], [], []
    for _ in range(num_samples):
        level = rng.choice(levels)
        question, answer = make_problem(rng, level)
        messages = [{"role": "user", "content": question}]
        if system_prompt:
            messages.insert(0, {"role": "system", "content": system_prompt})
        prompts.append(messages)
        answers.append(answer)
        drawn.append(level)
    return Dataset.from_dict({"prompt": prompts, "answer": answers, "level": drawn})


def boxed_format_reward(completions, **kwargs) -> list[float]:
    """:data:`FORMAT_WEIGHT` when the completion boxes an integer somewhere, else 0.0."""
    return [FORMAT_WEIGHT if BOXED_INT_RE.search(_completion_text(c)) else 0.0 for c in completions]

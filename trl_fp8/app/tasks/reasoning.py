"""A verifiable task whose completions need written multi-step reasoning: chained single-digit arithmetic.

A prompt is a chain of 2 to ``max_terms`` single-digit terms, e.g. ``"3+5-2+7+4="``; the completion writes the
running total one step at a time and ends with the answer in a box::

    3+5=8;8-2=6;6+7=13;13+4=17. So the answer is \\boxed{17}

With the character-level tokenizer a token is a character, so the target completion grows by about 7 tokens
per term: easy prompts (few terms) have short completions, hard ones long completions, and completion lengths
vary widely between prompts. The boxed answer -- DUET's ``"math"`` marker -- appears only at the very end: a
rollout that shows it has finished its reasoning.

The dataset is a :class:`datasets.Dataset` with ``prompt`` (standard text), ``answer``, ``num_terms`` and
``difficulty`` (``"easy"``, ``"medium"``, ``"hard"``) columns. The reward functions follow TRL's signature
``f(prompts, completions, completion_ids, **columns) -> list[float]``.
"""

from __future__ import annotations

import random
import re

from .arithmetic import _completion_text, correctness_reward, extract_boxed  # the same answer check

MIN_TERMS = 2
MAX_TERMS = 14  # default upper bound: the longest target completion is then ~120 characters
ANSWER_PREFIX = ". So the answer is "
# Steps "a+b=c;" (a, c any integer, b one digit), the last without ";", then the boxed answer, nothing after.
_STEP = r"-?\d+[+-]\d=-?\d+"
FORMAT_RE = re.compile(rf"^\s*(?:{_STEP};)*{_STEP}{re.escape(ANSWER_PREFIX)}\\boxed\{{-?\d+\}}\s*$")
STEP_RE = re.compile(r"(-?\d+)([+-])(\d)=(-?\d+)")
DIFFICULTIES = ("easy", "medium", "hard")


def difficulty_of(num_terms: int, max_terms: int = MAX_TERMS) -> str:
    """``"easy"``, ``"medium"`` or ``"hard"``: the lower, middle and upper third of the 2..``max_terms`` range
    (for the default 14: 2-6, 7-10 and 11-14 terms)."""
    span = max(1, max_terms - MIN_TERMS + 1)
    third = (num_terms - MIN_TERMS) * 3 // span
    return DIFFICULTIES[min(max(third, 0), 2)]


def make_problem(rng: random.Random, max_terms: int = MAX_TERMS, num_terms: int | None = None) -> tuple[str, str, int]:
    """One chain: (prompt, answer, number of terms). The first term is 1..9, the others 0..9 with a random sign."""
    n = rng.randint(MIN_TERMS, max_terms) if num_terms is None else num_terms
    if not MIN_TERMS <= n <= max(max_terms, MIN_TERMS):
        raise ValueError(f"num_terms must be in [{MIN_TERMS}, {max_terms}], got {n}")
    total = rng.randint(1, 9)
    prompt = str(total)
    for _ in range(n - 1):
        op = rng.choice("+-")
        term = rng.randint(0, 9)
        prompt += f"{op}{term}"
        total = total + term if op == "+" else total - term
    return prompt + "=", str(total), n


def parse_prompt(prompt: str) -> list[tuple[str, int]]:
    """``"3+5-2="`` -> ``[("+", 3), ("+", 5), ("-", 2)]`` (the first term carries ``+``)."""
    body = prompt.strip()
    if not body.endswith("=") or not re.fullmatch(r"\d(?:[+-]\d)+=", body):
        raise ValueError(f"not a chain prompt: {prompt!r}")
    body = "+" + body[:-1]
    return [(body[i], int(body[i + 1])) for i in range(0, len(body), 2)]


def target_completion(prompt: str) -> str:
    """The completion a perfect policy writes for ``prompt`` (used for the supervised warm-up)."""
    terms = parse_prompt(prompt)
    total = terms[0][1]
    steps = []
    for op, term in terms[1:]:
        new = total + term if op == "+" else total - term
        steps.append(f"{total}{op}{term}={new}")
        total = new
    return ";".join(steps) + f"{ANSWER_PREFIX}\\boxed{{{total}}}"


def make_reasoning_dataset(num_samples: int = 2000, seed: int = 0, max_terms: int = MAX_TERMS):
    """A ``datasets.Dataset`` of chains with ``prompt``, ``answer``, ``num_terms`` and ``difficulty`` columns.

    The number of terms is uniform in 2..``max_terms``; the same ``seed`` gives the same dataset.
    """
    from datasets import Dataset

    if not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive integer, got {num_samples!r}")
    if not isinstance(max_terms, int) or not MIN_TERMS <= max_terms <= 30:
        raise ValueError(f"max_terms must be an integer in [{MIN_TERMS}, 30], got {max_terms!r}")
    rng = random.Random(seed)
    rows = {"prompt": [], "answer": [], "num_terms": [], "difficulty": []}
    for _ in range(num_samples):
        prompt, answer, n = make_problem(rng, max_terms)
        rows["prompt"].append(prompt)
        rows["answer"].append(answer)
        rows["num_terms"].append(n)
        rows["difficulty"].append(difficulty_of(n, max_terms))
    return Dataset.from_dict(rows)


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 when the completion is a chain of ``a±b=c`` steps then ``. So the answer is \\boxed{n}``, else 0.0.

    Only the shape is checked, not the arithmetic (that is :func:`correctness_reward`'s job).
    """
    return [1.0 if FORMAT_RE.match(_completion_text(c)) else 0.0 for c in completions]


def steps_reward(completions, **kwargs) -> list[float]:
    """Fraction of the written steps whose arithmetic is right (0.0 with no step): a dense progress signal.

    Not in the default reward mix of the demo; offered for experiments with process rewards.
    """
    rewards = []
    for completion in completions:
        steps = STEP_RE.findall(_completion_text(completion))
        ok = sum(int(c) == (int(a) + int(b) if op == "+" else int(a) - int(b)) for a, op, b, c in steps)
        rewards.append(ok / len(steps) if steps else 0.0)
    return rewards

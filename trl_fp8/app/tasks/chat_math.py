"""A verifiable chat task for a pretrained instruct model (SmolLM2-135M-Instruct): small arithmetic asked in words,
answered in ``\\boxed{}``.

A prompt is a conversation (TRL's conversational format). By default (``style="fewshot"``) it is one worked
exchange (``"What is 4 + 3? Put the final answer in \\boxed{}."`` -> ``"4 + 3 = 7. The answer is \\boxed{7}."``)
followed by the question in the same form, e.g. ``"What is 7 + 5? Put the final answer in \\boxed{}."``: probed
on SmolLM2-135M-Instruct (``benchmarks/smollm2_task_probe.py``, 12 prompts x 4 samples per level, cap 128, t=1),
the instruction alone — in a system message or after the question — gets 0 % boxed answers right (0-8 % boxed),
the worked exchange 65 / 8 / 12.5 % at levels 1 / 2 / 3 (28.5 % overall; 69-77 % boxed). Levels set the operands:

- ``1``: two one-digit numbers (``a + b``),
- ``2``: a two-digit and a one-digit number (``a + b`` or ``a - b``, never negative),
- ``3``: two two-digit numbers (``a + b``).

The dataset has ``prompt``, ``answer`` and ``level`` columns; rewards follow TRL's signature:
:func:`correctness_reward` (1.0 when the last boxed value is the answer) and :func:`boxed_format_reward`
(1.0 for a completion that boxes an integer, weighted 0.2: a model that rambles is pulled towards a verifiable
answer).
"""

from __future__ import annotations

import random
import re

from .arithmetic import _completion_text, correctness_reward, extract_boxed  # noqa: F401 - the same answer check

SYSTEM_PROMPT = "Solve the problem. Put the final answer in \\boxed{}."
LEVELS = (1, 2, 3)
CHAT_MATH_LEVELS = LEVELS  # the demo's mix
BOXED_INT_RE = re.compile(r"\\boxed\{\s*-?\d+\s*\}")


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


INSTRUCTION = "Put the final answer in \\boxed{}."
# One worked exchange before the question (``shots=1``): a 135M instruct model rarely boxes an answer unprompted.
EXAMPLE = ({"role": "user", "content": f"What is 4 + 3? {INSTRUCTION}"},
           {"role": "assistant", "content": "4 + 3 = 7. The answer is \\boxed{7}."})
STYLES = ("system", "user", "fewshot")


def make_chat_math_dataset(num_samples: int = 1000, seed: int = 0, levels=LEVELS, system_prompt: str | None =
                           SYSTEM_PROMPT, style: str = "fewshot"):
    """A ``datasets.Dataset`` of conversational prompts (levels drawn uniformly from ``levels``), seeded. ``style``:
    ``"system"`` (the instruction in a system message), ``"user"`` (appended to the question) or ``"fewshot"``
    (appended to the question, after one worked exchange)."""
    from datasets import Dataset

    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    levels = tuple(levels)
    if not levels or any(level not in LEVELS for level in levels):
        raise ValueError(f"levels must be a non-empty subset of {LEVELS}, got {levels!r}")
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    rng = random.Random(seed)
    prompts, answers, drawn = [], [], []
    for _ in range(num_samples):
        level = rng.choice(levels)
        question, answer = make_problem(rng, level)
        if style == "system":
            messages = [{"role": "user", "content": question}]
            if system_prompt:
                messages.insert(0, {"role": "system", "content": system_prompt})
        else:
            messages = [{"role": "user", "content": f"{question} {INSTRUCTION}"}]
            if style == "fewshot":
                messages = [dict(m) for m in EXAMPLE] + messages
        prompts.append(messages)
        answers.append(answer)
        drawn.append(level)
    return Dataset.from_dict({"prompt": prompts, "answer": answers, "level": drawn})


def boxed_format_reward(completions, **kwargs) -> list[float]:
    """1.0 when the completion boxes an integer somewhere, else 0.0 (weighted 0.2 beside correctness)."""
    return [1.0 if BOXED_INT_RE.search(_completion_text(c)) else 0.0 for c in completions]


def chat_math_accuracy(model, tokenizer, num_problems: int = 64, seed: int = 1234, temperature: float | None = 1.0,
                       levels=LEVELS, max_new_tokens: int = 128, batch_size: int = 32) -> float:
    """Held-out accuracy of one completion per problem (``temperature=None``: greedy), the prompts rendered with
    the tokenizer's chat template as TRL renders conversational prompts."""
    import torch

    data = make_chat_math_dataset(num_problems, seed=seed, levels=levels)
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    correct = 0
    try:
        for start in range(0, num_problems, batch_size):
            rows = data.select(range(start, min(start + batch_size, num_problems)))
            texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
                     for p in rows["prompt"]]
            batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            sampling = dict(do_sample=False) if temperature is None else dict(do_sample=True, temperature=temperature,
                                                                            top_k=0, top_p=1.0)
            with torch.no_grad():
                out = model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                     **sampling)
            completions = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
            correct += sum(correctness_reward(completions, rows["answer"]))
    finally:
        tokenizer.padding_side = side
    return correct / num_problems

"""A mixed-difficulty arithmetic chat task for SmolLM2-135M-Instruct, calibrated on the starting model: the task
where a per-step token budget has work to do (DUET's race, ``benchmarks/duet_race.py``).

Problems come in graded *kinds*, from one-digit sums to two-digit products, asked in a chat after one worked
exchange that boxes the answer (chat_math's; the answer marker ``\\boxed{}`` tells the abort rule when an answer
is in), with a completion cap of 128 tokens (room to ramble). Which prompt is easy (pass rate >= 0.9), medium
(0.2-0.8) or hard (<= 0.05) is not guessed from its kind: every candidate prompt was *sampled* from the starting
model (``benchmarks/duet_calib.py``: >= 16 completions a prompt, the training temperature and cap), and the measured
pass rates are stored with the task (``mixed_math_calibration.json`` beside this module). The training pool mixes
easy, medium and hard prompts so that plain GRPO with 8 rollouts a prompt sees 40-60 % zero-variance groups
(expected fraction ``Σ_q p_qᴳ + (1 - p_q)ᴳ`` over the pool, from the calibrated ``p_q``); the held-out set has no
easy prompt, disjoint from the pool: medium prompts are scarce on this model (~8 % of the candidates), so the gaps
between the bands (0.05-0.2, 0.8-0.9) count with them, and hard prompts fill it up.

The reward is correctness only (1.0 when the last boxed value is the answer): a format bonus would give an all-wrong
group reward variance and hide exactly the zero-variance groups this task is built to have.
"""

from __future__ import annotations

import json
import os
import random

from .arithmetic import _completion_text, correctness_reward, extract_boxed  # noqa: F401 - the same answer check
from .chat_math import EXAMPLE, INSTRUCTION

# The worked exchange before the question is chat_math's (a 135M instruct model rarely boxes an answer unprompted).
# Probed at temperature 0.7 (benchmarks/duet_calib.py --speed, 12 samples): with it 7 + 1, 1 + 3 and 9 + 8 were
# right 11-12 times in 12 and 61 + 5, 71 - 6 never; with a step-by-step worked example instead (tens, then ones)
# the same one-digit sums fell to 3-8 in 16: the step-by-step example confused the model more than it helped.

# kind -> (operand ranges, operator); graded from easiest to hardest
KINDS = {
    "add_one": ((1, 9), (1, 1), "+"),
    "add_small": ((2, 4), (2, 4), "+"),  # sums up to 8 (b >= 2: no overlap with add_one)
    "add_1d": ((1, 9), (1, 9), "+"),
    "add_2d1d": ((10, 99), (1, 9), "+"),
    "sub_2d1d": ((10, 99), (1, 9), "-"),
    "add_2d2d": ((10, 99), (10, 99), "+"),
    "mul_1d": ((2, 9), (2, 9), "*"),
    "mul_2d1d": ((11, 99), (2, 9), "*"),
    "add_3d3d": ((100, 999), (100, 999), "+"),
    "mul_2d2d": ((11, 99), (11, 99), "*"),
}
TEMPERATURE = 0.7  # the calibration and the race sample at it (GRPOConfig temperature=0.7)
MAX_COMPLETION_LENGTH = 128
EASY, HARD = 0.9, 0.05  # pass-rate bounds: easy >= 0.9, hard <= 0.05, medium 0.2-0.8 (the bands)
MEDIUM = (0.2, 0.8)
CALIBRATION_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mixed_math_calibration.json")


def make_problem(rng: random.Random, kind: str) -> tuple[str, str]:
    """One question of ``kind``: (question text, answer)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    (a_lo, a_hi), (b_lo, b_hi), op = KINDS[kind]
    a, b = rng.randint(a_lo, a_hi), rng.randint(b_lo, b_hi)
    answer = a + b if op == "+" else a - b if op == "-" else a * b
    shown = "×" if op == "*" else op
    return f"What is {a} {shown} {b}?", str(answer)


def messages(question: str) -> list[dict]:
    """The conversation of one prompt: the worked exchange, then ``question`` with the instruction."""
    return [dict(m) for m in EXAMPLE] + [{"role": "user", "content": f"{question} {INSTRUCTION}"}]


def candidates(per_kind, seed: int = 0) -> list[dict]:
    """Distinct candidate problems (seeded), each ``{"id", "kind", "question", "answer"}``: what the calibration
    samples. ``per_kind``: how many of every kind (an int) or of each kind named (a dict)."""
    counts = dict.fromkeys(KINDS, per_kind) if isinstance(per_kind, int) else dict(per_kind)
    for kind, n in counts.items():
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"per_kind must be >= 1, got {n!r} for {kind}")
        (a_lo, a_hi), (b_lo, b_hi), _ = KINDS[kind]
        if n > (a_hi - a_lo + 1) * (b_hi - b_lo + 1):
            raise ValueError(f"per_kind {n} for {kind} exceeds its distinct problems")
    rng = random.Random(seed)
    out, seen = [], set()
    for kind, want in counts.items():
        n = tries = 0
        while n < want:
            tries += 1
            if tries > 10_000 * want:  # kinds overlap (e.g. 2 + 3 is also a one-digit sum): too few left
                raise ValueError(f"per_kind {want} for {kind}: not enough problems distinct from the other kinds'")
            question, answer = make_problem(rng, kind)
            if question in seen:
                continue
            seen.add(question)
            out.append({"id": f"{kind}-{n}", "kind": kind, "question": question, "answer": answer})
            n += 1
    return out


def band(pass_rate: float) -> str:
    """``"easy"`` (>= 0.9), ``"hard"`` (<= 0.05), ``"medium"`` (0.2-0.8) or ``"between"`` (the gaps)."""
    if pass_rate >= EASY:
        return "easy"
    if pass_rate <= HARD:
        return "hard"
    if MEDIUM[0] <= pass_rate <= MEDIUM[1]:
        return "medium"
    return "between"


def zero_variance_fraction(pass_rates, group: int = 8) -> float:
    """Expected fraction of groups of ``group`` rollouts with one reward (all right or all wrong), a prompt drawn
    uniformly from ``pass_rates``: the mean of ``p^G + (1 - p)^G``."""
    rates = list(pass_rates)
    if not rates:
        raise ValueError("pass_rates must not be empty")
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    if any(not 0.0 <= p <= 1.0 for p in rates):
        raise ValueError("pass_rates must lie in [0, 1]")
    return sum(p ** group + (1 - p) ** group for p in rates) / len(rates)


def load_calibration(path: str = CALIBRATION_FILE) -> dict:
    """The stored calibration: ``{"settings", "prompts": [{"id", "kind", "question", "answer", "passes", "samples",
    "mean_length", ...}], "train": [ids], "heldout": [ids], ...}``; a clear error when it is missing."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: run `python benchmarks/duet_calib.py` (samples the starting "
                                "model) and then `python benchmarks/duet_calib.py --build`.")
    with open(path) as f:
        return json.load(f)


def _rows(calibration: dict, split: str) -> list[dict]:
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    by_id = {p["id"]: p for p in calibration["prompts"]}
    return [by_id[i] for i in calibration[split]]


def make_mixed_math_dataset(split: str = "train", calibration: dict | None = None):
    """A ``datasets.Dataset`` (``prompt``, ``answer``, ``kind``, ``pass_rate``) of the calibrated ``split``: the
    training pool or the held-out set."""
    from datasets import Dataset

    rows = _rows(calibration or load_calibration(), split)
    return Dataset.from_dict({
        "prompt": [messages(r["question"]) for r in rows],
        "answer": [r["answer"] for r in rows],
        "kind": [r["kind"] for r in rows],
        "pass_rate": [r["passes"] / r["samples"] for r in rows],
    })


def sample_completions(model, tokenizer, texts: list[str], samples: int = 1, max_new_tokens: int = MAX_COMPLETION_LENGTH,
                       temperature: float | None = TEMPERATURE, eos_token_ids=None) -> list[list[int]]:
    """``samples`` completions (token ids, up to and including the first end-of-sequence token) of each prompt
    ``texts[i]`` (rows ``i * samples .. (i + 1) * samples - 1``), sampled as TRL samples (temperature only: top-k 0,
    top-p 1) or greedily (``temperature=None``), with a KV cache from which every finished row is dropped at once:
    where ``generate`` runs every row to the longest one, the cost here is the tokens actually generated (about 2.5x
    less on this task's rambling tails). Seed the torch RNG before calling for a repeatable draw."""
    import torch
    from transformers import DynamicCache

    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    eos = set(eos_token_ids if eos_token_ids is not None else [tokenizer.eos_token_id])
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        batch = tokenizer(list(texts), return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    finally:
        tokenizer.padding_side = side
    mask = batch["attention_mask"]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():  # each prompt is read once, its cache then repeated for its samples
        logits = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=positions,
                       past_key_values=cache, use_cache=True).logits[:, -1].float()
        if samples > 1:
            cache.batch_repeat_interleave(samples)
            logits, mask = logits.repeat_interleave(samples, 0), mask.repeat_interleave(samples, 0)
            positions = positions.repeat_interleave(samples, 0)
        out = [[] for _ in range(mask.shape[0])]
        alive = torch.arange(mask.shape[0], device=model.device)
        position = positions[:, -1]
        for t in range(max_new_tokens):
            if temperature is None:
                token = logits.argmax(-1)
            else:
                token = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1).squeeze(1)
            ended = torch.zeros_like(token, dtype=torch.bool)
            for i, (row, tok) in enumerate(zip(alive.tolist(), token.tolist(), strict=True)):
                out[row].append(tok)
                ended[i] = tok in eos
            if t == max_new_tokens - 1 or bool(ended.all()):
                break
            keep = (~ended).nonzero().flatten()
            if len(keep) < len(alive):
                cache.batch_select_indices(keep)
                alive, mask, position, token = alive[keep], mask[keep], position[keep], token[keep]
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            position = position + 1
            logits = model(input_ids=token.unsqueeze(1), attention_mask=mask, position_ids=position.unsqueeze(1),
                           past_key_values=cache, use_cache=True).logits[:, -1].float()
    return out


def mixed_math_accuracy(model, tokenizer, calibration: dict | None = None, temperature: float | None = TEMPERATURE,
                        max_new_tokens: int = MAX_COMPLETION_LENGTH, batch_size: int = 32, samples: int = 1) -> float:
    """Held-out accuracy: the mean correctness of ``samples`` completions of every held-out problem
    (``temperature=None``: greedy), rendered with the chat template as TRL renders conversational prompts
    (:func:`sample_completions`). Seed the torch RNG before calling for a repeatable draw."""
    rows = _rows(calibration or load_calibration(), "heldout")
    correct = 0.0
    for start in range(0, len(rows), batch_size):
        part = rows[start:start + batch_size]
        texts = [tokenizer.apply_chat_template(messages(r["question"]), add_generation_prompt=True, tokenize=False)
                 for r in part]
        ids = sample_completions(model, tokenizer, texts, samples, max_new_tokens, temperature)
        completions = tokenizer.batch_decode(ids, skip_special_tokens=True)
        correct += sum(correctness_reward(completions, [r["answer"] for r in part for _ in range(samples)]))
    return correct / (len(rows) * samples)

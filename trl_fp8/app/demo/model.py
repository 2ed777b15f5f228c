"""The embedded demo model: a tiny Qwen2 warmed up on the arithmetic task, shipped inside the package.

``python examples/train_demo_model.py`` (or :func:`train_demo_model`) rebuilds it from scratch: a
character-level tokenizer, a 2-layer Qwen2 (head_dim 32, so a vLLM CPU engine accepts it) and a short
supervised warm-up on :mod:`trl_fp8.app.tasks.arithmetic`. The warm-up is deliberately short: GRPO must start
from a policy that *sometimes* succeeds, so the reward has room to rise.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ...models import embedded_model_path
from ..tasks.arithmetic import correctness_reward, make_problem, target_completion
from ...tokenization import build_char_tokenizer

DEMO_MODEL_DIR = Path(__file__).resolve().parents[2] / "assets" / "demo_model"


def demo_model_path() -> str:
    """Folder of the shipped demo model, for ``from_pretrained``."""
    return embedded_model_path(DEMO_MODEL_DIR, "demo model", "examples/train_demo_model.py")


def char_qwen2_config(vocab_size: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                      positions: int):
    """A float32 Qwen2 for the character tokenizer (pad 0, eos 1, no bos), heads of 32, tied embeddings."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=32, max_position_embeddings=positions,
        tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=None, dtype="float32",
    )


def build_demo_config(vocab_size: int = 128):
    """The demo architecture: Qwen2, 2 layers, hidden 64, 2 heads of 32, 1 KV head, tied embeddings."""
    return char_qwen2_config(vocab_size, hidden=64, intermediate=256, layers=2, heads=2, kv_heads=1, positions=64)


@dataclass
class WarmupSettings:
    steps: int = 1000
    batch_size: int = 128
    lr: float = 3e-3
    # Label smoothing leaves the right answer as the mode but keeps the sampled policy diffuse: greedy
    # decoding is mostly right, sampling at temperature 1 only sometimes. GRPO's job is to sharpen it.
    label_smoothing: float = 0.1
    seed: int = 0
    max_operand: int = 99


def _encode_batch(tokenizer, pairs, device):
    """Token ids + labels (loss on the completion and its eos only) for a list of (prompt, target completion)."""
    seqs, labels = [], []
    for prompt, completion in pairs:
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        c = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(p + c)
        labels.append([-100] * len(p) + c)
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    lab = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, l) in enumerate(zip(seqs, labels)):
        ids[i, : len(s)] = torch.tensor(s)
        lab[i, : len(l)] = torch.tensor(l)
        mask[i, : len(s)] = 1
    return ids.to(device), lab.to(device), mask.to(device)


@dataclass
class Generation:
    """One generated completion: its text, its number of tokens (eos excluded) and whether it ended with eos."""

    text: str
    num_tokens: int
    finished: bool


@torch.no_grad()
def generate_completions(model, tokenizer, prompts: list[str], temperature: float | None = 1.0,
                         max_new_tokens: int = 16, seed: int = 1234) -> list[Generation]:
    """One completion per prompt, sampled at ``temperature`` (None: greedy), seeded by ``seed``."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    torch.manual_seed(seed)
    was_training = model.training
    model.eval()
    sampling = {"do_sample": False} if temperature is None else {
        "do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    out = model.generate(**enc, **sampling, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    model.train(was_training)
    new = out[:, enc["input_ids"].shape[1]:]
    texts = tokenizer.batch_decode(new, skip_special_tokens=True)
    generations = []
    for row, text in zip(new.tolist(), texts):
        finished = tokenizer.eos_token_id in row
        n = row.index(tokenizer.eos_token_id) if finished else len(row)
        generations.append(Generation(text, n, finished))
    return generations


def sampled_accuracy(model, tokenizer, num_problems: int = 256, seed: int = 1234, temperature: float | None = 1.0,
                     max_operand: int = 99, max_new_tokens: int = 16) -> float:
    """Fraction of held-out problems solved by one sample at ``temperature`` (None: greedy decoding)."""
    rng = random.Random(seed)
    problems = [make_problem(rng, max_operand) for _ in range(num_problems)]
    generations = generate_completions(model, tokenizer, [p for p, _ in problems], temperature, max_new_tokens, seed)
    rewards = correctness_reward([g.text for g in generations], [a for _, a in problems])
    return sum(rewards) / len(rewards)


def warm_up(config, sample_pair, steps: int, batch_size: int, lr: float, label_smoothing: float, seed: int,
            log=print, log_every: int = 100, on_step=None):
    """Build a ``Qwen2ForCausalLM`` from ``config`` and train it on ``sample_pair(rng) -> (prompt, completion)``.

    AdamW, linear warm-up over the first tenth of ``steps`` then cosine decay, gradient clipping at 1, label
    smoothing on the completion tokens (the prompt is not trained on). ``on_step(step, model, tokenizer, loss)``, if
    given, is called after each step (to watch a held-out measure while tuning the warm-up). Returns
    ``(model, tokenizer, final_loss)``.
    """
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = build_char_tokenizer()
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"config.vocab_size={config.vocab_size} does not cover the tokenizer "
                         f"({len(tokenizer)} tokens)")
    model = Qwen2ForCausalLM(config)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warm = max(1, steps // 10)

    def lr_at(step):  # linear warm-up, cosine decay
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    loss_value = float("nan")
    for step in range(steps):
        pairs = [sample_pair(rng) for _ in range(batch_size)]
        ids, labels, mask = _encode_batch(tokenizer, pairs, "cpu")
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
            ignore_index=-100, label_smoothing=label_smoothing,
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_value = loss.item()
        if log and (step % log_every == 0 or step == steps - 1):
            log(f"warm-up step {step:5d}  loss {loss_value:.4f}")
        if on_step is not None:
            on_step(step, model, tokenizer, loss_value)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer, loss_value


def save_model_folder(output_dir: str | os.PathLike, model, tokenizer, summary: dict) -> None:
    """Save model, tokenizer and ``warmup.json`` (the summary) to ``output_dir``, atomically.

    Everything goes to a temporary sibling folder that is then swapped in: never a half-written model, and a
    failure leaves the old folder as it was.
    """
    out = Path(output_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "warmup.json").write_text(json.dumps(summary, indent=2) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the model is meant to be shipped
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            if old.exists():
                shutil.rmtree(old)
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def train_demo_model(output_dir: str | os.PathLike, settings: WarmupSettings | None = None, log=print) -> dict:
    """Build the tokenizer and model, warm it up, and save both to ``output_dir`` (atomically).

    Returns a summary dict (final loss, sampled accuracy, parameter count) that is also written to
    ``warmup.json`` in the folder.
    """
    settings = settings or WarmupSettings()
    config = build_demo_config()  # its vocab_size covers the char tokenizer (tests/app/demo/test_model.py)

    def sample_pair(rng):
        prompt, answer = make_problem(rng, settings.max_operand)
        return prompt, target_completion(answer)

    model, tokenizer, loss_value = warm_up(config, sample_pair, settings.steps, settings.batch_size, settings.lr,
                                           settings.label_smoothing, settings.seed, log=log)
    accuracy = sampled_accuracy(model, tokenizer, max_operand=settings.max_operand)
    greedy = sampled_accuracy(model, tokenizer, max_operand=settings.max_operand, temperature=None)
    summary = {
        "final_loss": loss_value,
        "sampled_accuracy_t1": accuracy,
        "greedy_accuracy": greedy,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "settings": asdict(settings),
    }
    if log:
        log(f"accuracy: sampled at temperature 1 {accuracy:.3f}, greedy {greedy:.3f}")
    save_model_folder(output_dir, model, tokenizer, summary)
    return summary

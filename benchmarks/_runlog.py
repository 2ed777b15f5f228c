"""Resumable long benchmark runs: one JSONL file of raw records, our own checkpoints, and a report read from the file.

A run is named by a ``key`` (a dict: benchmark, model, arm, seed, learning rate, ...). Its trainer checkpoints every
``save_every`` steps into its own folder and resumes with ``resume_from_checkpoint="auto"``; the :class:`Recorder`
callback appends to the JSONL file, as they happen:

- ``{"kind": "start", "from_step": k}`` when the run (re)starts at optimizer step ``k``;
- ``{"kind": "step", "step": s, "seconds": ..., <the step's logged metrics>}`` for every optimizer step;
- ``{"kind": "eval", "step": s, "heldout_sampled": ..., "heldout_greedy": ..., "eval_seconds": ...}`` at step 0 and
  every ``eval_every`` steps (outside the timed region, with the training RNG state untouched);
- ``{"kind": "done"}`` when the run reached its last step (its checkpoint folder is then removed).

:func:`load_runs` reads the file back: a ``start`` record at step ``k`` discards that run's records of later steps
written before it (a session that died after step ``k``'s checkpoint redoes those steps), so each run is one
trajectory. A session limit loses at most the steps since the last checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable


def run_name(key: dict) -> str:
    """A folder name for the run ``key`` (stable, readable)."""
    return "-".join(f"{k}{v:g}" if isinstance(v, float) else f"{k}{v}" for k, v in key.items() if k != "bench")


def _matches(record: dict, key: dict) -> bool:
    return all(record.get(k) == v for k, v in key.items())


def load_runs(path: str, keys: tuple[str, ...]) -> dict[tuple, dict]:
    """Every run in ``path`` by the tuple of its ``keys`` values: ``{"steps": {s: rec}, "evals": {s: rec},
    "done": bool, "key": {...}}``, one trajectory per run (see the module docstring)."""
    runs: dict[tuple, dict] = {}
    if not os.path.isfile(path):
        return runs
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:  # a line cut by a killed session: only the last line can be
                raise ValueError(f"{path}:{n} is not JSON ({exc}); remove that line and rerun") from None
            if any(k not in rec for k in keys):
                continue
            ident = tuple(rec[k] for k in keys)
            run = runs.setdefault(ident, {"steps": {}, "evals": {}, "done": False,
                                          "key": {k: rec[k] for k in keys}})
            kind = rec.get("kind")
            if kind == "start":
                k = rec["from_step"]
                run["steps"] = {s: r for s, r in run["steps"].items() if s <= k}
                run["evals"] = {s: r for s, r in run["evals"].items() if s <= k}
                run["done"] = False
            elif kind == "step":
                run["steps"][rec["step"]] = rec
            elif kind == "eval":
                run["evals"][rec["step"]] = rec
            elif kind == "done":
                run["done"] = True
    return runs


def is_done(path: str, key: dict) -> bool:
    return any(run["done"] and run["key"] == key for run in load_runs(path, tuple(key)).values())


def code_commit() -> str | None:
    """The git commit of the code a run (or a resumed part of it) started from, "+dirty" when the work tree had
    uncommitted changes; None outside a git checkout."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "../trl_fp8",
                                "../benchmarks/*.py"], cwd=here, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def append(path: str, record: dict) -> None:
    """One JSON line, flushed and fsynced (a record written is a record kept)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def recorder(path: str, key: dict, eval_every: int, evaluate: Callable | None, step_metrics: Callable[[dict], dict]):
    """A ``TrainerCallback`` writing ``key``'s records to ``path``.

    ``evaluate(model) -> dict`` gives the held-out figures (run under ``torch.random.fork_rng`` so training draws
    the same random numbers with and without it); ``step_metrics(logs) -> dict`` picks what to keep of a step's
    logged metrics."""
    import torch
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def __init__(self):
            self.t0 = None
            self.seconds = 0.0

        def _eval(self, model, step: int) -> None:
            if evaluate is None:
                return
            was = model.training
            model.eval()
            t0 = time.perf_counter()
            with torch.random.fork_rng(), torch.no_grad():
                figures = evaluate(model, step)
            model.train(was)
            append(path, {**key, "kind": "eval", "step": step, **figures,
                          "eval_seconds": round(time.perf_counter() - t0, 1)})

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            append(path, {**key, "kind": "start", "from_step": state.global_step, "time": time.time(),
                          "commit": code_commit()})
            if state.global_step == 0:
                self._eval(model, 0)

        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.seconds = time.perf_counter() - self.t0
            if state.global_step % eval_every == 0:
                self._eval(model, state.global_step)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "loss" not in logs:  # the end-of-training summary has train_loss, not loss
                return
            append(path, {**key, "kind": "step", "step": state.global_step, "seconds": round(self.seconds, 3),
                          **step_metrics(logs)})

    return Recorder()


def finish(path: str, key: dict, output_dir: str) -> None:
    """Mark ``key`` done and remove its checkpoints (the records are the result)."""
    append(path, {**key, "kind": "done", "time": time.time()})
    if os.path.isdir(output_dir):
        shutil.rmtree(output_dir)


def spread(xs, fmt: str, count: bool = False) -> str:
    """``mean ± std [min, max]`` (sample std; 0 with one value), with ``(n=...)`` when ``count``; ``n/a`` for none.
    The benchmarks' one way to state a figure over seeds."""
    import statistics

    xs = list(xs)
    if not xs:
        return "n/a"
    std = statistics.stdev(xs) if len(xs) > 1 else 0.0
    text = (f"{format(statistics.mean(xs), fmt)} ± {format(std, fmt.replace('+', ''))} [{format(min(xs), fmt)}, "
            f"{format(max(xs), fmt)}]")
    return f"{text} (n={len(xs)})" if count else text


def chat_math_heldout(tokenizer, problems: int = 48, greedy: bool = True):
    """``evaluate(model, step)`` for SmolLM2 on ``chat_math``: one sampled (t = 1) and, with ``greedy``, one greedy
    completion per held-out problem — the problems and sampling seeds of every real-model benchmark
    (``smollm2_learning.py``, ``fair_cast_lag.py`` and ``duet_budget.py --model smollm2``), so their figures compare."""
    import torch

    from trl_fp8.app.tasks.chat_math import chat_math_accuracy

    def evaluate(model, step: int) -> dict:
        torch.manual_seed(10_000 + step)
        figures = {"heldout_sampled": chat_math_accuracy(model, tokenizer, problems, seed=987, temperature=1.0)}
        if greedy:
            figures["heldout_greedy"] = chat_math_accuracy(model, tokenizer, problems, seed=987, temperature=None)
        return figures

    return evaluate


def numeric(logs: dict) -> dict:
    """A step's logged metrics that are numbers (TRL's and ours), as floats."""
    return {k: float(v) for k, v in logs.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}

"""The metrics file every run writes: a JSON-lines writer (a ``TrainerCallback``, added by
:class:`trl_fp8.GRPOTrainer` for ``metrics_jsonl``) and its reader. A resumed run continues the same file, each step
once. The plots drawn from it are the app's (:mod:`trl_fp8.app.report`).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

from transformers import TrainerCallback


class MetricsJsonlCallback(TrainerCallback):
    """Append each metrics record the trainer logs to a JSON-lines file (main process only).

    Each line is one JSON object: the logged metrics plus ``step`` (global step) and ``epoch``. Values that
    JSON cannot hold (NaN, inf) are written as ``null``. The file is opened in append mode, so a resumed run
    continues the same file: at the start of training from step N (N = 0 for a fresh start) the records of later
    steps — written by a session that was stopped after its last checkpoint — are dropped, and so is a last line
    cut short by a kill (see :func:`truncate_metrics`), so the file holds each step once.

    A record that carries ``completions/mean_length`` also gets ``rollout/completions``: the completions generated
    per optimizer step (``per_device_train_batch_size`` x processes x ``gradient_accumulation_steps`` /
    ``num_iterations``), so that rollout tokens per step can be read back (:func:`rollout_tokens`).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        try:
            truncate_metrics(self.path, state.global_step)
        except ValueError as err:  # a line broken in the middle of the file: left as it is
            warnings.warn(f"metrics_jsonl: {err}; the file is appended to as it is.", stacklevel=2)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        record = {"step": state.global_step, "epoch": state.epoch}
        for key, value in logs.items():
            record[key] = _jsonable(value)
        count = completions_per_step(args)
        if count is not None and "completions/mean_length" in logs and "rollout/completions" not in logs:
            record["rollout/completions"] = count
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()


def completions_per_step(args) -> float | None:
    """Completions generated per optimizer step under GRPO ``args`` (None when ``args`` lacks the fields)."""
    try:
        per_device = int(args.per_device_train_batch_size)
        world = int(getattr(args, "world_size", 1) or 1)
        accumulation = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
        iterations = int(getattr(args, "num_iterations", 1) or 1)
    except (AttributeError, TypeError, ValueError):
        return None
    return per_device * world * accumulation / iterations


def _jsonable(value):
    if hasattr(value, "item") and callable(value.item):  # tensors / numpy scalars
        try:
            value = value.item()
        except (TypeError, ValueError):
            return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return str(value)


def _parse_lines(path, lines: list[str]) -> list[tuple[str, dict | None]]:
    """(line, record) for each non-empty line; the record is None for a last line cut short (with a warning); a broken
    line before the last raises ``ValueError`` naming the file and line."""
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    out = []
    for i, (lineno, line) in enumerate(numbered):
        try:
            out.append((line, json.loads(line)))
        except json.JSONDecodeError as err:
            if i < len(numbered) - 1:
                raise ValueError(f"{path}, line {lineno}: not valid JSON ({err.msg})") from err
            warnings.warn(f"{path}, line {lineno}: the last line is incomplete (the run was stopped while writing "
                          "it); skipped.", stacklevel=3)
            out.append((line, None))
    return out


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Read a metrics JSON-lines file. A last line cut short (a run killed while writing it) is skipped with a
    warning; a broken line before it raises ``ValueError`` naming the file and line."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    return [record for _, record in _parse_lines(path, lines) if record is not None]


def truncate_metrics(path: str | os.PathLike, step: int) -> int:
    """Make a metrics file continue from ``step``: drop the records of later steps and a last line cut short, in one
    atomic rewrite (nothing is written when there is nothing to drop). Returns the number of lines dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parsed = _parse_lines(path, lines)
    kept = [line for line, record in parsed
            if record is not None and not (isinstance(record.get("step"), int) and record["step"] > step)]
    dropped = len(parsed) - len(kept)
    if dropped == 0 and (not text or text.endswith("\n")):
        return 0
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return dropped

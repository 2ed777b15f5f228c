"""Run reports: a JSON-lines metrics writer (a ``TrainerCallback``) and PNG plots read back from it."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from transformers import TrainerCallback

# Curves the demo report draws when present: (file stem, title, metric keys on that plot).
DEFAULT_PLOTS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("reward", "Reward per step", ("reward", "rewards/correctness_reward/mean", "rewards/format_reward/mean")),
    ("completion_length", "Completion length (tokens)", ("completions/mean_length",)),
    ("fair_cast_lag", "Fair Cast: served copy lag behind the master (steps)", ("fair_cast/lag_steps",)),
    ("fair_cast_visible", "Fair Cast: fraction of served weights changed per export",
     ("fair_cast/visible_update_frac",)),
    ("sync_logprob_gap", "Weight sync: |logπ_learner − logμ_sampler| on generated tokens",
     ("sync/logp_gap_mean", "sync/logp_gap_max")),
    ("duet_tokens", "DUET: rollout tokens per step", ("duet/tokens",)),
    ("duet_allocation", "DUET: rollouts per prompt, saved-token and abort fractions",
     ("duet/rollouts_per_prompt/mean", "duet/rollouts_per_prompt/min", "duet/rollouts_per_prompt/max",
      "duet/tokens_saved_frac", "duet/abort_frac")),
)


class MetricsJsonlCallback(TrainerCallback):
    """Append each metrics record the trainer logs to a JSON-lines file (main process only).

    Each line is one JSON object: the logged metrics plus ``step`` (global step) and ``epoch``. Values that
    JSON cannot hold (NaN, inf) are written as ``null``. The file is opened in append mode, so a resumed run
    continues the same file.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        record = {"step": state.global_step, "epoch": state.epoch}
        for key, value in logs.items():
            record[key] = _jsonable(value)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()


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


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Read a metrics JSON-lines file; raise ``ValueError`` naming the file and line on a broken line."""
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}, line {lineno}: not valid JSON ({err.msg})") from err
    return records


def series(records: Iterable[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric across the training records that carry it (finite values only)."""
    steps, values = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            steps.append(int(r.get("step", len(steps))))
            values.append(float(v))
    return steps, values


def plot_metrics(
    metrics_path: str | os.PathLike,
    output_dir: str | os.PathLike,
    plots: Sequence[tuple[str, str, Sequence[str]]] = DEFAULT_PLOTS,
) -> list[str]:
    """Draw one PNG per entry of ``plots`` whose metrics appear in the file; return the written paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, title, keys in plots:
        drawn = False
        fig, ax = plt.subplots(figsize=(7, 4))
        for key in keys:
            xs, ys = series(records, key)
            if xs:
                ax.plot(xs, ys, marker="." if len(xs) < 60 else None, label=key)
                drawn = True
        if not drawn:
            plt.close(fig)
            continue
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = output_dir / f"{stem}.png"
        tmp = path.with_name(f".{path.stem}.tmp.png")
        fig.savefig(tmp, dpi=100)
        plt.close(fig)
        os.replace(tmp, path)
        written.append(str(path))
    return written

"""Run reports: PNG plots read back from a run's metrics file (written by :class:`trl_fp8.metrics.MetricsJsonlCallback`).

Besides the per-metric curves (:func:`plot_metrics`), :func:`plot_budget` draws what a token budget buys, for one run
or several overlaid: rollout tokens per step, the fraction of rollouts aborted, and reward against cumulative
rollout tokens.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..metrics import MetricsJsonlCallback, completions_per_step, read_metrics, truncate_metrics  # noqa: F401

# Curves the demo report draws when present: (file stem, title, metric keys on that plot).
DEFAULT_PLOTS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("reward", "Reward per step", ("reward", "rewards/correctness_reward/mean", "rewards/format_reward/mean")),
    ("completion_length", "Completion length (tokens)", ("completions/mean_length",)),
    ("fair_cast_lag", "Fair Cast: served copy lag behind the master (steps)", ("fair_cast/lag_steps",)),
    ("fair_cast_visible", "Fair Cast: fraction of served weights changed per export",
     ("fair_cast/visible_update_frac",)),
    ("sync_logprob_gap", "Weight sync: mean |logπ − logμ| against its band",
     ("sync/logp_gap_mean", "sync/logp_gap_judged", "sync/logp_gap_numerics", "sync/logp_gap_path",
      "sync/logp_gap_limit")),
    ("duet_tokens", "DUET: rollout tokens per step", ("duet/tokens",)),
    ("duet_allocation", "DUET: rollouts per prompt, saved-token and abort fractions",
     ("duet/rollouts_per_prompt/mean", "duet/rollouts_per_prompt/min", "duet/rollouts_per_prompt/max",
      "duet/tokens_saved_frac", "duet/abort_frac")),
)


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
        written.append(_save_figure(plt, fig, output_dir, stem))
    return written


# ---------------------------------------------------------------------------------------------------------------------
# Token-budget plots: one line per run


def rollout_tokens(records: Sequence[dict]) -> tuple[list[int], list[float]]:
    """(steps, rollout tokens per step): DUET's ``duet/tokens`` where a record has it, else
    ``completions/mean_length`` x ``rollout/completions`` (written by :class:`MetricsJsonlCallback`)."""
    steps, values = [], []
    for r in records:
        tokens = r.get("duet/tokens")
        if not _finite(tokens):
            length, count = r.get("completions/mean_length"), r.get("rollout/completions")
            tokens = length * count if _finite(length) and _finite(count) else None
        if tokens is not None:
            steps.append(int(r.get("step", len(steps))))
            values.append(float(tokens))
    return steps, values


def cumulative_rollout_tokens(records: Sequence[dict]) -> dict[int, float]:
    """Step -> rollout tokens spent up to the end of that step. A record stands for the steps since the previous one
    (``logging_steps`` > 1 averages them), so its tokens per step count that many times."""
    out, total, previous = {}, 0.0, 0
    for step, tokens in zip(*rollout_tokens(records)):
        if step <= previous:
            continue
        total += tokens * (step - previous)
        previous = step
        out[step] = total
    return out


def reward_vs_tokens(records: Sequence[dict], key: str = "reward") -> tuple[list[float], list[float]]:
    """(cumulative rollout tokens at the end of each step, ``key`` at that step), over the records that have both."""
    cumulative = cumulative_rollout_tokens(records)
    xs, ys = [], []
    for r in records:
        step = r.get("step")
        if step in cumulative and _finite(r.get(key)):
            xs.append(cumulative[step])
            ys.append(float(r[key]))
    return xs, ys


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _trailing_mean(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1): i + 1]
        out.append(sum(part) / len(part))
    return out


def run_labels(paths: Sequence[str | os.PathLike]) -> list[str]:
    """A short label per metrics file: its folder's name (the file's stem if it is not ``metrics.jsonl``), with
    more of the path where two labels would be the same."""
    paths = [Path(p).resolve() for p in paths]

    def label(p: Path, depth: int) -> str:
        parts = p.parent.parts if p.name == "metrics.jsonl" else p.with_suffix("").parts
        return "/".join(parts[-depth:])

    depth = 1
    labels = [label(p, depth) for p in paths]
    while len(set(labels)) < len(labels) and depth < 8:
        depth += 1
        labels = [label(p, depth) for p in paths]
    return labels


def resolve_metrics_path(path: str | os.PathLike) -> Path:
    """A run folder -> its ``metrics.jsonl``; a file as given. ``FileNotFoundError`` names what is missing."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"metrics file not found: {path}")
    return path


def plot_budget(
    metrics_paths: Sequence[str | os.PathLike],
    output_dir: str | os.PathLike,
    labels: Sequence[str] | None = None,
    reward_key: str | None = None,
    window: int = 5,
) -> list[str]:
    """The token-budget report of one or several runs, one line per run; returns the written PNG paths.

    - ``rollout_tokens.png``: rollout tokens per step (:func:`rollout_tokens`);
    - ``abort_frac.png``: DUET's fraction of rollouts aborted for want of an answer marker (runs that log it);
    - ``reward_vs_tokens.png``: reward (``window``-step trailing mean) against cumulative rollout tokens.

    ``reward_key`` defaults to ``rewards/correctness_reward/mean`` when every run logs it, else ``reward``.
    A plot no run has data for is not drawn.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [Path(p) for p in metrics_paths]
    if not paths:
        raise ValueError("metrics_paths must name at least one metrics file")
    labels = list(labels) if labels is not None else run_labels(paths)
    if len(labels) != len(paths):
        raise ValueError(f"labels must have one entry per metrics file ({len(paths)}), got {len(labels)}")
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive integer, got {window!r}")
    runs = [read_metrics(p) for p in paths]
    accuracy = "rewards/correctness_reward/mean"
    if reward_key is None:
        reward_key = accuracy if all(series(r, accuracy)[0] for r in runs) else "reward"
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    many = len(runs) > 1
    figures = (
        ("rollout_tokens", "Rollout tokens per step", "step", "tokens", rollout_tokens),
        ("abort_frac", "DUET: fraction of rollouts aborted (no answer marker)", "step", "fraction",
         lambda r: series(r, "duet/abort_frac")),
        ("reward_vs_tokens", f"{'Accuracy' if reward_key == accuracy else reward_key} vs rollout tokens spent "
         f"({window}-step trailing mean)",
         "cumulative rollout tokens", reward_key, lambda r: _smoothed(reward_vs_tokens(r, reward_key), window)),
    )
    written = []
    for stem, title, xlabel, ylabel, get in figures:
        fig, ax = plt.subplots(figsize=(7, 4))
        drawn = False
        for records, label in zip(runs, labels):
            xs, ys = get(records)
            if xs:
                ax.plot(xs, ys, marker="." if len(xs) < 60 else None, label=label)
                drawn = True
        if not drawn:
            plt.close(fig)
            continue
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(alpha=0.3)
        if many or stem != "reward_vs_tokens":
            ax.legend(fontsize=8)
        written.append(_save_figure(plt, fig, output_dir, stem))
    return written


def _save_figure(plt, fig, output_dir: Path, stem: str) -> str:
    """Write ``fig`` to ``output_dir/stem.png`` atomically (a temporary name, then a rename); returns the path."""
    fig.tight_layout()
    path = output_dir / f"{stem}.png"
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
    return str(path)


def _smoothed(xy: tuple[list[float], list[float]], window: int) -> tuple[list[float], list[float]]:
    xs, ys = xy
    return xs, _trailing_mean(ys, window)

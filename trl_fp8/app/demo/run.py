"""The main job: GRPO on an embedded model and its task, offline, on CPU, with a report.

``trl-fp8 demo [--task arithmetic|reasoning] [--output-dir DIR]`` runs :func:`run_demo`. It writes ``metrics.jsonl``
(one record per step), PNG plots (reward and completion length per step; for the reasoning task also rollout tokens
per step, DUET's abort fraction and reward against cumulative rollout tokens), ``summary.json`` and the final model to
the output folder, and prints where they are. The tasks and their defaults are in :mod:`trl_fp8.app.demo.tasks`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from transformers import TrainerCallback

from ..report import cumulative_rollout_tokens, plot_budget, plot_metrics, read_metrics, series
from .tasks import TASK_NAMES, demo_task

WINDOW = 10  # steps averaged at the start and end of the run for the summary
AUTO = "auto"  # duet_budget: the task's default


@dataclass
class DemoSettings:
    """Knobs of the demo run. The defaults finish in a few minutes on 2 CPU cores.

    ``max_steps``, ``prompts_per_step``, ``learning_rate`` and ``max_completion_length`` left at None, and
    ``duet_budget`` left at ``"auto"``, take the task's defaults (:class:`trl_fp8.app.demo.tasks.DemoTask`) when the
    settings are made: arithmetic 300 steps x 16 prompts, lr 1e-4, 16 tokens, DUET off; reasoning 30 steps x 8
    prompts, lr 2e-5, 320 tokens, DUET at β = 0.5; chat_math (SmolLM2) 12 steps x 2 prompts, lr 5e-6, 96 tokens,
    DUET off. ``duet_budget=None`` turns DUET off.
    """

    output_dir: str = "trl_fp8_demo"
    task: str = "arithmetic"
    max_steps: int | None = None
    learning_rate: float | None = None
    prompts_per_step: int | None = None
    num_generations: int = 8
    max_completion_length: int | None = None
    temperature: float = 1.0
    seed: int = 0
    num_problems: int = 4000
    fair_cast: str = "stochastic"
    duet_budget: float | str | None = AUTO  # None: DUET off; "auto": the task's default; else its budget β
    mxfp8: bool = False  # MXFP8 linear layers (emulated on CPU: about 3.5x slower)
    qlora: str | None = None  # None: full fine-tuning; "fast": NF4 base + LoRA with fast QLoRA; "plain": TRL's QLoRA
    lora_learning_rate: float = 1e-3  # the learning rate with qlora (adapters train, the base is frozen)
    # dense copies for fast QLoRA, sized to the tiny demo model (about half of its 4-bit layers; the field's default,
    # 0.25 GiB, would keep every layer of a model this small)
    qlora_keep_budget_gb: float = 0.0001
    sync_checks: str = "default"
    progress: bool = True

    def __post_init__(self):
        if self.task not in TASK_NAMES:
            return  # validate() names the field
        task = demo_task(self.task)
        if self.max_steps is None:
            self.max_steps = task.demo_max_steps
        if self.prompts_per_step is None:
            self.prompts_per_step = task.demo_prompts_per_step
        if self.learning_rate is None:
            self.learning_rate = task.demo_learning_rate
        if self.max_completion_length is None:
            self.max_completion_length = task.max_completion_length
        if isinstance(self.duet_budget, str) and self.duet_budget == AUTO:
            self.duet_budget = task.demo_duet_budget

    def validate(self) -> None:
        if self.task not in TASK_NAMES:
            raise ValueError(f"task must be one of {', '.join(map(repr, TASK_NAMES))}, got {self.task!r}")
        if isinstance(self.duet_budget, str):
            raise ValueError(f"duet_budget must be None (DUET off), {AUTO!r} or a number in (0, 1], "
                             f"got {self.duet_budget!r}")
        for name in ("max_steps", "prompts_per_step", "num_generations", "max_completion_length", "num_problems"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_generations < 2:
            raise ValueError(f"num_generations must be >= 2 (GRPO needs a group), got {self.num_generations}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate!r}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")
        if self.qlora not in (None, "fast", "plain"):
            raise ValueError(f"qlora must be None, 'fast' or 'plain', got {self.qlora!r}")
        if not self.lora_learning_rate > 0:
            raise ValueError(f"lora_learning_rate must be > 0, got {self.lora_learning_rate!r}")


class _ProgressCallback(TrainerCallback):
    """One compact tqdm bar with the latest reward, instead of a metrics dict printed every step."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.bar = None

    def on_train_begin(self, args, state, control, **kwargs):
        if self.enabled and state.is_world_process_zero:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=state.max_steps, desc="GRPO demo", unit="step", dynamic_ncols=True)

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.bar is not None and logs and "reward" in logs:
            postfix = {"reward": f"{logs['reward']:.3f}"}
            if "completions/mean_length" in logs:
                postfix["len"] = f"{logs['completions/mean_length']:.1f}"
            self.bar.set_postfix(postfix, refresh=False)

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def build_demo_config(settings: DemoSettings, **overrides):
    """The ``trl_fp8.GRPOConfig`` of the demo run (CPU, fp32, one log record per step)."""
    from ...config import GRPOConfig

    task = demo_task(settings.task)
    out = Path(settings.output_dir)
    kwargs = dict(
        output_dir=str(out / "trainer"),
        use_cpu=True,
        bf16=False,
        max_steps=settings.max_steps,
        learning_rate=settings.lora_learning_rate if settings.qlora else settings.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        per_device_train_batch_size=settings.prompts_per_step * settings.num_generations,
        num_generations=settings.num_generations,
        max_completion_length=settings.max_completion_length,
        temperature=settings.temperature,
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=settings.seed,
        data_seed=settings.seed,
        reward_weights=list(task.reward_weights),
        fair_cast=settings.fair_cast,
        duet=settings.duet_budget is not None,
        duet_budget=settings.duet_budget if settings.duet_budget is not None else 0.5,
        duet_markers=list(task.duet_markers),
        mxfp8=settings.mxfp8,
        sync_checks=settings.sync_checks,
        fast_qlora="on" if settings.qlora == "fast" else "off",
        qlora_keep_budget_gb=settings.qlora_keep_budget_gb,
        metrics_jsonl=str(out / "metrics.jsonl"),
        dataloader_num_workers=0,
    )
    if settings.qlora:
        kwargs["model_init_kwargs"] = {"quantization_config": qlora_quantization_config(), "dtype": "float32"}
    kwargs.update(overrides)
    return GRPOConfig(**kwargs)


def qlora_quantization_config():
    """The demo's 4-bit base: NF4 weights, fp32 compute (CPU), as TRL's QLoRA scripts load it."""
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)


def qlora_peft_config():
    """The demo's adapters: LoRA r=16 on every linear layer."""
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)


def check_settings(settings: DemoSettings, **overrides):
    """Validate ``settings`` and the ``GRPOConfig`` they make; return that config.

    Raises ``ValueError`` naming the bad value, before any model is loaded (the CLI reports it in one line).
    """
    settings.validate()
    return build_demo_config(settings, **overrides)


def summarize(metrics_path: str | os.PathLike, key: str = "rewards/correctness_reward/mean") -> dict:
    """First-``WINDOW``-step and last-``WINDOW``-step means of ``key`` and of the total reward."""
    records = read_metrics(metrics_path)
    summary = {}
    for name in (key, "reward"):
        _, values = series(records, name)
        if not values:
            continue
        n = min(WINDOW, len(values))
        first = sum(values[:n]) / n
        last = sum(values[-n:]) / n
        summary[name] = {"first_mean": first, "last_mean": last, "gain": last - first, "window": n}
    from ...sync_checks.checks import CHECKS

    checks = {}
    for record in records:
        for name, value in record.items():
            if name.startswith("sync/") and name[5:] in CHECKS:  # pass/fail records, not the logprob figures
                runs, failed = checks.get(name[5:], (0, 0))
                checks[name[5:]] = (runs + 1, failed + (value < 1))
    if checks:
        summary["sync_checks"] = {name: {"runs": r, "failed": f} for name, (r, f) in sorted(checks.items())}
    return summary


def summarize_qlora(metrics_path: str | os.PathLike) -> dict:
    """Mean dequantizations per step and mean rollout-cache bytes of a fast-QLoRA run (empty for TRL's QLoRA)."""
    records = read_metrics(metrics_path)
    out = {}
    for name, key in (("qlora/dequant_calls", "dequant_calls_per_step"), ("qlora/cache_bytes", "cache_bytes")):
        _, values = series(records, name)
        if values:
            out[key] = sum(values) / len(values)
    return out


def summarize_budget(metrics_path: str | os.PathLike) -> dict:
    """Rollout tokens spent over the run (total and per step) and DUET's mean abort fraction, where logged."""
    records = read_metrics(metrics_path)
    out = {}
    cumulative = cumulative_rollout_tokens(records)
    if cumulative:
        last = max(cumulative)
        out["rollout_tokens_total"] = cumulative[last]
        out["rollout_tokens_per_step"] = cumulative[last] / last
    _, aborts = series(records, "duet/abort_frac")
    if aborts:
        out["duet_abort_frac_mean"] = sum(aborts) / len(aborts)
    return out


def run_demo(settings: DemoSettings | None = None, **config_overrides) -> dict:
    """Run the demo and return its summary (also written to ``summary.json``)."""
    from ...trainer import GRPOTrainer

    settings = settings or DemoSettings()
    args = check_settings(settings, **config_overrides)
    task = demo_task(settings.task)
    out = Path(settings.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.jsonl"
    if metrics_path.exists():
        metrics_path.unlink()  # a fresh run starts a fresh report

    dataset = task.make_dataset(settings.num_problems, seed=settings.seed)
    start = time.perf_counter()
    trainer = GRPOTrainer(
        model=task.model_path(),
        reward_funcs=list(task.reward_funcs),
        args=args,
        train_dataset=dataset,
        callbacks=[_ProgressCallback(settings.progress)],
        peft_config=qlora_peft_config() if settings.qlora else None,
    )
    # The compact bar replaces the metrics dict that the default printer writes at every step.
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    qlora = trainer.capability("fast_qlora")
    kept = qlora.kept_layers() if qlora is not None else None
    trainer.train()
    elapsed = time.perf_counter() - start
    model_dir = out / "model"
    trainer.save_model(str(model_dir))

    plots = plot_metrics(metrics_path, out)
    if task.name != "arithmetic":  # the arithmetic demo's report stays as it was (5 plots)
        plots += plot_budget([metrics_path], out, labels=[f"{task.name}, DUET β={settings.duet_budget}"
                                                          if settings.duet_budget is not None else task.name])
    summary = {
        "task": task.name,
        "steps": trainer.state.global_step,
        "wall_clock_s": elapsed,
        "metrics": str(metrics_path),
        "plots": plots,
        "model": str(model_dir),
        **summarize(metrics_path),
    }
    budget = summarize_budget(metrics_path)
    if budget:
        summary["budget"] = budget
    if settings.qlora:
        summary["qlora"] = {"mode": settings.qlora, **summarize_qlora(metrics_path)}
        if kept is not None:
            summary["qlora"]["kept_layers"] = kept
    tmp = out / ".summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, out / "summary.json")
    return summary


def format_summary(summary: dict) -> str:
    task = summary.get("task", "arithmetic")
    lines = [f"trl_fp8 demo ({task} task): {summary['steps']} GRPO steps in {summary['wall_clock_s']:.0f} s"]
    for name, label in (("rewards/correctness_reward/mean", "accuracy"), ("reward", "total reward")):
        if name in summary:
            s = summary[name]
            lines.append(
                f"  {label:<13} first {s['window']} steps {s['first_mean']:.3f} -> last {s['window']} steps "
                f"{s['last_mean']:.3f} ({s['gain']:+.3f})"
            )
    if "budget" in summary and "rollout_tokens_total" in summary["budget"]:
        b = summary["budget"]
        line = (f"  rollout tokens: {b['rollout_tokens_total']:.0f} in all, {b['rollout_tokens_per_step']:.0f} per "
                "step")
        if "duet_abort_frac_mean" in b:
            line += f"; DUET aborted {b['duet_abort_frac_mean']:.1%} of rollouts"
        lines.append(line)
    if "sync_checks" in summary:
        checks = summary["sync_checks"]
        failed = sum(c["failed"] for c in checks.values())
        runs = sum(c["runs"] for c in checks.values())
        lines.append(f"  weight-sync checks: {runs} run, {failed} failed ({', '.join(checks)})")
    if "qlora" in summary:
        q = summary["qlora"]
        if q["mode"] == "plain":
            lines.append("  QLoRA: NF4 base + LoRA, as TRL runs it (fast QLoRA off)")
        else:
            lines.append(f"  fast QLoRA: {len(q.get('kept_layers', []))} layers kept dense, "
                         f"{q.get('dequant_calls_per_step', 0):.0f} dequantizations per step, rollout cache "
                         f"{q.get('cache_bytes', 0) / 2**20:.1f} MiB")
    lines.append(f"  metrics: {summary['metrics']}")
    for p in summary["plots"]:
        lines.append(f"  plot:    {p}")
    lines.append(f"  model:   {summary['model']}")
    return "\n".join(lines)

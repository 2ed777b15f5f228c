"""How far the served bf16 copy lags the fp32 master, per Fair Cast export rule, in a realistic RL setting -- and
whether the lag hurts learning.

For each seed (>= 3; default 0 1 2) and each mode -- rtn, stochastic, error_feedback -- GRPO on a built-in task
(`--task arithmetic`: the demo task, 8 prompts x 8 generations per step; `--task reasoning`: chained arithmetic
written step by step, ~30-155-token completions, 8 prompts x 4 generations per step) with the task's embedded model,
fp32 master and fp32 activations, CPU, AdamW at `--lr` (constant; default 1e-6) runs `--steps` steps from the same
start; the seed sets the trainer seed, the data order and the training problems, and is shared by the three modes
(paired). Every mode generates with the served copy (Fair Cast's twin), so the rollouts see the lag. Each step logs
`fair_cast/lag_steps` (<w - q, u> / |u|^2 along the EMA u of the master's per-step update, on a fixed
65k-element subset; signed) and `fair_cast/visible_update_frac` (fraction of served elements changed by the export).

Per run: signed lag = mean of the per-step lag_steps; |lag| = mean of the per-step |lag_steps|; both over all
steps and over the last 20; visible fraction = mean over all steps; the training reward (correctness, sampled) per
step, its mean over the last 20 steps, and the held-out sampled accuracy after the last step. Across seeds each
figure is given as mean ± std (sample std) [min, max]. The PNG shows the lag, the visible fraction and the reward
curves side by side.

    python benchmarks/fair_cast_lag.py [--task reasoning] [--seeds 0 1 2] [--steps N] [--lr 1e-6] [--output F.png]
    python benchmarks/fair_cast_lag.py --quick      # smoke run: 2 seeds x 6 steps, figures not meaningful

Prints the per-seed figures, the across-seed table and saves a PNG of the lag curves. Last line:
`rtn_lag_over_sr_lag: <number>` -- per seed, |lag| of rtn over the last 20 steps divided by that of stochastic
(same seed); the mean over seeds (spread on the line before). A seed whose stochastic |lag| is exactly 0 gives no
ratio and is reported as excluded.

**On the real model** (``--model smollm2``: SmolLM2-135M-Instruct on ``chat_math``, full fine-tuning, TRL's default
``bf16=True`` -- bf16 autocast over fp32 masters, the bf16 served copy generating every rollout -- 2 prompts x 8
generations, completions <= 96 tokens, AdamW constant, checks off so only the export rule differs) the runs are long
(a median step of 14-20 s on 2 cores, ~10 minutes a 20-step run with its evaluations), so they are resumable: each
(lr, seed, rule) run checkpoints every ``--eval-every`` steps under ``--output-dir`` and resumes with
``resume_from_checkpoint="auto"``; every step's logged metrics and every
held-out evaluation (the served policy — between steps the learner holds the served values — 48 problems, sampled
t = 1 and greedy, at step 0 and every ``--eval-every`` steps)
are appended to ``--jsonl`` as they happen (``benchmarks/_runlog.py``); finished runs are skipped. Rerun the same
command after a stop. ``--report`` reads the JSONL only: the tables, ``fair_cast_reward_vs_step.png`` (training
reward of the served policy per step and held-out accuracy per evaluation, one column per learning rate, one colour
per rule) and the last line
``sr_minus_rtn_heldout_at_<lr>: <mean over seeds>`` (held-out sampled accuracy at the last evaluated step, paired).

``--inits bf16_grid`` starts the fp32 master on the bf16 grid (the file's weights rounded to nearest bf16 and kept in
float32, in ``<output-dir>/model-bf16grid``), as a bf16 checkpoint loads; the default ``checkpoint`` starts from the
file's Q4_1-dequantized weights, 79 % of which are off the grid -- a fixed dither that lets round-to-nearest follow
the master from the first steps. Runs from the two starts are recorded under different ``model`` names and reported
in separate tables; the last line then names the grid start (``sr_minus_rtn_heldout_at_1e-06_bf16grid``).

    python benchmarks/fair_cast_lag.py --model smollm2 --lrs 5e-6 --seeds 0 1 2 --steps 20
    python benchmarks/fair_cast_lag.py --model smollm2 --lrs 1e-6 --modes rtn stochastic --inits bf16_grid \
        --steps 30 --eval-every 10
    python benchmarks/fair_cast_lag.py --model smollm2 --report
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _runlog import spread  # noqa: E402  (the benchmarks' one way to state a figure over seeds)


def spread_n(xs, fmt: str) -> str:
    return spread(xs, fmt, count=True)

MODES = ("rtn", "stochastic", "error_feedback")
LAST = 20
REWARD = "rewards/correctness_reward/mean"
# Per task: prompts per step, generations per prompt, default steps (and the least allowed), held-out problems.
TASKS = {
    "arithmetic": dict(prompts=8, slots=8, steps=120, min_steps=100, eval_problems=256),
    "reasoning": dict(prompts=8, slots=4, steps=60, min_steps=40, eval_problems=128),
    # a real pretrained model (SmolLM2-135M-Instruct) in TRL's default precision: bf16 autocast over fp32 masters
    "chat_math": dict(prompts=2, slots=8, steps=60, min_steps=30, eval_problems=48, bf16=True),
}


def run_mode(mode: str, steps: int, lr: float, workdir: str, seed: int = 0, task_name: str = "arithmetic",
             settings: dict | None = None, evaluate: bool = True) -> tuple[list[dict], float]:
    """The per-step log records of one run, and the held-out sampled accuracy after it (nan: not evaluated)."""
    from transformers.trainer_callback import PrinterCallback

    import trl_fp8
    from trl_fp8.app.demo.tasks import demo_task

    task = demo_task(task_name)
    s = settings or TASKS[task_name]
    args = trl_fp8.GRPOConfig(
        output_dir=os.path.join(workdir, f"{mode}-{seed}-{lr:g}"), use_cpu=True, bf16=s.get("bf16", False),
        max_steps=steps,
        learning_rate=lr, lr_scheduler_type="constant", optim="adamw_torch",
        per_device_train_batch_size=s["prompts"] * s["slots"], num_generations=s["slots"],
        max_completion_length=task.max_completion_length, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, gradient_checkpointing=False, seed=seed, data_seed=seed, fair_cast=mode,
        reward_weights=list(task.reward_weights),
    )
    trainer = trl_fp8.GRPOTrainer(model=task.model_path(), reward_funcs=list(task.reward_funcs),
                                  args=args, train_dataset=task.make_dataset(4000, seed=seed))
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    if not evaluate:
        return [r for r in trainer.state.log_history if "fair_cast/visible_update_frac" in r], float("nan")
    accuracy = task.accuracy(trainer.model, trainer.processing_class, num_problems=s["eval_problems"], seed=4321)
    return [r for r in trainer.state.log_history if "fair_cast/visible_update_frac" in r], accuracy


def _mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def figures(recs: list[dict], last: int, accuracy: float = float("nan")) -> dict:
    lag = [r["fair_cast/lag_steps"] for r in recs if r.get("fair_cast/lag_steps") is not None]
    reward = [r[REWARD] for r in recs if r.get(REWARD) is not None]
    return {
        "reward_last": _mean(reward[-last:]), "heldout_acc": accuracy,
        "lag_all": _mean(lag), "abs_lag_all": _mean([abs(x) for x in lag]),
        "lag_last": _mean(lag[-last:]), "abs_lag_last": _mean([abs(x) for x in lag[-last:]]),
        "visible": _mean([r["fair_cast/visible_update_frac"] for r in recs]),
        "max_err_ulps": max(r["fair_cast/max_abs_err_ulps"] for r in recs),
        "lag_steps_logged": len(lag),
    }


COLUMNS = (("lag_all", "signed lag, all", ".2f"), ("abs_lag_all", "|lag|, all", ".2f"),
           ("lag_last", "signed lag, last 20", ".2f"), ("abs_lag_last", "|lag|, last 20", ".2f"),
           ("visible", "visible frac", ".4f"), ("reward_last", "reward, last 20", ".3f"),
           ("heldout_acc", "held-out acc", ".3f"))


REAL = dict(prompts=2, slots=8, steps=20, eval_every=5, eval_problems=48)
REAL_KEYS = ("bench", "model", "lr", "seed", "mode", "steps")
# Where the fp32 master starts: the checkpoint as loaded (Q4_1-dequantized float32, mostly *off* the bf16 grid), or
# those weights rounded to nearest bf16 -- as a bf16 checkpoint (SmolLM2's own release) loads into fp32 masters.
INITS = {"checkpoint": "trl-fp8:smollm2", "bf16_grid": "trl-fp8:smollm2-bf16grid"}
INIT_OF_MODEL = {v: k for k, v in INITS.items()}


def on_bf16_grid(tensors) -> float:
    """Fraction of the floating-point elements of ``tensors`` (name -> tensor) exactly representable in bf16."""
    import torch

    on = total = 0
    for t in tensors.values():
        if t.is_floating_point():
            on += (t.to(torch.bfloat16).float() == t.float()).sum().item()
            total += t.numel()
    return on / max(total, 1)


def bf16_grid_model(src: str, dst: str) -> str:
    """A copy of the model folder ``src`` at ``dst`` whose floating-point weights are rounded to nearest bf16 (kept
    in float32, so the trainer's fp32 masters start exactly on the bf16 grid). Written to a temp name, then renamed;
    an existing ``dst`` is reused (the rounding is deterministic)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    if os.path.isfile(os.path.join(dst, "model.safetensors")):
        return dst
    weights = os.path.join(src, "model.safetensors")
    if not os.path.isfile(weights):
        raise SystemExit(f"{src}: no model.safetensors to round onto the bf16 grid")
    tmp = dst + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("model.safetensors"))
    state = load_file(weights)
    before = on_bf16_grid(state)
    state = {k: t.to(torch.bfloat16).to(t.dtype) if t.is_floating_point() else t for k, t in state.items()}
    save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    os.replace(tmp, dst)
    print(f"{dst}: weights rounded to nearest bf16 ({before:.1%} of the checkpoint's elements were on the bf16 grid,"
          f" now {on_bf16_grid(state):.0%})")
    return dst
REAL_JSONL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "fair_cast_smollm2.jsonl")


def run_real(mode: str, seed: int, lr: float, steps: int, jsonl: str, output_dir: str, eval_every: int,
             init: str = "checkpoint") -> None:
    """One resumable SmolLM2 run (see the module docstring); returns at once if ``jsonl`` says it is done."""
    import _runlog
    from transformers.trainer_callback import PrinterCallback

    import trl_fp8
    from trl_fp8.app.demo.tasks import demo_task

    key = {"bench": "fair_cast", "model": INITS[init], "lr": lr, "seed": seed, "mode": mode, "steps": steps}
    if _runlog.is_done(jsonl, key):
        return
    task = demo_task("chat_math")
    model = task.model_path()
    if init == "bf16_grid":
        model = bf16_grid_model(model, os.path.join(output_dir, "model-bf16grid"))
    out = os.path.join(output_dir, _runlog.run_name(key))
    args = trl_fp8.GRPOConfig(
        output_dir=out, use_cpu=True, bf16=True, max_steps=steps, learning_rate=lr, lr_scheduler_type="constant",
        optim="adamw_torch", per_device_train_batch_size=REAL["prompts"] * REAL["slots"],
        num_generations=REAL["slots"], max_completion_length=task.max_completion_length, logging_steps=1,
        save_strategy="steps", save_steps=eval_every, save_total_limit=1, resume_from_checkpoint="auto",
        report_to="none", disable_tqdm=True, gradient_checkpointing=False, seed=seed, data_seed=seed,
        fair_cast=mode, sync_checks="off", reward_weights=list(task.reward_weights),
    )
    trainer = trl_fp8.GRPOTrainer(model=model, reward_funcs=list(task.reward_funcs), args=args,
                                  train_dataset=task.make_dataset(4000, seed=seed))
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(_runlog.recorder(jsonl, key, eval_every,
                                          _runlog.chat_math_heldout(trainer.processing_class, REAL["eval_problems"]),
                                          _runlog.numeric))
    trainer.train()
    if trainer.state.global_step >= steps:
        _runlog.finish(jsonl, key, out)


def report_real(jsonl: str, plot: str) -> None:
    """Tables and the reward-vs-step plot from the raw records in ``jsonl`` (finished runs only)."""
    import _runlog

    runs = [r for r in _runlog.load_runs(jsonl, REAL_KEYS).values() if r["done"]]
    if not runs:
        raise SystemExit(f"{jsonl}: no finished run yet (run the benchmark first)")
    # one table (and plot column) per starting point and learning rate: the checkpoint as loaded first
    sets = sorted({(r["key"]["model"], r["key"]["lr"]) for r in runs},
                  key=lambda ml: (list(INITS.values()).index(ml[0]) if ml[0] in INIT_OF_MODEL else 99, -ml[1]))
    headline = None
    for model, lr in sets:
        init = INIT_OF_MODEL.get(model, model)
        at = {m: sorted((r for r in runs if (r["key"]["model"], r["key"]["lr"]) == (model, lr)
                         and r["key"]["mode"] == m), key=lambda r: r["key"]["seed"]) for m in MODES}
        seeds = sorted({r["key"]["seed"] for rs in at.values() for r in rs})
        steps = max(r["key"]["steps"] for rs in at.values() for r in rs)
        step_s = sorted(x["seconds"] for rs in at.values() for r in rs for x in r["steps"].values())
        start = ("fp32 master starts on the bf16 grid (the weights rounded to nearest bf16, as a bf16 checkpoint "
                 "loads)" if init == "bf16_grid" else "fp32 master starts from the checkpoint as loaded "
                 "(Q4_1-dequantized float32, mostly off the bf16 grid)")
        print(f"\nSmolLM2-135M-Instruct, chat_math, full fine-tuning, bf16=True (bf16 served copy samples), {start}, "
              f"AdamW lr {lr:g} constant, {steps} steps of {REAL['prompts']} prompts x {REAL['slots']} generations; "
              f"seeds {seeds}; median optimizer step {statistics.median(step_s):.1f} s on this machine; per rule: mean ± "
              "std [min, max] over seeds, and the mean over seeds at each held-out evaluation (48 problems)")
        evals = sorted({s for rs in at.values() for r in rs for s in r["evals"]})
        marks = " / ".join(str(s) for s in evals)
        print("| rule | seeds | visible update frac | mean \\|lag\\| (steps) | signed lag, last 5 steps | "
              "training reward, first 5 steps -> "
              f"last 5 | held-out sampled at step {marks} | held-out greedy at step {marks} | sampled, last step | "
              "greedy, last step |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for mode in MODES:
            rs = at[mode]
            if not rs:
                continue
            vis = [statistics.mean(x["fair_cast/visible_update_frac"] for x in r["steps"].values()) for r in rs]
            lags = [[r["steps"][s]["fair_cast/lag_steps"] for s in sorted(r["steps"])
                     if r["steps"][s].get("fair_cast/lag_steps") is not None] for r in rs]
            lag = [statistics.mean(abs(x) for x in xs) for xs in lags if xs]
            signed = [statistics.mean(xs[-5:]) for xs in lags if xs]

            def reward(r, which):
                xs = [r["steps"][s][REWARD] for s in sorted(r["steps"])]
                return statistics.mean(xs[:5] if which == "first" else xs[-5:])

            def curve(field):
                return " / ".join(f"{statistics.mean(r['evals'][s][field] for r in rs if s in r['evals']):.2f}"
                                  for s in evals if any(s in r["evals"] for r in rs))

            def last(field):
                return spread_n([r["evals"][max(r["evals"])][field] for r in rs], ".2f")

            print(f"| {mode} | {len(rs)} | {spread_n(vis, '.4f')} | {spread_n(lag, '.1f')} | "
                  f"{spread_n(signed, '+.1f')} | {spread_n([reward(r, 'first') for r in rs], '.2f')} -> "
                  f"{spread_n([reward(r, 'last') for r in rs], '.2f')} | {curve('heldout_sampled')} | "
                  f"{curve('heldout_greedy')} | {last('heldout_sampled')} | {last('heldout_greedy')} |")
        for other in ("stochastic", "error_feedback"):
            pairs = [(a, b) for a in at["rtn"] for b in at[other] if a["key"]["seed"] == b["key"]["seed"]]
            if not pairs:
                continue
            last = max(pairs[0][0]["evals"])
            for field in ("heldout_sampled", "heldout_greedy"):
                d = [b["evals"][last][field] - a["evals"][last][field] for a, b in pairs]
                print(f"{other} − rtn, {field} at step {last}, paired per seed: "
                      f"{', '.join(f'{x:+.3f}' for x in d)}; {spread_n(d, '+.3f')}")
                if other == "stochastic" and field == "heldout_sampled":
                    headline = (lr, init, statistics.mean(d))  # the last set: the lowest lr, on the grid if run

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(sets), figsize=(6.5 * len(sets), 8), squeeze=False)
    for col, (model, lr) in enumerate(sets):
        ax, ax_eval = axes[0][col], axes[1][col]
        where = "master on the bf16 grid" if INIT_OF_MODEL.get(model) == "bf16_grid" else "checkpoint as loaded"
        for mode, color in zip(MODES, ("C0", "C1", "C2")):
            rs = [r for r in runs if (r["key"]["model"], r["key"]["lr"]) == (model, lr) and r["key"]["mode"] == mode]
            for r in rs:
                steps = sorted(r["steps"])
                ax.plot(steps, [r["steps"][s][REWARD] for s in steps], color=color, alpha=0.3, lw=1)
                evals = sorted(r["evals"])
                ax_eval.plot(evals, [r["evals"][s]["heldout_sampled"] for s in evals], color=color, alpha=0.3, lw=1)
            if rs:
                common = sorted(set.intersection(*(set(r["steps"]) for r in rs)))
                ax.plot(common, [statistics.mean(r["steps"][s][REWARD] for r in rs) for s in common], color=color,
                        lw=2.5, label=f"{mode} (mean of {len(rs)} seeds)")
                common = sorted(set.intersection(*(set(r["evals"]) for r in rs)))
                ax_eval.plot(common, [statistics.mean(r["evals"][s]["heldout_sampled"] for r in rs) for s in common],
                             color=color, lw=2.5, marker="o", label=f"{mode} (mean of {len(rs)} seeds)")
        ax.set(title=f"SmolLM2 chat_math, lr {lr:g}, {where}:\ntraining reward of the served policy",
               xlabel="optimizer step", ylabel="correctness, sampled (2 prompts x 8)")
        ax_eval.set(title=f"lr {lr:g}, {where}:\nheld-out accuracy, sampled t = 1 (48 problems)",
                    xlabel="optimizer step", ylabel="accuracy")
        for a in (ax, ax_eval):
            a.grid(alpha=0.3)
            a.legend()
    fig.tight_layout()
    fig.savefig(plot, dpi=100)
    print(f"plot: {plot}")
    if headline is not None:
        lr, init, value = headline
        print(f"sr_minus_rtn_heldout_at_{lr:g}{'_bf16grid' if init == 'bf16_grid' else ''}: {value:+.3f}")


def main_real(args) -> None:
    if args.report:
        report_real(args.jsonl, args.output if args.output != "fair_cast_lag.png" else "fair_cast_reward_vs_step.png")
        return
    if len(args.seeds) < 3:
        raise SystemExit("give at least 3 seeds (--seeds)")
    steps = args.steps if args.steps is not None else REAL["steps"]
    for lr in args.lrs or [args.lr]:
        for seed in args.seeds:  # interleaved per seed: paired runs (and both starting points) finish together
            for init in args.inits:
                for mode in [m for m in MODES if m in args.modes]:
                    run_real(mode, seed, lr, steps, args.jsonl, args.output_dir, args.eval_every, init)
    report_real(args.jsonl, "fair_cast_reward_vs_step.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=sorted(TASKS), default="arithmetic")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, help="default: per task (arithmetic 120, reasoning 60)")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--output", default="fair_cast_lag.png")
    parser.add_argument("--quick", action="store_true", help="smoke run: seeds 0 1, 6 steps (not meaningful)")
    parser.add_argument("--model", choices=["embedded", "smollm2"], default="embedded",
                        help="smollm2: the real model on chat_math, resumable (see above)")
    parser.add_argument("--lrs", type=float, nargs="+", help="--model smollm2: learning rates, one after another")
    parser.add_argument("--eval-every", type=int, default=REAL["eval_every"], help="--model smollm2")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                        help="--model smollm2: the rounding rules to run (rtn, the baseline, must be one)")
    parser.add_argument("--inits", nargs="+", choices=list(INITS), default=["checkpoint"],
                        help="--model smollm2: where the fp32 master starts: the checkpoint's weights as loaded "
                             "(Q4_1-dequantized, mostly off the bf16 grid) and/or those rounded to nearest bf16 (as "
                             "a bf16 checkpoint loads)")
    parser.add_argument("--jsonl", default=REAL_JSONL, help="--model smollm2: the raw records")
    parser.add_argument("--output-dir", default="runs/fair_cast_smollm2", help="--model smollm2: checkpoints")
    parser.add_argument("--report", action="store_true", help="--model smollm2: tables and plot from --jsonl")
    args = parser.parse_args()
    if "rtn" not in args.modes:
        parser.error("--modes must include rtn (the baseline every rule is compared with)")
    if args.model == "smollm2":
        main_real(args)
        return
    settings = dict(TASKS[args.task])
    steps = args.steps if args.steps is not None else settings["steps"]
    last = LAST
    if args.quick:
        args.seeds, steps, last = [0, 1], 6, 3
        settings.update(prompts=2, eval_problems=16)
    elif steps < settings["min_steps"]:
        parser.error(f"--steps must be >= {settings['min_steps']} for --task {args.task}")
    elif len(args.seeds) < 3:
        parser.error("give at least 3 seeds")

    curves = {mode: [] for mode in MODES}
    accuracies = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as workdir:
        for seed in args.seeds:
            for mode in MODES:  # interleaved per seed
                recs, acc = run_mode(mode, steps, args.lr, workdir, seed, args.task, settings)
                curves[mode].append(recs)
                accuracies[mode].append(acc)

    results = {mode: [figures(recs, last, acc) for recs, acc in zip(runs, accuracies[mode])]
               for mode, runs in curves.items()}
    label = f"last {last}"
    rows = settings["prompts"] * settings["slots"]
    print(f"\nFair Cast lag: {args.task} task, fp32 master, AdamW lr {args.lr:g} constant, {steps} steps, "
          f"{rows} rows/step, seeds {' '.join(map(str, args.seeds))}; lag in steps along the EMA update direction "
          f"(signed: mean of per-step values; |lag|: mean of per-step absolute values); reward = sampled "
          f"correctness on the training batch; held-out acc = sampled, {settings['eval_problems']} problems, after "
          "the last step")
    print("per seed:")
    print(f"{'mode':<16}{'seed':>5}" + "".join(f"{name.replace('last 20', label):>22}" for _, name, _ in COLUMNS)
          + f"{'max err ulps':>14}")
    for mode in MODES:
        for seed, fig in zip(args.seeds, results[mode]):
            print(f"{mode:<16}{seed:>5}" + "".join(f"{format(fig[k], f):>22}" for k, _, f in COLUMNS)
                  + f"{fig['max_err_ulps']:>14.3f}")
    print(f"\nacross {len(args.seeds)} seeds: mean ± std [min, max]")
    print(f"{'mode':<16}" + "".join(f"{name.replace('last 20', label):>34}" for _, name, _ in COLUMNS))
    for mode in MODES:
        print(f"{mode:<16}" + "".join(f"{spread([fig[k] for fig in results[mode]], f):>34}" for k, _, f in COLUMNS))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4))
    for (mode, runs), color in zip(curves.items(), ("C0", "C1", "C2")):
        for i, recs in enumerate(runs):
            kw = dict(color=color, alpha=0.6, lw=1, label=mode if i == 0 else None)
            ax1.plot([r["step"] for r in recs], [r.get("fair_cast/lag_steps") for r in recs], **kw)
            ax2.plot([r["step"] for r in recs], [r["fair_cast/visible_update_frac"] for r in recs], **kw)
            ax3.plot([r["step"] for r in recs], [r.get(REWARD) for r in recs], **kw)
    ax1.set(title=f"served-copy lag (steps, signed), AdamW lr {args.lr:g}, {len(args.seeds)} seeds", xlabel="step")
    ax2.set(title="fraction of served weights changed per export", xlabel="step", yscale="log")
    ax3.set(title=f"training reward (sampled correctness), {args.task} task", xlabel="step")
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=100)
    print(f"plot: {args.output}")

    ratios, excluded = [], []
    for seed, rtn, sr in zip(args.seeds, results["rtn"], results["stochastic"]):
        if sr["abs_lag_last"] > 0:  # a measured nonzero denominator only
            ratios.append(rtn["abs_lag_last"] / sr["abs_lag_last"])
        else:
            excluded.append(seed)
            print(f"seed {seed}: stochastic |lag| ({label}) is 0, rtn {rtn['abs_lag_last']:.3f}: no ratio")
    print(f"rtn |lag| / stochastic |lag| ({label}), per seed: {', '.join(f'{r:.2f}' for r in ratios)}; "
          f"{spread(ratios, '.2f') if ratios else 'none'} over {len(ratios)} seeds"
          + (f" ({len(excluded)} excluded: seed {', '.join(map(str, excluded))})" if excluded else ""))
    print(f"rtn_lag_over_sr_lag: {statistics.mean(ratios):.2f}" if ratios else "rtn_lag_over_sr_lag: n/a")


if __name__ == "__main__":
    main()

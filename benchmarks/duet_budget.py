"""DUET's token budget vs full-budget GRPO, on a built-in task, from the same start and seeds.

For each seed (>= 5; default 0-4) and each arm -- GRPO (duet off), DUET β=1.0, β=0.5, β=0.3 -- GRPO trains the task's
embedded model for `--steps` steps (fp32 master and fp32 activations, CPU, constant lr) on a pool of `--pool`
problems (prompts recur, so DUET's per-prompt surrogate gets warm); the seed sets the trainer seed, the data order and
the pool, and is shared by the arms (paired, interleaved per seed). Every `--eval-every` steps the policy's sampled
accuracy (temperature 1) on held-out problems is measured, outside the timed region.

    --task arithmetic  (default) the demo task: 7-token answers, 16 prompts x 8 slots, 200 steps, target 0.45
    --task reasoning   chained arithmetic written step by step (~30-155 tokens, longer for harder prompts; rollouts
                       that lose the thread run to the cap): the task where the marker-gated abort has work to do

Per seed and arm: rollout tokens generated and training wall-clock (optimizer steps only: generation, scoring and
the update) until the held-out accuracy first reaches `--target` ("not reached" if it never does within `--steps`),
the final held-out accuracy at equal steps, the total rollout tokens and how many rollouts the marker gate aborted.
Per arm across seeds: mean ± std (sample std) [min, max], over the seeds that reached the target for the to-target
figures, over all seeds otherwise. A PNG shows accuracy against rollout tokens.

    python benchmarks/duet_budget.py [--task reasoning] [--seeds 0 1 2 3 4] [--steps N] [--target ACC]
    python benchmarks/duet_budget.py --quick [--task reasoning]   # smoke run: 1 seed x 4 steps, not meaningful

Last line: `duet05_tokens_to_target_over_grpo: <number>` -- per seed, DUET β=0.5's rollout tokens to target over
GRPO's (same seed), the mean over the seeds where both reached it (goal <= 0.5), or `n/a` when on some seed only one
of the two did (that seed is then a bound, printed on the line before with the spread; same lines for the other arms
and for wall-clock).

**On the real model** (``--model smollm2``: SmolLM2-135M-Instruct on ``chat_math``, full fine-tuning, fp32 like
``benchmarks/smollm2_learning.py``, lr 5e-6 constant, 2 prompts x 8 slots from a pool of ``--pool`` problems so
prompts recur and DUET's per-prompt statistics warm up, completions <= 96 tokens, checks and Fair Cast off so only
the token budget differs) the runs are long (~25 s a GRPO step on 2 cores), so they are resumable: each (seed, arm)
run checkpoints every ``--eval-every`` steps under ``--output-dir`` and resumes with
``resume_from_checkpoint="auto"``; every step's logged metrics (rollout tokens among them) and every held-out
evaluation (48 problems, sampled t = 1, at step 0 and every ``--eval-every`` steps) are appended to ``--jsonl``
(``benchmarks/_runlog.py``); finished runs are skipped, so rerun the same command after a stop. ``--report`` reads
the JSONL only: tokens and seconds to ``--target`` per seed and arm, final accuracy at equal steps, total tokens,
``reward_vs_tokens.png`` (held-out accuracy and training reward against rollout tokens, one line per arm: the mean
over seeds at each evaluation) and the same last line as above.

    python benchmarks/duet_budget.py --model smollm2 --seeds 0 1 2
    python benchmarks/duet_budget.py --model smollm2 --report [--target 0.6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _runlog import spread  # noqa: E402  (the benchmarks' one way to state a figure over seeds)

METHODS = {"grpo": {}, "duet_1.0": {"duet": True, "duet_budget": 1.0}, "duet_0.5": {"duet": True, "duet_budget": 0.5},
           "duet_0.3": {"duet": True, "duet_budget": 0.3},
           # shrinkage of each prompt's informativeness towards the mean of all groups (duet_prior_strength): run on
           # request (--arms), not by default
           "duet_0.5_shrink": {"duet": True, "duet_budget": 0.5, "duet_prior_strength": 1.0}}
DEFAULT_ARMS = ["grpo", "duet_1.0", "duet_0.5", "duet_0.3"]
# Per task: prompts per step, slots per prompt, learning rate, steps, problem pool, eval cadence, held-out problems,
# target accuracy. The reasoning task's rollouts are ~15x longer, so its runs are smaller to fit 20 runs on 2 cores.
TASKS = {
    "arithmetic": dict(prompts=16, slots=8, lr=1e-4, steps=200, pool=256, eval_every=10, eval_problems=256,
                       target=0.45),
    # lr 3e-5: 1e-4 lowered the reasoning model's accuracy within 20 steps (AdamW noise on 805k weights), 2e-5 and
    # below left it flat over 30 steps; 3e-5 raised it 0.32 -> 0.375 over 60 steps (one probe, seed 0)
    "reasoning": dict(prompts=8, slots=8, lr=3e-5, steps=40, pool=128, eval_every=5, eval_problems=128,
                      target=0.36),
}


def _callback(task, eval_every: int, eval_problems: int, record: dict):
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
            record["train_time"] += time.perf_counter() - self.t0
            if state.global_step % eval_every == 0:
                acc = task.accuracy(model, processing_class, num_problems=eval_problems, seed=4321)
                record["evals"].append((state.global_step, record["tokens"], record["train_time"], acc))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs:
                return
            if "duet/tokens" in logs:
                record["tokens"] += logs["duet/tokens"]
                groups = args.per_device_train_batch_size // args.num_generations
                rollouts = logs["duet/rollouts_per_prompt/mean"] * groups
                record["rollouts"] += rollouts
                record["aborted"] += logs["duet/abort_frac"] * rollouts
            elif "completions/mean_length" in logs:
                record["tokens"] += logs["completions/mean_length"] * args.per_device_train_batch_size
                record["rollouts"] += args.per_device_train_batch_size

    return Recorder()


def run(method: str, seed: int, task_name: str, settings: dict, workdir: str) -> dict:
    from transformers.trainer_callback import PrinterCallback

    import trl_fp8
    from trl_fp8.app.demo.tasks import demo_task

    task = demo_task(task_name)
    s = settings
    args = trl_fp8.GRPOConfig(
        output_dir=os.path.join(workdir, f"{method}-{seed}"), use_cpu=True, bf16=False, max_steps=s["steps"],
        learning_rate=s["lr"], lr_scheduler_type="constant", per_device_train_batch_size=s["prompts"] * s["slots"],
        num_generations=s["slots"], max_completion_length=task.max_completion_length, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, gradient_checkpointing=False, seed=seed,
        data_seed=seed, reward_weights=list(task.reward_weights), duet_markers=list(task.duet_markers),
        **METHODS[method],
    )
    record = {"tokens": 0.0, "rollouts": 0.0, "aborted": 0.0, "train_time": 0.0, "evals": []}
    trainer = trl_fp8.GRPOTrainer(
        model=task.model_path(), reward_funcs=list(task.reward_funcs), args=args,
        train_dataset=task.make_dataset(s["pool"], seed=100 + seed),
        callbacks=[_callback(task, s["eval_every"], s["eval_problems"], record)],
    )
    trainer.remove_callback(PrinterCallback)
    start_acc = task.accuracy(trainer.model, trainer.processing_class, num_problems=s["eval_problems"], seed=4321)
    record["evals"].insert(0, (0, 0.0, 0.0, start_acc))
    trainer.train()
    return record


def first_reaching(evals, target):
    for step, tokens, seconds, acc in evals:
        if acc >= target:
            return step, tokens, seconds
    return None


def paired_to_target(arm: str, what: str, target: float, rows) -> tuple[str, list[float], bool]:
    """``arm``'s ``what`` ("tokens" or "seconds") to ``target`` over GRPO's, per seed, from ``rows`` of ``(seed, arm
    hit, grpo hit, arm run total, grpo run total)`` (a hit: ``(step, tokens, seconds, acc)`` or None). Where both
    reached the target, a ratio; where one only did, a bound from the other's whole run -- a seed is never dropped
    silently. Returns the report line, the ratios, and whether some seed gave only a bound."""
    index = {"tokens": 1, "seconds": 2}[what]
    ratios, bounds, neither = [], [], []
    for seed, h, g, total, grpo_total in rows:
        if h and g and g[index] > 0:
            ratios.append(h[index] / g[index])
        elif g and g[index] > 0:  # the arm did not reach the target: its whole run is a lower bound
            bounds.append(f"seed {seed} >= {total / g[index]:.2f}")
        elif h and grpo_total > 0:  # GRPO did not reach it within the run, the arm did: an upper bound
            bounds.append(f"seed {seed} <= {h[index] / grpo_total:.2f}")
        else:
            neither.append(str(seed))
    line = (f"{arm} / grpo {what} to target {target}, per seed where both reached it: "
            f"{', '.join(f'{x:.2f}' for x in ratios) or 'none'}; {spread(ratios, '.2f')}"
            + (f"; reached by one of the two only (bounds): {', '.join(bounds)}" if bounds else "")
            + (f"; seeds {', '.join(neither)}: neither reached it (or GRPO at step 0)" if neither else ""))
    return line, ratios, bool(bounds)


REAL = dict(prompts=2, slots=8, lr=5e-6, steps=20, pool=16, eval_every=4, eval_problems=48, target=0.6)
REAL_KEYS = ("bench", "model", "arm", "seed", "steps", "pool")
REWARD_KEY = "rewards/correctness_reward/mean"
REAL_JSONL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "duet_smollm2.jsonl")


def run_real(arm: str, seed: int, settings: dict, jsonl: str, output_dir: str) -> None:
    """One resumable SmolLM2 run (see the module docstring); returns at once if ``jsonl`` says it is done."""
    import _runlog
    from transformers.trainer_callback import PrinterCallback

    import trl_fp8
    from trl_fp8.app.demo.tasks import demo_task

    s = settings
    key = {"bench": "duet", "model": "trl-fp8:smollm2", "arm": arm, "seed": seed, "steps": s["steps"],
           "pool": s["pool"]}
    if _runlog.is_done(jsonl, key):
        return
    task = demo_task("chat_math")
    out = os.path.join(output_dir, _runlog.run_name(key))
    args = trl_fp8.GRPOConfig(
        output_dir=out, use_cpu=True, bf16=False, max_steps=s["steps"], learning_rate=s["lr"],
        lr_scheduler_type="constant", per_device_train_batch_size=s["prompts"] * s["slots"],
        num_generations=s["slots"], max_completion_length=task.max_completion_length, logging_steps=1,
        save_strategy="steps", save_steps=s["eval_every"], save_total_limit=1, resume_from_checkpoint="auto",
        report_to="none", disable_tqdm=True, gradient_checkpointing=False, seed=seed, data_seed=seed,
        reward_weights=list(task.reward_weights), duet_markers=list(task.duet_markers), fair_cast="off",
        sync_checks="off", **METHODS[arm],
    )
    trainer = trl_fp8.GRPOTrainer(model=task.model_path(), reward_funcs=list(task.reward_funcs), args=args,
                                  train_dataset=task.make_dataset(s["pool"], seed=100 + seed))
    trainer.remove_callback(PrinterCallback)
    evaluate = _runlog.chat_math_heldout(trainer.processing_class, s["eval_problems"], greedy=False)
    trainer.add_callback(_runlog.recorder(jsonl, key, s["eval_every"], evaluate, _runlog.numeric))
    trainer.train()
    if trainer.state.global_step >= s["steps"]:
        _runlog.finish(jsonl, key, out)


def step_tokens(rec: dict, rows: int) -> float:
    """Rollout tokens one step generated: DUET's own count, else TRL's mean completion length x rows."""
    return rec["duet/tokens"] if "duet/tokens" in rec else rec["completions/mean_length"] * rows


def report_real(jsonl: str, target: float, plot: str) -> None:
    import _runlog

    runs = [r for r in _runlog.load_runs(jsonl, REAL_KEYS).values() if r["done"]]
    if not runs:
        raise SystemExit(f"{jsonl}: no finished run yet (run the benchmark first)")
    rows = REAL["prompts"] * REAL["slots"]
    curves = {}  # (arm, seed) -> [(step, tokens so far, seconds so far, held-out acc)]
    for r in runs:
        tokens = seconds = 0.0
        points = [(0, 0.0, 0.0, r["evals"][0]["heldout_sampled"])] if 0 in r["evals"] else []
        for step in sorted(r["steps"]):
            tokens += step_tokens(r["steps"][step], rows)
            seconds += r["steps"][step]["seconds"]
            if step in r["evals"]:
                points.append((step, tokens, seconds, r["evals"][step]["heldout_sampled"]))
        curves[r["key"]["arm"], r["key"]["seed"]] = dict(points=points, tokens=tokens, seconds=seconds, run=r)
    arms = [m for m in METHODS if any(a == m for a, _ in curves)]
    seeds = sorted({sd for _, sd in curves})
    steps = max(r["key"]["steps"] for r in runs)
    print(f"\nSmolLM2-135M-Instruct, chat_math, full fine-tuning, fp32, lr {REAL['lr']:g} constant, {steps} steps of "
          f"{REAL['prompts']} prompts x {REAL['slots']} slots, pool {runs[0]['key']['pool']}; held-out sampled accuracy"
          f" on {REAL['eval_problems']} problems every {REAL['eval_every']} steps; target {target}; seeds {seeds}; "
          "seconds = training wall-clock (generation + update), evaluations and checkpoints excluded")
    print("| arm | seed | tokens to target | seconds to target | step | final acc | total tokens | train s |")
    print("|---|---|---|---|---|---|---|---|")
    hits = {}
    for arm in arms:
        for seed in seeds:
            c = curves.get((arm, seed))
            if c is None:
                continue
            h = first_reaching(c["points"], target)
            hits[arm, seed] = h
            reach = f"{h[1]:,.0f} | {h[2]:.0f} | {h[0]}" if h else "not reached | not reached | -"
            print(f"| {arm} | {seed} | {reach} | {c['points'][-1][3]:.3f} | {c['tokens']:,.0f} | {c['seconds']:.0f} |")
    print("\nacross seeds (mean ± std [min, max] (n)); to-target figures over the seeds that reached it")
    print("| arm | reached | tokens to target | seconds to target | final acc | total tokens | train s |")
    print("|---|---|---|---|---|---|---|")
    for arm in arms:
        cs = [curves[arm, sd] for sd in seeds if (arm, sd) in curves]
        hs = [hits[arm, sd] for sd in seeds if hits.get((arm, sd))]
        print(f"| {arm} | {len(hs)}/{len(cs)} | {spread([h[1] for h in hs], ',.0f')} | "
              f"{spread([h[2] for h in hs], '.0f')} | {spread([c['points'][-1][3] for c in cs], '.3f')} | "
              f"{spread([c['tokens'] for c in cs], ',.0f')} | {spread([c['seconds'] for c in cs], '.0f')} |")
    headline = None
    for arm in [a for a in arms if a != "grpo"]:
        paired = [sd for sd in seeds if (arm, sd) in curves and ("grpo", sd) in curves]
        tok = [curves[arm, sd]["tokens"] / curves["grpo", sd]["tokens"] for sd in paired]
        dacc = [curves[arm, sd]["points"][-1][3] - curves["grpo", sd]["points"][-1][3] for sd in paired]
        print(f"{arm} / grpo at equal steps, per seed: total tokens {spread(tok, '.3f')}; final accuracy difference "
              f"({arm} − grpo) {spread(dacc, '+.3f')}")
        for what in ("tokens", "seconds"):
            per_seed = [(sd, hits.get((arm, sd)), hits.get(("grpo", sd)), curves[arm, sd][what],
                         curves["grpo", sd][what]) for sd in paired]
            line, ratios, bounded = paired_to_target(arm, what, target, per_seed)
            print(line)
            if arm == "duet_0.5" and what == "tokens" and ratios and not bounded:
                headline = statistics.mean(ratios)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4))
    for arm, color in zip(METHODS, ("C0", "C1", "C2", "C3", "C4")):
        cs = [curves[arm, sd] for sd in seeds if (arm, sd) in curves]
        if not cs:
            continue
        n = min(len(c["points"]) for c in cs)  # the evaluations every run of the arm has
        ax1.plot([statistics.mean(c["points"][i][1] for c in cs) for i in range(n)],
                 [statistics.mean(c["points"][i][3] for c in cs) for i in range(n)], color=color, lw=2, marker="o",
                 label=f"{arm} (mean of {len(cs)} seeds)")
        for c in cs:
            ax1.plot([p[1] for p in c["points"]], [p[3] for p in c["points"]], color=color, alpha=0.3, lw=1)
            cum, xs, ys = 0.0, [], []
            for st in sorted(c["run"]["steps"]):
                rec = c["run"]["steps"][st]
                cum += step_tokens(rec, rows)
                if REWARD_KEY in rec:  # a step where DUET planned no rollout logs no reward
                    xs.append(cum)
                    ys.append(rec[REWARD_KEY])
            ax2.plot(xs, ys, color=color, alpha=0.5, lw=1, label=arm if c is cs[0] else None)
    ax1.axhline(target, color="grey", ls="--", lw=1)
    ax1.set(xlabel="rollout tokens generated", ylabel="held-out sampled accuracy",
            title=f"SmolLM2 chat_math: DUET vs GRPO ({len(seeds)} seeds)")
    ax2.set(xlabel="rollout tokens generated", ylabel="training reward (correctness)", title="per seed, per step")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(plot, dpi=100)
    print(f"plot: {plot}")
    print(f"duet05_tokens_to_target_over_grpo: {headline:.2f}" if headline is not None
          else "duet05_tokens_to_target_over_grpo: n/a")


def main_real(args) -> None:
    settings = dict(REAL)
    for key in ("steps", "pool", "eval_every", "target"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    plot = args.output if args.output != "duet_budget.png" else "reward_vs_tokens.png"
    if args.report:
        report_real(args.jsonl, settings["target"], plot)
        return
    if len(args.seeds) < 3:
        raise SystemExit("give at least 3 seeds (--seeds)")
    for seed in args.seeds:
        for arm in [m for m in METHODS if m in args.arms]:  # interleaved per seed
            run_real(arm, seed, settings, args.jsonl, args.output_dir)
    report_real(args.jsonl, settings["target"], plot)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=sorted(TASKS), default="arithmetic")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, help="default: per task")
    parser.add_argument("--pool", type=int, help="distinct training problems (prompts recur); default: per task")
    parser.add_argument("--eval-every", type=int, help="default: per task")
    parser.add_argument("--target", type=float, help="held-out sampled accuracy to reach; default: per task")
    parser.add_argument("--arms", nargs="+", choices=list(METHODS), default=DEFAULT_ARMS)
    parser.add_argument("--output", default="duet_budget.png")
    parser.add_argument("--quick", action="store_true", help="smoke run: seed 0, 4 steps (not meaningful)")
    parser.add_argument("--model", choices=["embedded", "smollm2"], default="embedded",
                        help="smollm2: the real model on chat_math, resumable (see above)")
    parser.add_argument("--jsonl", default=REAL_JSONL, help="--model smollm2: the raw records")
    parser.add_argument("--output-dir", default="runs/duet_smollm2", help="--model smollm2: checkpoints")
    parser.add_argument("--report", action="store_true", help="--model smollm2: tables and plot from --jsonl")
    args = parser.parse_args()
    if "grpo" not in args.arms:
        parser.error("--arms must include grpo (the baseline of every ratio)")
    if args.model == "smollm2":
        main_real(args)
        return
    settings = dict(TASKS[args.task])
    for key in ("steps", "pool", "eval_every", "target"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    if args.quick:  # one seed: the smoke run checks that every arm runs and reports, not the spread (CI time)
        args.seeds = [0]
        settings.update(steps=4, eval_every=2, pool=64, prompts=4, eval_problems=32)
    elif len(args.seeds) < 5:
        parser.error("give at least 5 seeds")
    methods = [m for m in METHODS if m in args.arms]
    target = settings["target"]

    results = {m: [] for m in methods}
    with tempfile.TemporaryDirectory() as workdir:
        for seed in args.seeds:
            for method in methods:  # interleaved per seed
                results[method].append(run(method, seed, args.task, settings, workdir))
    hits = {m: [first_reaching(r["evals"], target) for r in runs] for m, runs in results.items()}

    print(f"\ntask {args.task}; target held-out accuracy {target} (start {results['grpo'][0]['evals'][0][3]:.3f}); "
          f"seeds {' '.join(map(str, args.seeds))}; {settings['steps']} steps of {settings['prompts']} prompts x "
          f"{settings['slots']} slots; lr {settings['lr']:g}; pool {settings['pool']}; eval every "
          f"{settings['eval_every']} steps on {settings['eval_problems']} held-out problems; fp32 activations; "
          "seconds = training wall-clock (generation + update), 1 thread")
    print("per seed:")
    print(f"{'method':<10}{'seed':>5}{'tokens to target':>18}{'seconds to target':>19}{'step':>6}{'final acc':>11}"
          f"{'total tokens':>14}{'train s':>9}{'aborted':>9}{'rollouts':>10}")
    for method, runs in results.items():
        for seed, r, h in zip(args.seeds, runs, hits[method]):
            reach = (f"{h[1]:>18.0f}{h[2]:>19.1f}{h[0]:>6}" if h is not None
                     else f"{'not reached':>18}{'not reached':>19}{'-':>6}")
            print(f"{method:<10}{seed:>5}{reach}{r['evals'][-1][3]:>11.3f}{r['tokens']:>14.0f}"
                  f"{r['train_time']:>9.1f}{r['aborted']:>9.0f}{r['rollouts']:>10.0f}")

    print("\nacross seeds: mean ± std [min, max]; to-target figures over the seeds that reached the target")
    print(f"{'method':<10}{'reached':>8}{'tokens to target':>36}{'seconds to target':>28}{'final acc':>30}"
          f"{'total tokens':>38}{'total train s':>28}{'aborted / rollouts':>32}")
    for method, runs in results.items():
        reached = [h for h in hits[method] if h is not None]
        abort_frac = [r["aborted"] / r["rollouts"] for r in runs if r["rollouts"] > 0]
        print(f"{method:<10}{f'{len(reached)}/{len(runs)}':>8}{spread([h[1] for h in reached], ',.0f'):>36}"
              f"{spread([h[2] for h in reached], '.1f'):>28}{spread([r['evals'][-1][3] for r in runs], '.3f'):>30}"
              f"{spread([r['tokens'] for r in runs], ',.0f'):>38}{spread([r['train_time'] for r in runs], '.1f'):>28}"
              f"{spread(abort_frac, '.3f'):>32}")
    base = results["grpo"]
    for method in [m for m in methods if m != "grpo"]:  # at equal steps, per seed (paired)
        tokens = [r["tokens"] / g["tokens"] for r, g in zip(results[method], base) if g["tokens"] > 0]
        seconds = [r["train_time"] / g["train_time"] for r, g in zip(results[method], base) if g["train_time"] > 0]
        delta = [r["evals"][-1][3] - g["evals"][-1][3] for r, g in zip(results[method], base)]
        print(f"{method} / grpo at equal steps, per seed: total tokens {spread(tokens, '.3f')}, train seconds "
              f"{spread(seconds, '.3f')}, final accuracy difference (DUET − GRPO) {spread(delta, '.3f')}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (method, runs), color in zip(results.items(), ("C0", "C1", "C2", "C3")):
        for i, r in enumerate(runs):
            ax.plot([e[1] for e in r["evals"]], [e[3] for e in r["evals"]], color=color, alpha=0.7,
                    label=method if i == 0 else None)
    ax.axhline(target, color="grey", ls="--", lw=1)
    ax.set(xlabel="rollout tokens generated", ylabel="held-out sampled accuracy",
           title=f"DUET vs GRPO ({args.task} task, {len(args.seeds)} seeds)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=100)
    print(f"plot: {args.output}")

    headline = None
    for method in [m for m in methods if m != "grpo"]:
        for what, total in (("tokens", "tokens"), ("seconds", "train_time")):
            per_seed = [(seed, h, g, r[total], b[total])
                        for seed, h, g, r, b in zip(args.seeds, hits[method], hits["grpo"], results[method], base)]
            line, ratios, bounded = paired_to_target(method, what, target, per_seed)
            print(line)
            if method == "duet_0.5" and what == "tokens":
                headline = statistics.mean(ratios) if ratios and not bounded else None
    print(f"duet05_tokens_to_target_over_grpo: {headline:.2f}" if headline is not None
          else "duet05_tokens_to_target_over_grpo: n/a")


if __name__ == "__main__":
    main()

"""DUET's token budget vs full-budget GRPO on the demo task, from the same start and seeds.

For each seed (>= 5; default 0-4) and each arm -- GRPO (duet off), DUET β=1.0, DUET β=0.5 -- GRPO trains the
embedded demo model for `--steps` steps (16 prompts x 8 slots, lr 1e-4, fp32 master and fp32 activations, CPU) on
a pool of `--pool` problems (prompts recur, so DUET's per-prompt surrogate gets warm); the seed sets the trainer
seed, the data order and the pool, and is shared by the three arms (paired). Every `--eval-every` steps the
policy's sampled accuracy (temperature 1) on 256 held-out problems is measured, outside the timed region.

Per seed and arm: rollout tokens generated and training wall-clock (optimizer steps only) until the held-out
accuracy first reaches `--target` ("not reached" if it never does within `--steps`), and the final held-out
accuracy at equal steps. Per arm across seeds: mean ± std (sample std) [min, max], over the seeds that reached
the target for the to-target figures, over all seeds for the final accuracy. A PNG shows accuracy against rollout
tokens.

    python benchmarks/duet_budget.py [--seeds 0 1 2 3 4] [--steps 200] [--target 0.45] [--output duet_budget.png]
    python benchmarks/duet_budget.py --quick      # smoke run: 2 seeds x 4 steps, figures not meaningful

Last line: `duet05_tokens_to_target_over_grpo: <number>` -- per seed, DUET β=0.5's rollout tokens to target over
GRPO's (same seed), the mean over the seeds where both reached it (goal <= 0.5); its spread and the number of
seeds excluded are on the line before.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

METHODS = {"grpo": {}, "duet_1.0": {"duet": True, "duet_budget": 1.0}, "duet_0.5": {"duet": True, "duet_budget": 0.5}}


def _callback(eval_every: int, record: dict):
    from transformers import TrainerCallback

    from trl_fp8.demo.model import sampled_accuracy

    class Recorder(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
            record["train_time"] += time.perf_counter() - self.t0
            if state.global_step % eval_every == 0:
                acc = sampled_accuracy(model, processing_class, num_problems=256, seed=4321)
                record["evals"].append((state.global_step, record["tokens"], record["train_time"], acc))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs:
                return
            if "duet/tokens" in logs:
                record["tokens"] += logs["duet/tokens"]
            elif "completions/mean_length" in logs:
                record["tokens"] += logs["completions/mean_length"] * args.per_device_train_batch_size

    return Recorder()


def run(method: str, seed: int, steps: int, pool: int, eval_every: int, workdir: str) -> dict:
    from transformers.trainer_callback import PrinterCallback

    import trl_fp8
    from trl_fp8.demo.model import demo_model_path
    from trl_fp8.tasks.arithmetic import correctness_reward, format_reward, make_arithmetic_dataset

    args = trl_fp8.GRPOConfig(
        output_dir=os.path.join(workdir, f"{method}-{seed}"), use_cpu=True, bf16=False, max_steps=steps,
        learning_rate=1e-4, lr_scheduler_type="constant", per_device_train_batch_size=128, num_generations=8,
        max_completion_length=16, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        gradient_checkpointing=False, seed=seed, data_seed=seed, reward_weights=[1.0, 0.2], **METHODS[method],
    )
    record = {"tokens": 0.0, "train_time": 0.0, "evals": []}
    trainer = trl_fp8.GRPOTrainer(
        model=demo_model_path(), reward_funcs=[correctness_reward, format_reward], args=args,
        train_dataset=make_arithmetic_dataset(pool, seed=100 + seed), callbacks=[_callback(eval_every, record)],
    )
    trainer.remove_callback(PrinterCallback)
    start_acc = None
    from trl_fp8.demo.model import sampled_accuracy

    start_acc = sampled_accuracy(trainer.model, trainer.processing_class, num_problems=256, seed=4321)
    record["evals"].insert(0, (0, 0.0, 0.0, start_acc))
    trainer.train()
    return record


def spread(xs, fmt: str) -> str:
    """`mean ± std [min, max]` (sample std; 0 with one value), or `n/a` for no values."""
    if not xs:
        return "n/a"
    std = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{format(statistics.mean(xs), fmt)} ± {format(std, fmt)} [{format(min(xs), fmt)}, {format(max(xs), fmt)}]"


def first_reaching(evals, target):
    for step, tokens, seconds, acc in evals:
        if acc >= target:
            return step, tokens, seconds
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--pool", type=int, default=256, help="distinct training problems (prompts recur)")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--target", type=float, default=0.45, help="held-out sampled accuracy to reach")
    parser.add_argument("--output", default="duet_budget.png")
    parser.add_argument("--quick", action="store_true", help="smoke run: seeds 0 1, 4 steps (not meaningful)")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.steps, args.eval_every, args.pool = [0, 1], 4, 2, 64
    elif len(args.seeds) < 5:
        parser.error("give at least 5 seeds")

    results = {m: [] for m in METHODS}
    with tempfile.TemporaryDirectory() as workdir:
        for seed in args.seeds:
            for method in METHODS:  # interleaved per seed
                results[method].append(run(method, seed, args.steps, args.pool, args.eval_every, workdir))
    hits = {m: [first_reaching(r["evals"], args.target) for r in runs] for m, runs in results.items()}

    print(f"\ntarget held-out accuracy {args.target} (start {results['grpo'][0]['evals'][0][3]:.3f}); seeds "
          f"{' '.join(map(str, args.seeds))}; {args.steps} steps; pool {args.pool}; eval every {args.eval_every} "
          f"steps; fp32 activations; seconds = training wall-clock, 1 thread")
    print("per seed:")
    print(f"{'method':<10}{'seed':>5}{'tokens to target':>18}{'seconds to target':>19}{'step':>6}{'final acc':>11}"
          f"{'total tokens':>14}")
    for method, runs in results.items():
        for seed, r, h in zip(args.seeds, runs, hits[method]):
            reach = (f"{h[1]:>18.0f}{h[2]:>19.1f}{h[0]:>6}" if h is not None
                     else f"{'not reached':>18}{'not reached':>19}{'-':>6}")
            print(f"{method:<10}{seed:>5}{reach}{r['evals'][-1][3]:>11.3f}{r['tokens']:>14.0f}")

    print(f"\nacross seeds: mean ± std [min, max]; to-target figures over the seeds that reached the target")
    print(f"{'method':<10}{'reached':>8}{'tokens to target':>36}{'seconds to target':>28}{'final acc':>30}"
          f"{'total tokens':>36}")
    for method, runs in results.items():
        reached = [h for h in hits[method] if h is not None]
        print(f"{method:<10}{f'{len(reached)}/{len(runs)}':>8}{spread([h[1] for h in reached], ',.0f'):>36}"
              f"{spread([h[2] for h in reached], '.1f'):>28}{spread([r['evals'][-1][3] for r in runs], '.3f'):>30}"
              f"{spread([r['tokens'] for r in runs], ',.0f'):>36}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (method, runs), color in zip(results.items(), ("C0", "C1", "C2")):
        for i, r in enumerate(runs):
            ax.plot([e[1] for e in r["evals"]], [e[3] for e in r["evals"]], color=color, alpha=0.7,
                    label=method if i == 0 else None)
    ax.axhline(args.target, color="grey", ls="--", lw=1)
    ax.set(xlabel="rollout tokens generated", ylabel="held-out sampled accuracy",
           title=f"DUET vs GRPO (demo task, {len(args.seeds)} seeds)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=100)
    print(f"plot: {args.output}")

    headline = None
    for method in ("duet_1.0", "duet_0.5"):
        ratios, excluded = [], []
        for seed, h, g in zip(args.seeds, hits[method], hits["grpo"]):
            if h is not None and g is not None and g[1] > 0:  # both reached, measured nonzero denominator
                ratios.append(h[1] / g[1])
            else:
                missing = [name for name, x in ((method, h), ("grpo", g)) if x is None]
                excluded.append(f"seed {seed}: " + (f"{' and '.join(missing)} never reached the target" if missing
                                                    else "grpo reached it at 0 tokens"))
        why = f"; {len(excluded)} excluded ({'; '.join(excluded)})" if excluded else "; 0 excluded"
        print(f"{method} / grpo tokens to target, per seed: {', '.join(f'{x:.2f}' for x in ratios) or 'none'}; "
              f"{spread(ratios, '.2f')} over {len(ratios)} seeds{why}")
        headline = statistics.mean(ratios) if ratios else None
    print(f"duet05_tokens_to_target_over_grpo: {headline:.2f}" if headline is not None
          else "duet05_tokens_to_target_over_grpo: n/a")


if __name__ == "__main__":
    main()

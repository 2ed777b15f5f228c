"""DUET's token budget vs full-budget GRPO on the demo task, from the same start and seeds.

For each seed (>= 3) and each method -- GRPO (duet off), DUET β=1.0, DUET β=0.5 -- GRPO trains the embedded demo
model for `--steps` steps (16 prompts x 8 slots, lr 1e-4, fp32, CPU) on a pool of `--pool` problems (prompts
recur, so DUET's per-prompt surrogate gets warm). Every `--eval-every` steps the policy's sampled accuracy
(temperature 1) on 256 held-out problems is measured, outside the timed region. Reported per method (mean over
seeds): rollout tokens generated and training wall-clock until the held-out accuracy first reaches `--target`,
and the final held-out accuracy at equal steps. A PNG shows accuracy against rollout tokens.

    python benchmarks/duet_budget.py [--seeds 0 1 2] [--steps 200] [--target 0.45] [--output duet_budget.png]

Last line: `duet05_tokens_to_target_over_grpo: <number>` (goal <= 0.5).
"""

from __future__ import annotations

import argparse
import math
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


def first_reaching(evals, target):
    for step, tokens, seconds, acc in evals:
        if acc >= target:
            return step, tokens, seconds
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--pool", type=int, default=256, help="distinct training problems (prompts recur)")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--target", type=float, default=0.45, help="held-out sampled accuracy to reach")
    parser.add_argument("--output", default="duet_budget.png")
    args = parser.parse_args()
    if len(args.seeds) < 3:
        parser.error("give at least 3 seeds")

    results = {m: [] for m in METHODS}
    with tempfile.TemporaryDirectory() as workdir:
        for seed in args.seeds:
            for method in METHODS:  # interleaved per seed
                results[method].append(run(method, seed, args.steps, args.pool, args.eval_every, workdir))

    print(f"target held-out accuracy {args.target}; {len(args.seeds)} seeds; {args.steps} steps; pool {args.pool}")
    print(f"{'method':<10}{'reached':>9}{'tokens to target':>18}{'seconds to target':>19}{'final acc':>11}"
          f"{'total tokens':>14}")
    tokens_to_target = {}
    for method, runs in results.items():
        hits = [first_reaching(r["evals"], args.target) for r in runs]
        reached = [h for h in hits if h is not None]
        tok = statistics.mean(h[1] for h in reached) if reached else math.nan
        sec = statistics.mean(h[2] for h in reached) if reached else math.nan
        final = statistics.mean(r["evals"][-1][3] for r in runs)
        total = statistics.mean(r["tokens"] for r in runs)
        tokens_to_target[method] = tok
        print(f"{method:<10}{len(reached):>6}/{len(runs):<2}{tok:>18.0f}{sec:>19.1f}{final:>11.3f}{total:>14.0f}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (method, runs), color in zip(results.items(), ("C0", "C1", "C2")):
        for i, r in enumerate(runs):
            ax.plot([e[1] for e in r["evals"]], [e[3] for e in r["evals"]], color=color, alpha=0.7,
                    label=method if i == 0 else None)
    ax.axhline(args.target, color="grey", ls="--", lw=1)
    ax.set(xlabel="rollout tokens generated", ylabel="held-out sampled accuracy", title="DUET vs GRPO (demo task)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=100)
    print(f"plot: {args.output}")
    ratio = tokens_to_target["duet_0.5"] / tokens_to_target["grpo"]
    print(f"duet05_tokens_to_target_over_grpo: {ratio:.2f}")


if __name__ == "__main__":
    main()

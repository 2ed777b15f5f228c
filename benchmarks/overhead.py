"""Step-time overhead of trl_fp8.GRPOTrainer (every trl_fp8 feature off) over trl.GRPOTrainer.

On the embedded demo model and task, CPU. Runs are interleaved in pairs (trl then trl_fp8, then the
other way round, so machine noise and drift hit both alike); each run trains `--steps` GRPO steps and its time per step is the median
step time after the first (warm-up) step. The figure is the median over pairs of (trl_fp8 / trl).

    python benchmarks/overhead.py [--pairs 9] [--steps 40]

Last line: `overhead_ratio: <number>` (goal <= 1.02).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _step_timer():
    """A TrainerCallback that records the wall-clock time of each optimizer step in ``.times``."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self._t0)

    return StepTimer()


def one_run(flavour: str, steps: int, workdir: str) -> float:
    import trl

    import trl_fp8
    from trl_fp8.demo.model import demo_model_path
    from trl_fp8.tasks.arithmetic import correctness_reward, format_reward, make_arithmetic_dataset

    trainer_cls, config_cls = {
        "trl": (trl.GRPOTrainer, trl.GRPOConfig),
        "trl_fp8": (trl_fp8.GRPOTrainer, trl_fp8.GRPOConfig),
    }[flavour]
    args = config_cls(
        output_dir=os.path.join(workdir, flavour), use_cpu=True, bf16=False, max_steps=steps,
        learning_rate=1e-4, per_device_train_batch_size=64, num_generations=8, max_completion_length=16,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        gradient_checkpointing=False, seed=0,
    )
    timer = _step_timer()
    trainer = trainer_cls(
        model=demo_model_path(), reward_funcs=[correctness_reward, format_reward], args=args,
        train_dataset=make_arithmetic_dataset(2000, seed=0), callbacks=[timer],
    )
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return statistics.median(timer.times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=9, help="interleaved trl/trl_fp8 pairs (>= 5)")
    parser.add_argument("--steps", type=int, default=40, help="GRPO steps per run")
    args = parser.parse_args()
    if args.pairs < 5:
        parser.error("--pairs must be >= 5 (the figure is a median over pairs)")
    if args.steps < 3:
        parser.error("--steps must be >= 3")

    ratios = []
    with tempfile.TemporaryDirectory() as workdir:
        one_run("trl", 3, workdir)  # warm caches and imports before anything is timed
        for i in range(args.pairs):
            # Alternate which flavour goes first, so drift within a pair does not favour either.
            if i % 2 == 0:
                base = one_run("trl", args.steps, workdir)
                ours = one_run("trl_fp8", args.steps, workdir)
            else:
                ours = one_run("trl_fp8", args.steps, workdir)
                base = one_run("trl", args.steps, workdir)
            ratios.append(ours / base)
            print(f"pair {i + 1}: trl {base * 1e3:.1f} ms/step, trl_fp8 {ours * 1e3:.1f} ms/step, "
                  f"ratio {ours / base:.3f}", file=sys.stderr, flush=True)
    print(f"ratios: {', '.join(f'{r:.3f}' for r in ratios)}")
    print(f"overhead_ratio: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()

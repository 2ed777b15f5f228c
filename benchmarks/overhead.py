"""Step-time overhead of trl_fp8.GRPOTrainer (every trl_fp8 feature off) over trl.GRPOTrainer.

On the embedded demo model and task, CPU. Runs are interleaved in pairs (trl then trl_fp8, then the
other way round, so machine noise and drift hit both alike); each run trains `--steps` GRPO steps and its time per step is the median
step time after the first (warm-up) step. The figure is the median over pairs of (trl_fp8 / trl).

    python benchmarks/overhead.py [--pairs 9] [--steps 40]
    python benchmarks/overhead.py --model trl-fp8:smollm2 --pairs 5 --steps 4 --with-features

With ``--model trl-fp8:smollm2``: SmolLM2-135M-Instruct on the ``chat_math`` task in TRL's default precision
(``bf16=True``), 2 prompts x 4 generations of exactly ``--cap`` tokens (``min_new_tokens`` = the cap, so every arm
generates the same number of tokens whatever it samples: like for like). ``--with-features`` adds a third arm in
each repetition, trl_fp8 with Fair Cast SR and the default weight-sync checks, and its ratio to TRL.

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


DEMO = "trl-fp8:demo-model"


def one_run(flavour: str, steps: int, workdir: str, model: str = DEMO, cap: int = 48) -> float:
    import trl

    import trl_fp8

    trainer_cls, config_cls = {
        "trl": (trl.GRPOTrainer, trl.GRPOConfig),
        "trl_fp8": (trl_fp8.GRPOTrainer, trl_fp8.GRPOConfig),
        "trl_fp8_features": (trl_fp8.GRPOTrainer, trl_fp8.GRPOConfig),
    }[flavour]
    extra = dict(fair_cast="stochastic", sync_checks="default") if flavour == "trl_fp8_features" else {}
    if model == DEMO:
        from trl_fp8.app.demo.model import demo_model_path
        from trl_fp8.app.tasks.arithmetic import correctness_reward, format_reward, make_arithmetic_dataset

        shape = dict(bf16=False, learning_rate=1e-4, per_device_train_batch_size=64, num_generations=8,
                     max_completion_length=16)
        model_id, rewards, dataset = demo_model_path(), [correctness_reward, format_reward], make_arithmetic_dataset(
            2000, seed=0)
    else:
        from trl_fp8.models import resolve_model
        from trl_fp8.app.tasks.chat_math import boxed_format_reward, correctness_reward, make_chat_math_dataset

        shape = dict(bf16=True, learning_rate=5e-6, per_device_train_batch_size=8, num_generations=4,
                     max_completion_length=cap, generation_kwargs={"min_new_tokens": cap})
        model_id, rewards, dataset = resolve_model(model), [correctness_reward, boxed_format_reward], \
            make_chat_math_dataset(2000, seed=0)
    args = config_cls(
        output_dir=os.path.join(workdir, flavour), use_cpu=True, max_steps=steps, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, gradient_checkpointing=False, seed=0,
        **shape, **extra,
    )
    timer = _step_timer()
    trainer = trainer_cls(model=model_id, reward_funcs=rewards, args=args, train_dataset=dataset, callbacks=[timer])
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return statistics.median(timer.times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=9, help="interleaved trl/trl_fp8 pairs (>= 5)")
    parser.add_argument("--steps", type=int, default=40, help="GRPO steps per run")
    parser.add_argument("--model", default=DEMO, help="trl-fp8:demo-model (default) or e.g. trl-fp8:smollm2")
    parser.add_argument("--cap", type=int, default=48, help="tokens per completion (fixed) with --model")
    parser.add_argument("--with-features", action="store_true",
                        help="a third arm: trl_fp8 with Fair Cast SR and the default checks")
    args = parser.parse_args()
    if args.pairs < 5:
        parser.error("--pairs must be >= 5 (the figure is a median over pairs)")
    if args.steps < 3:
        parser.error("--steps must be >= 3")

    flavours = ["trl", "trl_fp8"] + (["trl_fp8_features"] if args.with_features else [])
    ratios, feature_ratios = [], []
    with tempfile.TemporaryDirectory() as workdir:
        one_run("trl", 3, workdir, args.model, args.cap)  # warm caches and imports before anything is timed
        for i in range(args.pairs):
            # Rotate which flavour goes first, so drift within a repetition does not favour any.
            order = flavours[i % len(flavours):] + flavours[:i % len(flavours)]
            times = {f: one_run(f, args.steps, workdir, args.model, args.cap) for f in order}
            ratios.append(times["trl_fp8"] / times["trl"])
            if args.with_features:
                feature_ratios.append(times["trl_fp8_features"] / times["trl"])
            print(f"repetition {i + 1}: " + ", ".join(f"{f} {t * 1e3:.1f} ms/step" for f, t in times.items())
                  + f", trl_fp8/trl {ratios[-1]:.3f}", file=sys.stderr, flush=True)
    print(f"model {args.model}: median step time after the first, {args.steps} steps per run, {args.pairs} "
          "interleaved repetitions")
    if feature_ratios:
        print(f"with Fair Cast SR + default checks / trl: {', '.join(f'{r:.3f}' for r in feature_ratios)}; "
              f"median {statistics.median(feature_ratios):.3f}")
    print(f"ratios: {', '.join(f'{r:.3f}' for r in ratios)}")
    print(f"overhead_ratio: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()

"""Rebuild the embedded reasoning model (trl_fp8/assets/reasoning_model) from scratch, offline, on CPU.

    python examples/train_reasoning_model.py [--steps N] [--seed 0] [--output-dir trl_fp8/assets/reasoning_model]

The character-level tokenizer, a 4-layer Qwen2 (hidden 128, head_dim 32) and a supervised warm-up on the chained
arithmetic task (trl_fp8.app.tasks.reasoning), stopped early and label-smoothed on purpose: greedy decoding is mostly
right, a sample at temperature 1 only sometimes, and a few samples lose the thread and run to the length cap. The
held-out measurements (accuracy by number of terms, completion lengths, capped fraction, training time) are printed
and written to warmup.json beside the model.
"""

import argparse

from trl_fp8.app.demo.reasoning_model import REASONING_MODEL_DIR, ReasoningWarmupSettings, train_reasoning_model


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=ReasoningWarmupSettings.steps)
    parser.add_argument("--batch-size", type=int, default=ReasoningWarmupSettings.batch_size)
    parser.add_argument("--label-smoothing", type=float, default=ReasoningWarmupSettings.label_smoothing)
    parser.add_argument("--eval-problems", type=int, default=ReasoningWarmupSettings.eval_problems)
    parser.add_argument("--seed", type=int, default=ReasoningWarmupSettings.seed)
    parser.add_argument("--output-dir", default=str(REASONING_MODEL_DIR))
    args = parser.parse_args()
    settings = ReasoningWarmupSettings(steps=args.steps, batch_size=args.batch_size,
                                       label_smoothing=args.label_smoothing, eval_problems=args.eval_problems,
                                       seed=args.seed)
    summary = train_reasoning_model(args.output_dir, settings)
    print(f"saved to {args.output_dir}: sampled accuracy {summary['sampled_accuracy_t1']:.3f}, greedy "
          f"{summary['greedy_accuracy']:.3f}, {summary['num_parameters']} parameters, "
          f"{summary['train_seconds']:.0f} s of training")


if __name__ == "__main__":
    main()

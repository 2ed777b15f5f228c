"""Rebuild the embedded demo model (trl_fp8/assets/demo_model) from scratch, offline, on CPU.

    python examples/train_demo_model.py [--steps 600] [--seed 0] [--output-dir trl_fp8/assets/demo_model]

A character-level tokenizer, a 2-layer Qwen2 (head_dim 32) and a short supervised warm-up on the
arithmetic task, stopped early on purpose so that GRPO starts from a policy that sometimes succeeds.
"""

import argparse

from trl_fp8.app.demo.model import DEMO_MODEL_DIR, WarmupSettings, train_demo_model


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=WarmupSettings.steps)
    parser.add_argument("--seed", type=int, default=WarmupSettings.seed)
    parser.add_argument("--output-dir", default=str(DEMO_MODEL_DIR))
    args = parser.parse_args()
    summary = train_demo_model(args.output_dir, WarmupSettings(steps=args.steps, seed=args.seed))
    print(f"saved to {args.output_dir}: {summary}")


if __name__ == "__main__":
    main()

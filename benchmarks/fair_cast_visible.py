"""What fraction of the served bf16 weights an optimizer step changes, per Fair Cast export rule, on a real model.

Full fine-tuning of SmolLM2-135M-Instruct (``trl-fp8:smollm2``) on the ``chat_math`` task in TRL's default precision
(``bf16=True``: bf16 autocast over fp32 masters, a bf16 served copy generating the rollouts), AdamW at each
``--lrs`` (constant), ``--steps`` steps per run, for RTN, stochastic rounding and error feedback from the same start
(same seed, data and first rollouts). Per run: ``fair_cast/visible_update_frac`` (the fraction of served elements
the step's export changed) and ``fair_cast/lag_steps`` (the served copy's lag along the master's recent update
direction, in steps; see ``benchmarks/fair_cast_lag.py``), mean over the steps. This is the mechanism Fair Cast
exists for — how much of each update reaches the sampler; whether it changes learning is
``benchmarks/fair_cast_lag.py --task chat_math`` (long runs).

    python benchmarks/fair_cast_visible.py [--lrs 1e-6 5e-6] [--steps 4] [--seed 0] [--jsonl FILE]

Last line: ``rtn_visible_frac_at_1e-06: <fraction>`` (the first learning rate given).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

from fair_cast_lag import MODES, TASKS, run_mode  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 5e-6])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step (x 4 generations)")
    parser.add_argument("--cap", type=int, default=64, help="max_completion_length")
    parser.add_argument("--jsonl", default=None)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2")
    settings = dict(TASKS["chat_math"], prompts=args.prompts, slots=4)
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for lr in args.lrs:
            for mode in MODES:
                recs, _ = run_mode(mode, args.steps, lr, workdir, args.seed, "chat_math", settings, evaluate=False)
                visible = [r["fair_cast/visible_update_frac"] for r in recs]
                lag = [r["fair_cast/lag_steps"] for r in recs if r.get("fair_cast/lag_steps") is not None]
                row = {"model": "trl-fp8:smollm2", "lr": lr, "mode": mode, "seed": args.seed, "steps": args.steps,
                       "rows_per_step": args.prompts * 4, "visible_per_step": visible, "lag_per_step": lag,
                       "visible_mean": sum(visible) / len(visible),
                       "abs_lag_mean": sum(abs(x) for x in lag) / len(lag) if lag else None}
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.jsonl:
                    with open(args.jsonl, "a") as f:
                        f.write(json.dumps(row) + "\n")
    print(f"\nSmolLM2-135M full fine-tuning, bf16=True (bf16 served), AdamW constant, {args.steps} steps, seed "
          f"{args.seed}: fraction of served weights each step's export changes (mean over steps) | mean |lag| (steps)")
    print(f"{'lr':>8} | " + " | ".join(f"{m:>26}" for m in MODES))
    for lr in args.lrs:
        cells = []
        for mode in MODES:
            r = next(x for x in rows if x["lr"] == lr and x["mode"] == mode)
            lag = "n/a" if r["abs_lag_mean"] is None else f"{r['abs_lag_mean']:.2f}"
            cells.append(f"{r['visible_mean']:>14.5f} | {lag:>9}")
        print(f"{lr:>8g} | " + " | ".join(f"{c:>26}" for c in cells))
    first = next(x for x in rows if x["lr"] == args.lrs[0] and x["mode"] == "rtn")
    print(f"rtn_visible_frac_at_{args.lrs[0]:g}: {first['visible_mean']:.5f}")


if __name__ == "__main__":
    main()

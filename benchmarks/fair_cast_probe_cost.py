"""What the Fair Cast probe costs: its own time against the optimizer step's, in the same runs.

The trainer as ``trl-fp8 demo --fair-cast off`` runs it (the embedded demo model, arithmetic, 16 prompts × 8, fp32 on
CPU), with the probe reading on every step (``fair_cast_probe=1``) so that each run gives many readings; the probe's
``begin()`` and ``end()`` are timed (``time.perf_counter``) and so is every optimizer step (the step's time includes
the probe's). Per run: the median probe time per reading and the median step time (the first step left out); the
cost at the default interval is ``probe / every / step``. ``--runs`` runs (seeds 0, 1, ...), the figure is the median
over runs. ``--model smollm2``: SmolLM2-135M-Instruct with LoRA r16 on chat_math (2 prompts × 8), as the probe reads
a LoRA run's factors.

    OMP_NUM_THREADS=1 python benchmarks/fair_cast_probe_cost.py --runs 5 --steps 30

Last line: ``fair_cast_probe_cost_share_of_step: <share at the default interval>``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def one_run(model: str, seed: int, steps: int, out: str) -> dict:
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback

    import trl_fp8
    from trl_fp8.app.demo.tasks import demo_task
    from trl_fp8.fair_cast_probe import core

    task = demo_task("arithmetic" if model == "demo" else "chat_math")
    prompts = 16 if model == "demo" else 2
    probe_times: list[float] = []
    begin, end = core.DroppedShare.begin, core.DroppedShare.end

    def timed_begin(self):
        t0 = time.perf_counter()
        begin(self)
        self._t = time.perf_counter() - t0

    def timed_end(self):
        t0 = time.perf_counter()
        share = end(self)
        probe_times.append(getattr(self, "_t", 0.0) + time.perf_counter() - t0)
        return share

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.t0)

    core.DroppedShare.begin, core.DroppedShare.end = timed_begin, timed_end
    try:
        args = trl_fp8.GRPOConfig(
            output_dir=out, use_cpu=True, bf16=False, max_steps=steps, learning_rate=task.demo_learning_rate,
            lr_scheduler_type="constant", per_device_train_batch_size=prompts * 8, num_generations=8,
            max_completion_length=task.max_completion_length, logging_steps=1, save_strategy="no", report_to="none",
            disable_tqdm=True, gradient_checkpointing=False, seed=seed, data_seed=seed, fair_cast="off",
            fair_cast_probe=1, reward_weights=list(task.reward_weights))
        peft = None
        if model == "smollm2":
            from peft import LoraConfig

            peft = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
        trainer = trl_fp8.GRPOTrainer(model=task.model_path(), reward_funcs=list(task.reward_funcs), args=args,
                                      train_dataset=task.make_dataset(2000, seed=seed), peft_config=peft)
        trainer.remove_callback(PrinterCallback)
        timer = StepTimer()
        trainer.add_callback(timer)
        elements = trainer.capability("fair_cast_probe").probe.elements
        trainer.train()
    finally:
        core.DroppedShare.begin, core.DroppedShare.end = begin, end
    return {"probe_s": statistics.median(probe_times), "step_s": statistics.median(timer.times[1:]),
            "elements": elements}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["demo", "smollm2"], default="demo")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    a = parser.parse_args()
    import torch

    from trl_fp8.fair_cast_probe.declaration import DEFAULT_EVERY

    torch.set_num_threads(1)
    rows = []
    for seed in range(a.runs):
        with tempfile.TemporaryDirectory() as out:
            r = one_run(a.model, seed, a.steps, out)
        share = r["probe_s"] / DEFAULT_EVERY / r["step_s"]
        rows.append(share)
        print(f"run {seed}: probe {r['probe_s'] * 1e3:.3f} ms a reading ({r['elements']} elements), step "
              f"{r['step_s'] * 1e3:.1f} ms (median of {a.steps - 1}); every {DEFAULT_EVERY} steps: {share:.4%} of a "
              "step", flush=True)
    print(f"{a.model}, {a.runs} runs of {a.steps} steps, one CPU thread; median over runs")
    print(f"fair_cast_probe_cost_share_of_step: {statistics.median(rows):.5f}")


if __name__ == "__main__":
    main()

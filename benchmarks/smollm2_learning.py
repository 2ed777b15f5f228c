"""Does plain GRPO teach SmolLM2-135M-Instruct (``trl-fp8:smollm2``) the ``chat_math`` task on 2 cores? Held-out
accuracy (sampled at t = 1 and greedy, on problems never trained on) at step 0 and every ``--eval-every`` steps of a
plain GRPO run (Fair Cast and the checks off: the baseline every other arm is compared with), full fine-tuning or
LoRA (r = 16, all linear).

Resumable: checkpoints every ``--eval-every`` steps in ``--output-dir`` (one kept) and ``resume_from_checkpoint=
"auto"``; each evaluation is appended to ``--jsonl`` as it is made and an evaluation already there is not redone, so
a stopped session loses at most the steps since the last checkpoint. Run it alone (2 cores).

    python benchmarks/smollm2_learning.py --adapters full --seed 0 --steps 60 \\
        --jsonl benchmarks/results/smollm2_learning.jsonl --output-dir runs/smollm2_learning

Last line: ``smollm2_heldout_sampled_gain: <last − first>`` for the run. ``--report --jsonl FILE`` prints the table
over every seed in FILE (mean ± std [min, max] per step) instead of training.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def load_done(path: str | None, key: dict) -> dict[int, dict]:
    done = {}
    if path and os.path.isfile(path):
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                if all(row.get(k) == v for k, v in key.items()):
                    done[row["step"]] = row
    return done


def report(path: str) -> None:
    """Held-out accuracy per step across seeds (mean ± sample std [min, max]) for each setting in ``path``."""
    from _runlog import spread

    rows = [json.loads(line) for line in open(path) if line.strip()]
    settings = sorted({(r["adapters"], r["lr"], r["prompts"]) for r in rows})
    for adapters, lr, prompts in settings:
        mine = [r for r in rows if (r["adapters"], r["lr"], r["prompts"]) == (adapters, lr, prompts)]
        seeds = sorted({r["seed"] for r in mine})
        print(f"\n{adapters}, lr {lr:g}, {prompts} prompts x 8 generations per step; seeds {seeds}")
        print("| step | held-out sampled (t = 1) | held-out greedy | train minutes per seed |")
        print("|---|---|---|---|")
        for step in sorted({r["step"] for r in mine}):
            at = [r for r in mine if r["step"] == step]

            def cell(key):
                return spread([r[key] for r in at], ".2f", count=True)

            minutes = ", ".join(f"s{r['seed']}: {r['train_seconds_so_far'] / 60:.0f}"
                                for r in sorted(at, key=lambda r: r["seed"]))
            print(f"| {step} | {cell('heldout_sampled')} | {cell('heldout_greedy')} | {minutes} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", default="full", choices=["full", "lora"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--eval-problems", type=int, default=48)
    parser.add_argument("--lr", type=float, default=None, help="default: 5e-6 full, 1e-4 LoRA")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step (x 8 generations)")
    parser.add_argument("--output-dir", default="runs/smollm2_learning")
    parser.add_argument("--jsonl", default=None)
    parser.add_argument("--report", action="store_true",
                        help="print the learning-curve table from --jsonl (every seed of each setting) and exit")
    args = parser.parse_args()
    if args.report:
        if not args.jsonl:
            parser.error("--report reads --jsonl")
        report(args.jsonl)
        return

    import torch
    from _runlog import chat_math_heldout
    from transformers import AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback

    import trl_fp8
    from trl_fp8.app.tasks.chat_math import boxed_format_reward, correctness_reward, make_chat_math_dataset
    from trl_fp8.models import SMOLLM2, resolve_model

    lr = args.lr if args.lr is not None else (5e-6 if args.adapters == "full" else 1e-4)
    key = {"adapters": args.adapters, "seed": args.seed, "lr": lr, "prompts": args.prompts}
    done = load_done(args.jsonl, key)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(SMOLLM2))
    heldout = chat_math_heldout(tokenizer, args.eval_problems)
    start = time.perf_counter()

    def evaluate(model, step: int) -> None:
        if step in done:
            return
        was = model.training
        model.eval()
        t0 = time.perf_counter()
        with torch.no_grad():
            figures = heldout(model, step)
        model.train(was)
        row = {**key, "step": step, **figures,
               "eval_seconds": round(time.perf_counter() - t0, 1),
               "train_seconds_so_far": round(time.perf_counter() - start, 1)}
        done[step] = row
        print(json.dumps(row), flush=True)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(row) + "\n")

    class HeldOut(TrainerCallback):
        def on_train_begin(self, _args, state, control, model=None, **kwargs):
            if state.global_step == 0:
                evaluate(model, 0)

        def on_step_end(self, _args, state, control, model=None, **kwargs):
            if state.global_step % args.eval_every == 0:
                evaluate(model, state.global_step)

    peft_config = None
    if args.adapters == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)
    config = trl_fp8.GRPOConfig(
        output_dir=os.path.join(args.output_dir, f"{args.adapters}-s{args.seed}"), use_cpu=True, bf16=False,
        max_steps=args.steps, learning_rate=lr, lr_scheduler_type="constant", per_device_train_batch_size=8 *
        args.prompts, num_generations=8, max_completion_length=96, logging_steps=1, save_strategy="steps",
        save_steps=args.eval_every, save_total_limit=1, report_to="none", disable_tqdm=True, seed=args.seed,
        reward_weights=[1.0, 0.2], fair_cast="off", sync_checks="off", resume_from_checkpoint="auto",
    )
    trainer = trl_fp8.GRPOTrainer(model=SMOLLM2, reward_funcs=[correctness_reward, boxed_format_reward], args=config,
                                  train_dataset=make_chat_math_dataset(4000, seed=args.seed), peft_config=peft_config,
                                  callbacks=[HeldOut()])
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    steps = sorted(done)
    gain = done[steps[-1]]["heldout_sampled"] - done[steps[0]]["heldout_sampled"]
    print(f"smollm2_heldout_sampled_gain: {gain:+.3f}")


if __name__ == "__main__":
    main()

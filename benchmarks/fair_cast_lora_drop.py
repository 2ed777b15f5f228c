"""When does round-to-nearest start to drop LoRA updates? The share of each step's adapter update that
round-to-nearest into bf16 drops, over a LoRA run with Fair Cast off.

Setting: the trainer as users run it (``trl_fp8.GRPOTrainer``, TRL's generation in process), PEFT LoRA r = 16,
``lora_alpha`` 32, every block linear, no dropout, fp32 adapter masters (PEFT keeps factors over a 16/32-bit base in
fp32), AdamW at a constant ``--lrs``, ``fair_cast="off"`` and the Fair Cast probe on every step
(``fair_cast_probe=1``): ``fair_cast/rtn_dropped_frac`` is the share of the step's update (by magnitude) whose
round-to-nearest bf16 value did not move, over a fixed sample of the adapter factors (``trl_fp8.fair_cast_probe``: up
to 4096 elements of each of up to 64 factors; the demo model's 28 factors whole). Compute in fp32 (``bf16=False``):
the probe asks what a bf16 sampler's copy would drop of the updates this run makes; it does not change them.

Models: ``demo`` (the embedded 2-layer demo model, its arithmetic task, 16 prompts × 8 a step) and ``smollm2``
(SmolLM2-135M-Instruct, ``chat_math``, 2 prompts × 8 a step). Every step's record goes to ``--jsonl`` as it happens;
a (model, lr, seed) run checkpoints every 25 steps and resumes (``benchmarks/_runlog.py``); a finished run is skipped.

    OMP_NUM_THREADS=1 python benchmarks/fair_cast_lora_drop.py --model demo --steps 150
    OMP_NUM_THREADS=1 python benchmarks/fair_cast_lora_drop.py --model smollm2 --steps 100 --seeds 0
    python benchmarks/fair_cast_lora_drop.py --report

Per model and lr the report gives the share at steps 1, 10, 25, 50, 100, ... (mean ± std [min, max] over seeds) and
the first step from which the share stays at or above 50 % (the mean of 5 steps centred on it); its last line is the
headline ``rtn_drops_half_of_lora_update_from_step: <model> lr <lr>: <step>`` (``never`` within the run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

KEYS = ("bench", "model", "lr", "seed", "steps")
JSONL = os.path.join(HERE, "results", "fair_cast_lora_drop.jsonl")
REPORT = os.path.join(HERE, "results", "fair_cast_lora_drop.txt")
METRIC = "fair_cast/rtn_dropped_frac"
MODELS = {"demo": ("arithmetic", 16), "smollm2": ("chat_math", 2)}  # task, prompts a step
HALF = 0.5
WINDOW = 5


def run(model: str, lr: float, seed: int, steps: int, jsonl: str, output_dir: str) -> None:
    import _runlog
    from peft import LoraConfig
    from transformers.trainer_callback import PrinterCallback

    import trl_fp8
    from trl_fp8.app.demo.tasks import demo_task

    key = {"bench": "fair_cast_lora_drop", "model": model, "lr": lr, "seed": seed, "steps": steps}
    if _runlog.is_done(jsonl, key):
        return
    task_name, prompts = MODELS[model]
    task = demo_task(task_name)
    out = os.path.join(output_dir, _runlog.run_name(key))
    args = trl_fp8.GRPOConfig(
        output_dir=out, use_cpu=True, bf16=False, max_steps=steps, learning_rate=lr, lr_scheduler_type="constant",
        warmup_steps=0, optim="adamw_torch", per_device_train_batch_size=prompts * 8, num_generations=8,
        max_completion_length=task.max_completion_length, logging_steps=1, save_strategy="steps", save_steps=25,
        save_total_limit=1, resume_from_checkpoint="auto", report_to="none", disable_tqdm=True,
        gradient_checkpointing=False, seed=seed, data_seed=seed, fair_cast="off", fair_cast_probe=1,
        sync_checks="off", reward_weights=list(task.reward_weights),
    )
    peft = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = trl_fp8.GRPOTrainer(model=task.model_path(), reward_funcs=list(task.reward_funcs), args=args,
                                  train_dataset=task.make_dataset(8000, seed=seed), peft_config=peft)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(_runlog.recorder(jsonl, key, steps + 1, None, _runlog.numeric))
    trainer.train()
    if trainer.state.global_step >= steps:
        _runlog.finish(jsonl, key, out)


def half_step(shares: dict[int, float]) -> int | None:
    """The first step s from which the centred mean of ``WINDOW`` steps stays >= ``HALF`` to the end of the run."""
    steps = sorted(shares)
    smooth = {}
    for i, s in enumerate(steps):
        near = steps[max(0, i - WINDOW // 2): i + WINDOW // 2 + 1]
        smooth[s] = statistics.mean(shares[t] for t in near)
    for i, s in enumerate(steps):
        if all(smooth[t] >= HALF for t in steps[i:]):
            return s
    return None


def report(jsonl: str, out_path: str) -> list[str]:
    import _runlog

    runs = [r for r in _runlog.load_runs(jsonl, KEYS).values() if r["done"]]
    lines = []
    say = lines.append
    headline = []
    for model, lr in sorted({(r["key"]["model"], r["key"]["lr"]) for r in runs}):
        rs = sorted((r for r in runs if (r["key"]["model"], r["key"]["lr"]) == (model, lr)),
                    key=lambda r: r["key"]["seed"])
        curves = [{s: rec[METRIC] for s, rec in r["steps"].items() if rec.get(METRIC) is not None} for r in rs]
        steps = max(r["key"]["steps"] for r in rs)
        seconds = statistics.median(x["seconds"] for r in rs for x in r["steps"].values())
        say(f"## {model}, lr {lr:g}: LoRA r16 alpha 32 all-linear, fp32 masters, fp32 compute, {steps} steps, seeds "
            f"{[r['key']['seed'] for r in rs]}; median step {seconds:.2f} s (CPU, 1 thread)")
        say("")
        marks = [s for s in (1, 10, 25, 50, 75, 100, 150, 200, 300) if s <= steps]
        say("| step | " + " | ".join(str(s) for s in marks) + " |")
        say("|---|" + "---|" * len(marks))
        cells = []
        for s in marks:
            xs = [c[s] for c in curves if s in c]
            cells.append(_runlog.spread(xs, ".2f") if xs else "n/a")
        say("| share dropped | " + " | ".join(cells) + " |")
        halves = [half_step(c) for c in curves]
        say("")
        say(f"first step from which the share stays >= {HALF:.0%} (centred mean of {WINDOW} steps), per seed: "
            + ", ".join("never" if h is None else str(h) for h in halves))
        known = [h for h in halves if h is not None]
        summary = ("never" if not known else
                   (f"{statistics.median(known):g}" + ("" if len(known) == len(halves) else
                                                       f" ({len(known)} of {len(halves)} seeds)")))
        headline.append(f"{model} lr {lr:g}: {summary}")
        say("")
    say("rtn_drops_half_of_lora_update_from_step: " + "; ".join(headline))
    with open(out_path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="demo")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-5, 5e-5])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--jsonl", default=JSONL)
    parser.add_argument("--output-dir", default=os.path.join(os.path.dirname(HERE), "runs", "fair_cast_lora_drop"))
    parser.add_argument("--report", action="store_true")
    parser.add_argument("--report-file", default=REPORT)
    a = parser.parse_args()
    if a.report:
        print("\n".join(report(a.jsonl, a.report_file)))
        return
    import torch

    torch.set_num_threads(1)
    for lr in a.lrs:
        for seed in a.seeds:
            run(a.model, lr, seed, a.steps, a.jsonl, a.output_dir)
    print("\n".join(report(a.jsonl, a.report_file)))


if __name__ == "__main__":
    main()

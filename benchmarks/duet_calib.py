"""Calibrate the mixed-difficulty task (``trl_fp8.app.tasks.mixed_math``) on SmolLM2-135M-Instruct: sample
``--samples`` (>= 16) completions of every candidate prompt from the *starting* model, fp32, at the training
temperature and completion cap, and record per prompt how many were right, how many boxed an answer, and their
lengths. Then ``--build`` picks the training pool and the held-out set from the measured pass rates and writes them
with the task (``trl_fp8/app/tasks/mixed_math_calibration.json``).

One torch process, batched generation (``--prompts-per-batch`` prompts x ``--samples`` completions a batch),
resumable: each calibrated prompt is one JSONL record in ``--jsonl`` (appended and fsynced as it is done; prompts
already there are skipped on restart).

    OMP_NUM_THREADS=1 python benchmarks/duet_calib.py [--per-kind 40] [--samples 16]    # sample (resumable)
    python benchmarks/duet_calib.py --speed                                              # time one batch only
    python benchmarks/duet_calib.py --build [--pool 48] [--heldout 100]                 # write the calibration

The build (deterministic, seeded): prompts are banded by measured pass rate (easy >= 0.9, medium 0.2-0.8, hard <=
0.05, "between" the gaps 0.05-0.2 and 0.8-0.9). Medium prompts are scarce on this model (~8 % of the candidates),
so medium and between prompts together are the *informative* ones. The held-out set (``--heldout``, drawn first) is
half of the informative prompts, filled up with hard ones: no easy prompt. The pool (``--pool``) takes the other
informative prompts (at most half the pool) and easy and hard ones (each band at least an eighth of the pool), in the
mix whose expected zero-variance fraction for plain GRPO with 8 rollouts (mean of p^8 + (1-p)^8 over the pool) is
nearest 50 % (to 0.01; ties: more informative prompts, then easy and hard alike); the build refuses one outside
40-60 %.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
JSONL = os.path.join(HERE, "results", "duet_calib_smollm2.jsonl")
# Candidates per kind (all of the two smallest kinds; more of the kinds likeliest to be medium). Sized from the speed
# measured on this 2-core machine: ~18 completion tokens/s wall-clock with one thread (shared), completions of ~20
# tokens on this example: ~15-20 s a prompt at 16 samples, 260 prompts in about 80 minutes.
CALIBRATION_COUNTS = {"add_one": 9, "add_small": 9, "add_1d": 40, "add_2d1d": 40, "sub_2d1d": 40, "add_2d2d": 30,
                      "mul_1d": 30, "mul_2d1d": 25, "add_3d3d": 15, "mul_2d2d": 15}


def load(path: str) -> dict:
    done = {}
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    if rec.get("kind_") == "prompt":
                        done[rec["id"]] = rec
    return done


def _as_list(x) -> list:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


def sample(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_fp8.app.tasks import mixed_math as mm
    from trl_fp8.models import resolve_model

    torch.set_num_threads(1)
    folder = resolve_model("trl-fp8:smollm2")
    tok = AutoTokenizer.from_pretrained(folder, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    eos = sorted({tok.eos_token_id} | set(_as_list(model.generation_config.eos_token_id)))  # as TRL stops
    pool = mm.candidates(args.per_kind if args.per_kind else CALIBRATION_COUNTS, seed=args.seed)
    done = load(args.jsonl)
    todo = [p for p in pool if p["id"] not in done]
    # interleave kinds so a partial calibration covers every kind
    todo.sort(key=lambda p: (int(p["id"].rsplit("-", 1)[1]), list(mm.KINDS).index(p["kind"])))
    if args.limit:
        todo = todo[:args.limit]
    if args.speed:
        todo = todo[:args.prompts_per_batch]
    print(f"{len(pool)} candidates, {len(done)} done, {len(todo)} to go", flush=True)
    for b in range(0, len(todo), args.prompts_per_batch):
        part = todo[b:b + args.prompts_per_batch]
        texts = [tok.apply_chat_template(mm.messages(p["question"]), add_generation_prompt=True, tokenize=False)
                 for p in part]
        torch.manual_seed(args.seed * 100_003 + b)
        t0 = time.perf_counter()
        new = mm.sample_completions(model, tok, texts, args.samples, args.cap, args.temperature, eos_token_ids=eos)
        seconds = time.perf_counter() - t0
        lengths = [len(ids) for ids in new]
        steps = max(lengths)
        completions = tok.batch_decode(new, skip_special_tokens=True)
        for i, p in enumerate(part):
            rows = range(i * args.samples, (i + 1) * args.samples)
            answers = [p["answer"]] * args.samples
            right = mm.correctness_reward([completions[r] for r in rows], answers)
            boxed = [mm.extract_boxed(completions[r]) is not None for r in rows]
            rec = {"kind_": "prompt", **p, "samples": args.samples, "passes": int(sum(right)),
                   "boxed": int(sum(boxed)), "lengths": [lengths[r] for r in rows], "cap": args.cap,
                   "temperature": args.temperature, "example": completions[rows[0]][:200]}
            if not args.speed:
                with open(args.jsonl, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
        timing = {"kind_": "timing", "rows": len(part) * args.samples, "decode_steps": steps,
                  "tokens": sum(lengths), "seconds": round(seconds, 2),
                  "tokens_per_s": round(sum(lengths) / seconds, 1), "threads": torch.get_num_threads()}
        print(json.dumps(timing), flush=True)
        if args.speed:
            for i, p in enumerate(part):
                rows = range(i * args.samples, (i + 1) * args.samples)
                right = mm.correctness_reward([completions[r] for r in rows], [p["answer"]] * args.samples)
                print(p["question"], p["answer"], f"passes {int(sum(right))}/{args.samples}", "->",
                      repr(completions[rows[0]][:160]))
        else:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(timing) + "\n")


def build(args) -> None:
    from trl_fp8.app.tasks import mixed_math as mm

    done = load(args.jsonl)
    if not done:
        raise SystemExit(f"{args.jsonl}: nothing calibrated yet")
    rows = sorted(done.values(), key=lambda r: r["id"])
    for r in rows:
        r["pass_rate"] = r["passes"] / r["samples"]
        r["band"] = mm.band(r["pass_rate"])
    by_band = {b: [r for r in rows if r["band"] == b] for b in ("easy", "medium", "hard", "between")}
    print({b: len(v) for b, v in by_band.items()})
    rng = random.Random(args.seed)
    for v in by_band.values():
        rng.shuffle(v)
    # Held-out first: not easy. Medium prompts are scarce on this model (~8 % of candidates), so the "between" bands
    # (0.05-0.2 and 0.8-0.9) count with them as informative; half of the informative prompts go to the held-out set
    # (its signal), the other half stay for the pool (its learning), and hard prompts fill the held-out set up.
    informative = by_band["medium"] + by_band["between"]
    rng.shuffle(informative)
    n_inf = min(len(informative) // 2, args.heldout)
    n_hard = args.heldout - n_inf
    if n_hard > len(by_band["hard"]) - args.pool // 4:
        raise SystemExit(f"not enough prompts for {args.heldout} held-out ones: {len(informative)} informative, "
                         f"{len(by_band['hard'])} hard (a quarter of the pool's size stays for the pool)")
    heldout = informative[:n_inf] + by_band["hard"][:n_hard]
    rest = {"easy": by_band["easy"], "informative": informative[n_inf:], "hard": by_band["hard"][n_hard:]}
    best = None  # the mix whose expected zero-variance fraction is nearest 0.5, each band >= an eighth of the pool
    least = args.pool // 8
    for n_informative, n_easy in ((i, e) for i in range(least, min(len(rest["informative"]), args.pool // 2) + 1)
                                  for e in range(least, min(len(rest["easy"]), args.pool - i - least) + 1)):
        n_hard_pool = args.pool - n_informative - n_easy
        if n_hard_pool > len(rest["hard"]) or n_hard_pool < least:
            continue
        pool = rest["informative"][:n_informative] + rest["easy"][:n_easy] + rest["hard"][:n_hard_pool]
        z = mm.zero_variance_fraction([r["pass_rate"] for r in pool], 8)
        balance = -n_informative, abs(n_easy - n_hard_pool)  # ties: more informative, then easy and hard alike
        if best is None or (round(abs(z - 0.5), 2), balance) < (round(abs(best[0] - 0.5), 2), best[1]):
            best = (z, balance, n_easy, n_hard_pool, pool, n_informative)
    if best is None:
        raise SystemExit(f"not enough easy/hard prompts left for a pool of {args.pool}")
    z8, _, n_easy, n_hard_pool, train, n_informative = best
    train = list(train)
    rng.shuffle(train)
    z4 = mm.zero_variance_fraction([r["pass_rate"] for r in train], 4)
    n_med = sum(r["band"] == "medium" for r in heldout)
    print(f"pool {len(train)}: {n_easy} easy, {n_informative} informative (medium or between), {n_hard_pool} hard; "
          f"expected zero-variance fraction G=8 {z8:.3f}, G=4 {z4:.3f}; held-out {len(heldout)}: {n_inf} informative "
          f"({n_med} medium), {n_hard} hard; held-out mean pass rate "
          f"{statistics.mean(r['pass_rate'] for r in heldout):.3f}")
    if not 0.4 <= z8 <= 0.6:
        raise SystemExit(f"expected zero-variance fraction {z8:.3f} is outside 0.4-0.6")
    settings = {"model": "trl-fp8:smollm2", "precision": "fp32", "temperature": mm.TEMPERATURE,
                "cap": rows[0]["cap"], "samples": rows[0]["samples"], "per_kind": args.per_kind,
                "candidate_seed": args.seed, "build_seed": args.seed, "pool": args.pool, "heldout": args.heldout,
                "counts": CALIBRATION_COUNTS, "calibrated": len(rows),
                "script": "benchmarks/duet_calib.py", "expected_zero_variance_g8": round(z8, 4),
                "expected_zero_variance_g4": round(z4, 4)}
    keep = ("id", "kind", "question", "answer", "samples", "passes", "boxed")
    out = {"settings": settings,
           "prompts": [{**{k: r[k] for k in keep}, "mean_length": round(statistics.mean(r["lengths"]), 1),
                        "band": r["band"]} for r in rows],
           "train": [r["id"] for r in train], "heldout": [r["id"] for r in heldout]}
    with open(args.output, "w") as f:
        json.dump(out, f, indent=0)
        f.write("\n")
    print(f"wrote {args.output}")
    lengths = [x for r in rows for x in r["lengths"]]
    lengths.sort()
    print("lengths p10/p50/p90/max:", [lengths[int(q * (len(lengths) - 1))] for q in (0.1, 0.5, 0.9, 1.0)],
          f"capped {sum(x >= rows[0]['cap'] for x in lengths) / len(lengths):.3f}")
    for kind in mm.KINDS:
        ks = [r for r in rows if r["kind"] == kind]
        if ks:
            print(f"{kind:10s} n={len(ks):3d} mean pass {statistics.mean(r['pass_rate'] for r in ks):.3f} "
                  f"bands " + " ".join(f"{b}={sum(r['band'] == b for r in ks)}" for b in by_band))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-kind", type=int, default=None, help="candidate prompts per kind; default: "
                        "CALIBRATION_COUNTS")
    parser.add_argument("--samples", type=int, default=16, help="completions per prompt (>= 16)")
    parser.add_argument("--cap", type=int, default=None, help="max new tokens; default: the task's cap")
    parser.add_argument("--prompts-per-batch", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=None, help="default: the task's")
    parser.add_argument("--jsonl", default=JSONL)
    parser.add_argument("--limit", type=int, default=None, help="calibrate at most this many prompts this run")
    parser.add_argument("--speed", action="store_true", help="time one batch, write nothing")
    parser.add_argument("--build", action="store_true", help="write the calibration file from --jsonl")
    parser.add_argument("--pool", type=int, default=48, help="--build: training prompts")
    parser.add_argument("--heldout", type=int, default=100, help="--build: held-out prompts (not easy)")
    parser.add_argument("--output", default=None, help="--build: default the task's calibration file")
    args = parser.parse_args()
    from trl_fp8.app.tasks import mixed_math as mm

    args.cap = args.cap or mm.MAX_COMPLETION_LENGTH
    args.temperature = args.temperature if args.temperature is not None else mm.TEMPERATURE
    args.output = args.output or mm.CALIBRATION_FILE
    if args.samples < 16 and not args.speed:
        parser.error("--samples must be >= 16")
    if args.build:
        build(args)
    else:
        sample(args)


if __name__ == "__main__":
    main()

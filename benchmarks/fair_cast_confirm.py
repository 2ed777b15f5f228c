"""Fair Cast, confirmatory race: is stochastic rounding's gain the lag removed, or the noise it adds?

The exploratory runs (``fair_cast_lag.py --model smollm2 --inits bf16_grid --lrs 1e-6``, seeds 0-2) found RTN's
served policy frozen and SR's learning. Noise alone can help RL early, so this race adds an **equal-noise control**,
``fair_cast="rtn_noise"``: round-to-nearest plus zero-mean noise of one step to a neighbour with SR's average variance
(ulp²/6), centred on RTN — it keeps RTN's lag and adds SR's noise (``trl_fp8.fair_cast.rounding.rtn_plus_noise``).

**Pre-registered** (written into this file and docs/fair-cast.md, committed, before the first unit started; not to be
changed after seeing results):

- Setting: the one where SR won — SmolLM2-135M-Instruct (``trl-fp8:smollm2``), ``chat_math``, full fine-tuning in
  bf16 autocast (``bf16=True``) with the fp32 master starting on the bf16 grid, AdamW lr 1e-6 constant, ``STEPS`` = 30
  steps of 2 prompts x 8 generations, weight-sync checks off; held-out accuracy of the served policy on 48 problems
  (greedy and sampled at t = 1) at steps 0, 10, 20, 30 — ``fair_cast_lag.run_real`` exactly as the exploratory runs.
- Seeds: ``SEEDS`` = 3, 4, 5 (none used before). Arms: ``rtn``, ``stochastic``, ``error_feedback``, ``rtn_noise``,
  paired by seed (same data, prompts, and sampling streams at every evaluation).
- Primary outcome: greedy held-out accuracy at step 30 minus RTN's (and minus the control's), per seed; secondary:
  the area under the greedy held-out curve (trapezoid over steps 0-30, divided by 30: the curve's mean height).
- "X above Y": X − Y > 0 on every seed *and* the bootstrap 95 % interval of the mean difference (10,000 resamples
  over seeds, seed 0) has its lower bound above 0. Decision (``decide``), on the primary outcome, in this order:
  1. SR not above RTN -> **"not confirmed"** (SR's gain over RTN did not replicate on fresh seeds);
  2. SR above RTN + noise -> **"the gain is the lag removed"**;
  3. RTN + noise above RTN (so SR ≈ RTN + noise, both above RTN) -> **"noise"**;
  4. otherwise -> **"inconclusive"** (SR beats RTN, but neither the lag nor the noise is shown to explain it).
  Error feedback (the other unbiased rule, no noise) and the secondary outcome are reported beside, not decided on.
  Three seeds make a coarse bootstrap (with every difference positive its lower bound is about the smallest one); a
  difference of one problem in 48 is 0.021; both are said in the report.

Resumable: every (arm, seed) unit checkpoints every 10 steps under ``--output-dir`` and resumes with
``resume_from_checkpoint="auto"``; records go to ``--jsonl``; each start record carries the code's commit. Units run
in ``ORDER`` (seed by seed, so paired units finish together); ``--units`` picks some. One thread a process:

    OMP_NUM_THREADS=1 nohup python benchmarks/fair_cast_confirm.py >> runs/fair_cast_confirm.log 2>&1 &
    python benchmarks/fair_cast_confirm.py --report     # per-seed table, plot, decision

Last line of ``--report``: ``sr_minus_rtn_noise_greedy_step30: <mean> [lo, hi]`` (``n/a`` while no seed has both).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

# ---- pre-registered (see the docstring) --------------------------------------------------------------------------
SEEDS = (3, 4, 5)
ARMS = ("rtn", "stochastic", "error_feedback", "rtn_noise")
LR = 1e-6
STEPS = 30
EVAL_EVERY = 10
INIT = "bf16_grid"
ORDER = [(arm, seed) for seed in SEEDS for arm in ("rtn", "stochastic", "rtn_noise", "error_feedback")]
MODEL = "trl-fp8:smollm2-bf16grid"  # fair_cast_lag.INITS[INIT]: the records' model field
KEYS = ("bench", "model", "lr", "seed", "mode", "steps")
JSONL = os.path.join(HERE, "results", "fair_cast_confirm_smollm2.jsonl")
REPORT = os.path.join(HERE, "results", "fair_cast_confirm_smollm2.txt")
PLOT = os.path.join(HERE, "results", "fair_cast_confirm_smollm2.png")
DOCS_PLOT = os.path.join(os.path.dirname(HERE), "docs", "img", "fair_cast_confirm_smollm2.png")
ONE_PROBLEM = 1 / 48


def run_unit(arm: str, seed: int, jsonl: str, output_dir: str) -> None:
    from fair_cast_lag import run_real

    run_real(arm, seed, LR, STEPS, jsonl, output_dir, EVAL_EVERY, INIT)


# ---- outcomes and the decision ------------------------------------------------------------------------------------
def outcomes(runs: dict) -> dict[tuple[str, int], dict]:
    """Per finished (arm, seed): greedy at step STEPS, sampled at STEPS, and the greedy curve's area (mean height)."""
    out = {}
    for run in runs.values():
        k = run["key"]
        if not run["done"] or k["model"] != MODEL or k["lr"] != LR or k["steps"] != STEPS or k["seed"] not in SEEDS:
            continue
        evals = run["evals"]
        if STEPS not in evals or 0 not in evals:
            continue
        steps = sorted(evals)
        area = sum((b - a) * (evals[a]["heldout_greedy"] + evals[b]["heldout_greedy"]) / 2
                   for a, b in zip(steps, steps[1:])) / (steps[-1] - steps[0])
        out[k["mode"], k["seed"]] = {"greedy": evals[STEPS]["heldout_greedy"],
                                     "sampled": evals[STEPS]["heldout_sampled"], "area": area}
    return out


def differences(res: dict, a: str, b: str, field: str = "greedy") -> list[float]:
    """``a − b`` per seed where both finished (in seed order)."""
    return [res[a, s][field] - res[b, s][field] for s in SEEDS if (a, s) in res and (b, s) in res]


def interval(xs: list[float]) -> tuple[float, float] | None:
    from duet_race import bootstrap_mean

    return bootstrap_mean(xs) if len(xs) > 1 else None


def above(xs: list[float]) -> bool:
    """The pre-registered "above": positive on every seed (all three) and the bootstrap lower bound above 0."""
    iv = interval(xs)
    return len(xs) == len(SEEDS) and all(x > 0 for x in xs) and iv is not None and iv[0] > 0


def decide(res: dict) -> dict:
    """The pre-registered decision (see the docstring): ``{"pending": bool, "verdict": str, "why": str}``."""
    done = all((a, s) in res for a in ARMS for s in SEEDS)
    sr_rtn = differences(res, "stochastic", "rtn")
    sr_noise = differences(res, "stochastic", "rtn_noise")
    noise_rtn = differences(res, "rtn_noise", "rtn")

    def show(xs):
        iv = interval(xs)
        return (f"{', '.join(f'{x:+.3f}' for x in xs)} (mean {statistics.mean(xs):+.3f}"
                + (f", bootstrap 95 % [{iv[0]:+.3f}, {iv[1]:+.3f}])" if iv else ")")) if xs else "none"

    facts = f"SR − RTN {show(sr_rtn)}; SR − (RTN + noise) {show(sr_noise)}; (RTN + noise) − RTN {show(noise_rtn)}"
    if not done:
        return {"pending": True, "verdict": "pending", "why": f"pending: not every unit has finished. {facts}"}
    if not above(sr_rtn):
        verdict = "not confirmed"
    elif above(sr_noise):
        verdict = "the gain is the lag removed"
    elif above(noise_rtn):
        verdict = "noise"
    else:
        verdict = "inconclusive"
    return {"pending": False, "verdict": verdict, "why": f"{verdict}: {facts}"}


# ---- report -----------------------------------------------------------------------------------------------------
def _starts(jsonl: str) -> list[dict]:
    if not os.path.isfile(jsonl):
        return []
    with open(jsonl) as f:
        return [r for r in map(json.loads, filter(str.strip, f)) if r.get("kind") == "start"]


def report(jsonl: str = JSONL, plot: str | None = PLOT) -> list[str]:
    import _runlog

    lines = []
    say = lines.append
    runs = _runlog.load_runs(jsonl, KEYS)
    res = outcomes(runs)
    say(f"Fair Cast confirmatory race: SmolLM2-135M-Instruct, chat_math, full fine-tuning, bf16 autocast, fp32 master "
        f"from the bf16 grid, lr {LR:g}, {STEPS} steps of 2 prompts x 8, CPU 1 thread; seeds {list(SEEDS)} "
        "(pre-registered)")
    state = {}
    for run in runs.values():
        k = run["key"]
        if k["model"] == MODEL and k["lr"] == LR and k["steps"] == STEPS:
            state[k["mode"], k["seed"]] = "done" if run["done"] else f"partial ({max(run['steps'], default=0)} steps)"
    say("units (arm/seed): " + ", ".join(f"{a}/{s}: {state.get((a, s), 'not run')}" for a, s in ORDER))
    commits = sorted({r.get("commit") or "none" for r in _starts(jsonl)})
    say(f"code commits of the units' starts: {', '.join(commits) if commits else 'none yet'}")
    say("")
    say("| arm | seed | greedy, step 0 / 10 / 20 / 30 | sampled, step 0 / 10 / 20 / 30 | greedy area (mean height) | "
        "served weights changed a step | signed lag, last 5 steps | median step s |")
    say("|---|---|---|---|---|---|---|---|")
    for arm in ARMS:
        for seed in SEEDS:
            run = next((r for r in runs.values() if r["key"]["mode"] == arm and r["key"]["seed"] == seed
                        and r["key"]["model"] == MODEL and r["key"]["lr"] == LR and r["key"]["steps"] == STEPS), None)
            if run is None:
                continue
            ev = run["evals"]
            curve = " / ".join(f"{ev[s]['heldout_greedy']:.2f}" for s in sorted(ev))
            scurve = " / ".join(f"{ev[s]['heldout_sampled']:.2f}" for s in sorted(ev))
            st = run["steps"]
            vis = [x["fair_cast/visible_update_frac"] for x in st.values() if "fair_cast/visible_update_frac" in x]
            lag = [st[s]["fair_cast/lag_steps"] for s in sorted(st) if st[s].get("fair_cast/lag_steps") is not None]
            area = f"{res[arm, seed]['area']:.3f}" if (arm, seed) in res else "(running)"
            say(f"| {arm} | {seed} | {curve} | {scurve} | {area} | "
                f"{statistics.mean(vis) * 100 if vis else float('nan'):.2f} % | "
                f"{statistics.mean(lag[-5:]) if lag else float('nan'):+.1f} | "
                f"{statistics.median(x['seconds'] for x in st.values()) if st else float('nan'):.1f} |")
    say("")
    for a, b in (("stochastic", "rtn"), ("stochastic", "rtn_noise"), ("rtn_noise", "rtn"), ("error_feedback", "rtn"),
                 ("stochastic", "error_feedback")):
        for field in ("greedy", "area", "sampled"):
            xs = differences(res, a, b, field)
            iv = interval(xs)
            say(f"{a} − {b}, {field}{' at step 30' if field != 'area' else ''}, per seed: "
                f"{', '.join(f'{x:+.3f}' for x in xs) or 'none'}"
                + (f"; mean {statistics.mean(xs):+.3f}" if xs else "")
                + (f" [bootstrap 95 % {iv[0]:+.3f}, {iv[1]:+.3f}]" if iv else ""))
    d = decide(res)
    say(f"decision (pre-registered rule, greedy at step {STEPS}): {d['why']}")
    say(f"caveats: three seeds make a coarse bootstrap; one problem of 48 is {ONE_PROBLEM:.3f}")
    if plot and runs:
        _plot(runs, plot)
        say(f"plot: {os.path.relpath(plot, os.path.dirname(HERE))}")
    xs = differences(res, "stochastic", "rtn_noise")
    iv = interval(xs)
    head = "n/a" if not xs else (f"{statistics.mean(xs):+.3f}" + (f" [{iv[0]:+.3f}, {iv[1]:+.3f}]" if iv
                                                                 else " [n/a, n/a]"))
    say(f"sr_minus_rtn_noise_greedy_step30: {head}")
    return lines


def _plot(runs: dict, path: str) -> None:
    import shutil

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = dict(zip(ARMS, ("C0", "C1", "C2", "C3")))
    for run in runs.values():
        k = run["key"]
        if k["model"] != MODEL or k["lr"] != LR or k["steps"] != STEPS or k["mode"] not in colors:
            continue
        ev = run["evals"]
        for ax, field in zip(axes, ("heldout_greedy", "heldout_sampled")):
            ax.plot(sorted(ev), [ev[s][field] for s in sorted(ev)], color=colors[k["mode"]], alpha=0.35,
                    lw=1, ls="-" if run["done"] else ":")
    for arm in ARMS:
        done = [r for r in runs.values() if r["done"] and r["key"]["mode"] == arm and r["key"]["model"] == MODEL
                and r["key"]["lr"] == LR and r["key"]["steps"] == STEPS]
        if not done:
            continue
        common = sorted(set.intersection(*(set(r["evals"]) for r in done)))
        for ax, field in zip(axes, ("heldout_greedy", "heldout_sampled")):
            ax.plot(common, [statistics.mean(r["evals"][s][field] for r in done) for s in common],
                    color=colors[arm], lw=2.5, marker="o", label=f"{arm} (mean of {len(done)} seeds)")
    title = "Fair Cast confirmatory race, seeds 3-5, SmolLM2, lr 1e-6, bf16 grid start"
    if not all(r["done"] for r in runs.values()):
        title += " (dotted: run in progress)"
    fig.suptitle(title)
    for ax, what in zip(axes, ("greedy", "sampled, t = 1")):
        ax.set(xlabel="optimizer step", ylabel="held-out accuracy (48 problems)", title=f"held-out, {what}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    if path == PLOT:
        os.makedirs(os.path.dirname(DOCS_PLOT), exist_ok=True)
        shutil.copyfile(path, DOCS_PLOT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jsonl", default=JSONL)
    parser.add_argument("--output-dir", default="runs/fair_cast_confirm")
    parser.add_argument("--report", action="store_true", help="per-seed table, plot and decision from --jsonl")
    parser.add_argument("--report-file", default=REPORT)
    parser.add_argument("--units", nargs="*", help="arm:seed units to run (default: ORDER)")
    args = parser.parse_args()
    if args.report:
        text = "\n".join(report(args.jsonl))
        print(text)
        with open(args.report_file, "w") as f:
            f.write(text + "\n")
        return
    units = [(u.split(":")[0], int(u.split(":")[1])) for u in args.units] if args.units else ORDER
    for arm, seed in units:
        if arm not in ARMS or seed not in SEEDS:
            parser.error(f"unknown unit {arm}:{seed}; arms {', '.join(ARMS)}, seeds {', '.join(map(str, SEEDS))}")
    for arm, seed in units:
        print(json.dumps({"unit": arm, "seed": seed, "start": time.time()}), flush=True)
        run_unit(arm, seed, args.jsonl, args.output_dir)


if __name__ == "__main__":
    main()

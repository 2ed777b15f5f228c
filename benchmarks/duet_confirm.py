"""DUET's pass-rate allocator, confirmatory race: fresh seeds against compute-matched GRPO.

The exploratory race (``duet_race.py``, seeds 0-2) added the pass-rate arm after reading its seeds' training-side
diagnostics, so those seeds cannot confirm it. This race asks the question again on seeds never used before, with
everything else as the exploratory race ran it: SmolLM2-135M-Instruct, full fine-tuning, fp32, CPU, one thread,
the same calibrated pool of ``trl_fp8.app.tasks.mixed_math``, ``duet_race.PROMPTS`` prompts a step,
``duet_race.STEPS`` steps, lr ``duet_race.LR`` constant, temperature 0.7, completion cap 128, the same held-out set
and evaluation schedule (``duet_race.EVAL_SAMPLES`` samples a problem every ``duet_race.EVAL_EVERY`` steps).

**Pre-registered** (written into this file, committed, before the first unit of this race started; not to be
changed after seeing results):

- Seeds: ``SEEDS`` = 3, 4, 5 (none used before).
- Target: ``TARGET`` = 0.4067 held-out accuracy, the target the exploratory race fixed by its rule. An arm reaches it
  at the first evaluation after step 0 whose accuracy is >= the target; its tokens to target are its cumulative
  generated tokens there (screening rollouts included). An arm that never reaches it gives a bound (its whole run).
- Arms (``ARMS``): ``passrate`` -- DUET with the pass-rate allocator at its current defaults (``duet_budget=0.5``,
  screening on, no refill); ``passrate_noscreen`` -- the same with ``duet_screen=0`` (no screening cold start);
  ``grpo4`` and ``grpo2`` -- plain GRPO with groups of 4 and 2, the compute-matched controls (G = 4 spends what
  DUET at beta 0.5 spends a step; G = 2 is the small fixed group that the literature finds hard to beat).
- Decision rule (``decide``), pooled over seeds 3-5: per seed, the ratio of a pass-rate arm's tokens to target over
  GRPO G = 4's (where G = 4 did not reach the target, its whole run stands in for its tokens to target, which
  makes the ratio larger: conservative for the allocator). The *better* pass-rate arm is the one that reached the
  target on more seeds, then the one with the smaller mean ratio. If it reached the target on every seed and the
  bootstrap 95 % interval of its mean ratio (10,000 resamples over seeds, seed 0) has an upper bound below 1, the
  pass-rate allocator becomes DUET's default allocator (with screening as that arm ran); otherwise the default
  stays, and the docs say plainly that on this model and pool an allocator does not beat a smaller fixed group,
  recommending the group size that won (of GRPO G = 4 and G = 2, the one that reached the target on more seeds,
  then with fewer mean tokens to target). GRPO G = 2 is reported beside G = 4 either way. Choosing the better of
  two arms before the bound is a mild multiple comparison; with three seeds the bound is coarse; both are said in
  the report.

Resumable as the exploratory race: every (arm, seed) unit checkpoints every ``EVAL_EVERY`` steps under
``--output-dir`` and resumes with ``resume_from_checkpoint="auto"``; records go to ``--jsonl``; each start record
carries the code's commit. Units run in ``ORDER`` (seed by seed); ``--units`` picks some, so two processes can
share the work (one thread each, never more than two at once on two cores):

    OMP_NUM_THREADS=1 nohup python benchmarks/duet_confirm.py >> runs/duet_confirm.log 2>&1 &    # run / resume
    python benchmarks/duet_confirm.py --report     # per-seed table, plot, decision

Last two lines of ``--report``: ``passrate_confirm_over_grpo4: <ratio> [lo, hi]`` then
``passrate_confirm_over_grpo2: <ratio> [lo, hi]`` (the better pass-rate arm's mean ratio with its bootstrap
interval; ``n/a`` with the bounds when no seed pair reached the target).
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

import duet_race  # noqa: E402

# ---- pre-registered (see the docstring) --------------------------------------------------------------------------
SEEDS = (3, 4, 5)
TARGET = 0.4067
ARMS = {
    "passrate": dict(num_generations=8, duet=True, duet_budget=0.5, duet_refill_tries=0, duet_allocator="pass_rate"),
    "passrate_noscreen": dict(num_generations=8, duet=True, duet_budget=0.5, duet_refill_tries=0,
                              duet_allocator="pass_rate", duet_screen=0),
    "grpo4": dict(num_generations=4),
    "grpo2": dict(num_generations=2),
}
PASSRATE_ARMS = ("passrate", "passrate_noscreen")
CONTROLS = ("grpo4", "grpo2")
ORDER = [(arm, seed) for seed in SEEDS for arm in ("grpo4", "passrate", "grpo2", "passrate_noscreen")]
KEYS = ("bench", "arm", "seed", "steps")
JSONL = os.path.join(HERE, "results", "duet_confirm_smollm2.jsonl")
REPORT = os.path.join(HERE, "results", "duet_confirm_smollm2.txt")
PLOT = os.path.join(HERE, "results", "duet_confirm_smollm2.png")
DOCS_PLOT = os.path.join(os.path.dirname(HERE), "docs", "img", "duet_confirm_smollm2.png")


def key(arm: str, seed: int) -> dict:
    return {"bench": "duet_confirm", "arm": arm, "seed": seed, "steps": duet_race.STEPS}


def run_unit(arm: str, seed: int, jsonl: str, output_dir: str) -> None:
    duet_race.run_unit(arm, seed, jsonl, output_dir, settings=ARMS[arm], key=key(arm, seed))


# ---- report -----------------------------------------------------------------------------------------------------
def tokens_to_target(curves: dict, arm: str, seed: int) -> tuple[float, bool] | None:
    """(tokens, reached) for a finished unit: tokens to target when reached, else its whole run's tokens; None while
    the unit is not finished."""
    c = curves.get((arm, seed))
    if c is None or not c["done"]:
        return None
    hit = duet_race.first_reaching(c["points"], TARGET)
    return (hit[1], True) if hit else (c["tokens"], False)


def ratios(curves: dict, arm: str, base: str) -> tuple[list[float], list[str], int]:
    """Per finished seed pair, ``arm``'s tokens to target over ``base``'s (see ``decide``), notes for the seeds where a
    figure is a bound, and the number of seeds ``arm`` reached the target on."""
    out, notes, reached = [], [], 0
    for seed in SEEDS:
        a, b = tokens_to_target(curves, arm, seed), tokens_to_target(curves, base, seed)
        if a is None or b is None:
            notes.append(f"seed {seed}: pending")
            continue
        reached += a[1]
        if not a[1]:
            notes.append(f"seed {seed}: {arm} did not reach the target (>= {a[0] / b[0]:.2f})")
            continue
        out.append(a[0] / b[0])
        if not b[1]:
            notes.append(f"seed {seed}: {base} did not reach the target (ratio <= {a[0] / b[0]:.2f}, its whole run)")
    return out, notes, reached


def interval(xs: list[float]) -> tuple[float, float] | None:
    return duet_race.bootstrap_mean(xs) if len(xs) > 1 else None


def headline(xs: list[float], notes: list[str]) -> str:
    if not xs:
        return f"n/a ({'; '.join(notes) or 'no seed pair'})"
    iv = interval(xs)
    text = f"{statistics.mean(xs):.3f}" + (f" [{iv[0]:.3f}, {iv[1]:.3f}]" if iv else " [n/a, n/a]")
    return text + (f" ({'; '.join(notes)})" if notes else "")


def decide(curves: dict) -> dict:
    """The pre-registered decision (see the docstring): ``{"pending": bool, "better": arm, "adopt": bool,
    "winner_group": arm, "why": str}``."""
    done = all(tokens_to_target(curves, a, s) is not None for a in ARMS for s in SEEDS)
    scored = []
    for arm in PASSRATE_ARMS:
        xs, _, reached = ratios(curves, arm, "grpo4")
        scored.append((-reached, statistics.mean(xs) if xs else float("inf"), arm, xs, reached))
    _, mean, better, xs, reached = min(scored)
    iv = interval(xs)
    adopt = done and reached == len(SEEDS) and len(xs) == len(SEEDS) and iv is not None and iv[1] < 1
    groups = []
    for arm in CONTROLS:
        runs = [tokens_to_target(curves, arm, s) for s in SEEDS]
        runs = [r for r in runs if r is not None]
        hits = [t for t, ok in runs if ok]
        groups.append((-len(hits), statistics.mean(hits) if hits else float("inf"), arm))
    winner = min(groups)[2]
    if not done:
        why = "pending: not every unit has finished"
    elif adopt:
        why = (f"{better} reached the target on {reached} of {len(SEEDS)} seeds with a mean {mean:.3f}x GRPO G = 4's "
               f"tokens, bootstrap 95 % upper bound {iv[1]:.3f} < 1: it becomes DUET's default allocator")
    else:
        bound = "n/a" if iv is None else f"{iv[1]:.3f}"
        why = (f"{better} reached the target on {reached} of {len(SEEDS)} seeds, mean ratio over GRPO G = 4 "
               f"{mean:.3f}, bootstrap 95 % upper bound {bound}: not shown below 1 on every seed; the default stays, "
               f"and the smaller fixed group that won is {winner}")
    return {"pending": not done, "better": better, "adopt": adopt, "winner_group": winner, "why": why}


def _runlog_runs(jsonl: str) -> dict:
    import _runlog

    return _runlog.load_runs(jsonl, KEYS)


def report(jsonl: str = JSONL, plot: str | None = PLOT) -> list[str]:
    lines = []
    say = lines.append
    curves = duet_race.curves_from(_runlog_runs(jsonl), ARMS)
    say(f"DUET confirmatory race: SmolLM2-135M-Instruct, mixed_math, full fine-tuning, fp32, CPU 1 thread; "
        f"{duet_race.PROMPTS} prompts a step, {duet_race.STEPS} steps, lr {duet_race.LR:g}; seeds {list(SEEDS)}; "
        f"target {TARGET} (pre-registered)")
    say("units (arm, seed): " + ", ".join(
        f"{a}/{s}: " + ("done" if (a, s) in curves and curves[a, s]["done"] else
                        f"partial ({curves[a, s]['steps']}/{duet_race.STEPS} steps)" if (a, s) in curves
                        else "not run") for a, s in ORDER))
    commits = sorted({r.get("commit") or "none" for r in _starts(jsonl)})
    say(f"code commits of the units' starts: {', '.join(commits) if commits else 'none yet'}")
    say("")
    say("| arm | seed | steps | tokens to target | final held-out | best held-out | generated tokens a step | "
        "zero-variance groups | steps without gradient | train s |")
    say("|---|---|---|---|---|---|---|---|---|---|")
    for arm in ARMS:
        for seed in SEEDS:
            c = curves.get((arm, seed))
            if c is None:
                continue
            hit = duet_race.first_reaching(c["points"], TARGET)
            reach = f"{hit[1]:,.0f}" if hit else f">= {c['tokens']:,.0f}" + ("" if c["done"] else " (running)")
            zv = [z for z in map(duet_race._zero_variance, c["records"]) if z is not None]
            idle = [float(r["grad_norm"] == 0) for r in c["records"] if "grad_norm" in r]
            say(f"| {arm} | {seed} | {c['steps']}{'' if c['done'] else ' (partial)'} | {reach} | "
                f"{c['points'][-1][4]:.3f} | {max(p[4] for p in c['points']):.3f} | "
                f"{c['tokens'] / max(c['steps'], 1):,.0f} | {statistics.mean(zv) if zv else float('nan'):.3f} | "
                f"{statistics.mean(idle) if idle else float('nan'):.2f} | {c['seconds']:,.0f} |")
    say("")
    heads = {}
    for arm in PASSRATE_ARMS:
        for base in CONTROLS:
            xs, notes, reached = ratios(curves, arm, base)
            heads[arm, base] = headline(xs, notes)
            say(f"{arm} / {base} tokens to target, per seed: {', '.join(f'{x:.3f}' for x in xs) or 'none'}; "
                f"reached on {reached} of {len(SEEDS)}; mean [bootstrap 95 %] {heads[arm, base]}")
    xs, notes, _ = ratios(curves, "grpo2", "grpo4")
    say(f"grpo2 / grpo4 tokens to target: {headline(xs, notes)}")
    d = decide(curves)
    say(f"decision (pre-registered rule): {d['why']}")
    say("caveats: the better of two pass-rate arms is chosen before the bound (a mild multiple comparison); a "
        "bootstrap over three seeds is coarse")
    if plot and curves:
        _plot(curves, plot)
        say(f"plot: {os.path.relpath(plot, os.path.dirname(HERE))}")
    say(f"passrate_confirm_over_grpo4: {heads[d['better'], 'grpo4']}")
    say(f"passrate_confirm_over_grpo2: {heads[d['better'], 'grpo2']}")
    return lines


def _starts(jsonl: str) -> list[dict]:
    if not os.path.isfile(jsonl):
        return []
    with open(jsonl) as f:
        return [r for r in map(json.loads, filter(str.strip, f)) if r.get("kind") == "start"]


def _plot(curves: dict, path: str) -> None:
    title = "DUET confirmatory race, seeds 3-5"
    if not all(c["done"] for c in curves.values()):
        title += " (dotted: run in progress)"
    duet_race.plot_curves(curves, ARMS, SEEDS, TARGET, title, path, DOCS_PLOT if path == PLOT else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jsonl", default=JSONL)
    parser.add_argument("--output-dir", default="runs/duet_confirm")
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

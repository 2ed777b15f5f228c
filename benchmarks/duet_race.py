"""DUET's race, pre-registered: generated tokens to a held-out target, DUET against GRPO with G = 8 and G = 4, on the
mixed-difficulty task (``trl_fp8.app.tasks.mixed_math``) where uniform sampling wastes rollouts.

SmolLM2-135M-Instruct (``trl-fp8:smollm2``), full fine-tuning, fp32 (DUET's question is not a precision question),
CPU, one thread. Every arm trains on the calibrated training pool (the prompts recur) with ``PROMPTS`` prompts a
step, correctness reward only, temperature 0.7, completion cap 128, AdamW at ``LR`` constant, for ``STEPS`` steps;
the seed sets the trainer seed and the data order and is shared by the arms (paired). The held-out set (medium and
hard prompts, disjoint from the pool) is measured at step 0 and every ``EVAL_EVERY`` steps: ``EVAL_SAMPLES``
completions per problem at the training temperature, outside the timed region, with the training RNG untouched.

Arms (``ARMS``):
- ``grpo8``  plain GRPO, 8 rollouts a prompt (the baseline of the headline);
- ``grpo4``  plain GRPO, 4 rollouts a prompt: the same tokens a step as DUET at β = 0.5 (the control that says
             whether the allocator adds anything);
- ``duet``   DUET full, β = 0.5 (allocation, the screening cold start, the marker-gated abort), 8 slots a prompt;
- diagnostics, one seed: ``zv_skip`` (GRPO-8 whose all-same groups are dropped from the loss, DAPO-style, no
  resampling: same tokens as GRPO-8) and ``duet_alloc`` (DUET's allocation only: no screening, no abort);
- ``duet_refill`` (added after seed 0 of the arms above, as the issue's item 5, from their diagnostics -- not from the
  held-out set): DUET full plus ``duet_refill_tries=8``: a step's idle prompts (every observed group had one reward)
  are replaced by other prompts of the pool, so the budget DUET left unused (it spent 26 % of GRPO-8's tokens on seed
  0, 41 % of its prompts got no rollout) goes where there is something to learn. Its three seeds run after the
  essential arms; the target rule and everything else above are unchanged.
- ``duet_passrate`` (added after the refill's seeds 0 and 1, as item 5 continued, from the diagnosis in docs/duet.md --
  not from the held-out set): DUET full with ``duet_allocator="pass_rate"`` (no refill): each prompt's pass rate has
  a Beta posterior aged by recurrence, and the budget fills whole groups where a group of ``n_max`` is likeliest to
  show reward variance per token (:mod:`trl_fp8.duet.passrate`): nearly-solved prompts get a group of 8 instead of
  the groups of 2 that made them look solved. Its seeds run after every other unit; the target rule and everything
  else above are unchanged.

x-axis: cumulative *generated* tokens (every completion token sampled, screening and aborted rollouts included;
DUET's placeholders are not generated and count 0), with wall-clock and rollouts beside it.

**Pre-registered** (fixed in this file before any race run; not to be changed after seeing results):
- ``TARGET_RULE``: the target accuracy is the mean over GRPO-8's seeds of its held-out accuracy at step
  ``STEPS // 2`` (half its budget), but at least ``MIN_GAIN`` above the mean held-out accuracy at step 0 (so that a
  GRPO-8 that has not learnt by then cannot make a target that noise reaches at the first evaluation). An arm reaches it at the first evaluation after step 0 whose accuracy is >= the
  target; its tokens to target are its cumulative generated tokens at that evaluation. An arm that never reaches it
  gives a lower bound (its whole run).
- Headline: per seed, DUET's tokens to target over GRPO-8's (and over GRPO-4's); the mean over the seeds where both
  reached it, with a bootstrap 95 % interval over seeds (10,000 resamples, seed 0); the goal is <= 0.5 against GRPO-8
  and < 1 against GRPO-4.
- Also reported per arm: area under held-out accuracy against tokens (trapezoid, up to the smallest total token
  count of the arms' runs, divided by it: a mean accuracy), the zero-variance group fraction (TRL's
  ``frac_reward_zero_std`` for GRPO arms; for DUET, the fraction of its generated groups whose rewards were all
  equal), DUET's n_q histogram and abort rate, wall-clock.

Resumable: every (arm, seed) unit checkpoints every ``EVAL_EVERY`` steps under ``--output-dir`` and resumes with
``resume_from_checkpoint="auto"``; every step's metrics and every evaluation are appended to ``--jsonl``
(``benchmarks/_runlog.py``); units already done are skipped. The driver runs the units in ``ORDER`` (seed by seed,
the essential arms first, then the diagnostics), one process, so the same command resumes after any stop:

    OMP_NUM_THREADS=1 nohup python benchmarks/duet_race.py >> runs/duet_race.log 2>&1 &    # run / resume
    python benchmarks/duet_race.py --report        # tables + plot from the JSONL (partial records marked)
    python benchmarks/duet_race.py --probe         # time a few steps of each essential arm (not recorded as a run)
    python benchmarks/duet_race.py --probe --bf16 --units duet_passrate:0   # 2 steps in fp32, then bf16 autocast

Last two lines of ``--report``: ``duet_tokens_to_target_over_grpo4: <ratio>`` then
``duet_tokens_to_target_over_grpo8: <ratio>`` (the mean over the seeds where both arms reached the target, followed by
the other seeds' bounds when there are any; ``n/a`` with the reason when no seed pair reached it).
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
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _runlog import spread  # noqa: E402

# ---- pre-registered settings (see the docstring; fixed before the first race run) -------------------------------
PROMPTS = 4  # prompts a step
# Sized from the probe (--probe, benchmarks/results/duet_race_probe.jsonl, one shared core): GRPO-8 steps took 223 and
# 191 s (32 sequences of ~110 tokens through the update dominate), GRPO-4 47 and 25 s, DUET's first step 63 s: ~285 s
# a step index for the three essential arms, ~3 h a seed at 32 steps with the evaluations, ~9 h for 3 seeds (three
# sessions). Cut to fit: 32 steps (the pool of 48 prompts 2.7 times, not more), one seed for the diagnostics, no β
# sweep, 4 prompts a step.
STEPS = 32
LR = 5e-6  # measured to move SmolLM2 on chat_math within 20 steps (benchmarks/results/duet_smollm2.txt)
EVAL_EVERY = 4
EVAL_SAMPLES = 2
SEEDS = (0, 1, 2)
MIN_GAIN = 0.05  # about 2 standard errors of a held-out mean (240 samples at p ~ 0.3: 0.03)
TARGET_RULE = ("max(mean over GRPO-8's seeds of its held-out accuracy at step STEPS // 2, mean held-out accuracy at "
               "step 0 + MIN_GAIN)")
ARMS = {
    "grpo8": dict(num_generations=8),
    "grpo4": dict(num_generations=4),
    "duet": dict(num_generations=8, duet=True, duet_budget=0.5, duet_refill_tries=0),  # as pre-registered: no refill
    "zv_skip": dict(num_generations=8),  # plus the zero-variance skip (see ZeroVarianceSkip)
    "duet_alloc": dict(num_generations=8, duet=True, duet_budget=0.5, duet_screen=0, duet_abort_keep_prob=1.0,
                       duet_refill_tries=0),
    "duet_refill": dict(num_generations=8, duet=True, duet_budget=0.5, duet_refill_tries=8),
    "duet_passrate": dict(num_generations=8, duet=True, duet_budget=0.5, duet_refill_tries=0,
                          duet_allocator="pass_rate"),
}
DUET_ARMS = ("duet", "duet_refill", "duet_passrate")  # the arms whose tokens to target are set against GRPO-8's and GRPO-4's
ESSENTIAL = ("grpo8", "grpo4", "duet")
ORDER = ([(arm, seed) for seed in SEEDS for arm in ESSENTIAL] + [("zv_skip", 0), ("duet_alloc", 0)]
         + [("duet_refill", seed) for seed in SEEDS] + [("duet_passrate", seed) for seed in SEEDS])
KEYS = ("bench", "arm", "seed", "steps")
PROBE_STEPS = 2
JSONL = os.path.join(HERE, "results", "duet_race_smollm2.jsonl")
PLOT = os.path.join(HERE, "results", "duet_race_smollm2.png")
DOCS_PLOT = os.path.join(os.path.dirname(HERE), "docs", "img", "duet_race_smollm2.png")  # the same plot, for the docs


def _key(arm: str, seed: int) -> dict:
    return {"bench": "duet_race", "arm": arm, "seed": seed, "steps": STEPS}


def _trainer_class(arm: str):
    import trl_fp8

    if arm != "zv_skip":
        return trl_fp8.GRPOTrainer

    class ZeroVarianceSkip(trl_fp8.GRPOTrainer):
        """GRPO whose all-same groups leave the loss (their completion mask is zeroed, and the token normaliser
        recounted without them): DAPO's filter without its resampling."""

        def _generate_and_score_completions(self, inputs):
            from trl_fp8 import _trl

            out = super()._generate_and_score_completions(inputs)
            g = self.num_generations
            adv = out["advantages"].view(-1, g)
            keep = (adv.abs().sum(1) > 0).repeat_interleave(g)
            out["completion_mask"] = out["completion_mask"] * keep.unsqueeze(1).to(out["completion_mask"].dtype)
            _trl.recount_items(self, out)  # TRL counted the normaliser before: without this the arm is GRPO-8
            return out

    return ZeroVarianceSkip


def _step_metrics(trainer):
    """A step's record: TRL's and DUET's numeric metrics, DUET's n_q and its groups' reward spread."""
    import _runlog

    def pick(logs: dict) -> dict:
        rec = _runlog.numeric(logs)
        duet = trainer.capability("duet") if hasattr(trainer, "capability") else None
        if duet is not None and duet.last_weights is not None:
            rec["n_q"] = duet.last_weights["counts"]
        return rec

    return pick


def run_unit(arm: str, seed: int, jsonl: str, output_dir: str, steps: int = STEPS, probe: bool = False,
             bf16: bool = False, settings: dict | None = None, key: dict | None = None) -> None:
    """One resumable (arm, seed) run; returns at once when ``jsonl`` says it is done. ``bf16`` (probes only: the race
    itself is fp32) trains with TRL's ``bf16=True`` (CPU autocast). ``settings`` and ``key`` (the confirmatory race,
    ``duet_confirm.py``) replace ``ARMS[arm]`` and this race's record key; everything else is this race's."""
    if bf16 and not probe:
        raise ValueError("bf16=True is for probes only: the race is fp32 by design (pre-registered)")
    import _runlog
    import torch
    from transformers.trainer_callback import PrinterCallback

    import trl_fp8
    from trl_fp8.app.tasks import mixed_math as mm
    from trl_fp8.models import SMOLLM2, resolve_model

    key = key or _key(arm, seed)
    if probe:
        key = {**key, "bench": key["bench"] + "_probe", "steps": steps, **({"bf16": True} if bf16 else {})}
    if _runlog.is_done(jsonl, key):
        return
    calibration = mm.load_calibration()
    settings = settings if settings is not None else ARMS[arm]
    out = os.path.join(output_dir, _runlog.run_name(key))
    args = trl_fp8.GRPOConfig(
        output_dir=out, use_cpu=True, bf16=bf16, max_steps=steps, learning_rate=LR, lr_scheduler_type="constant",
        per_device_train_batch_size=PROMPTS * settings["num_generations"], max_completion_length=mm.MAX_COMPLETION_LENGTH,
        temperature=mm.TEMPERATURE, logging_steps=1, save_strategy="no" if probe else "steps", save_steps=EVAL_EVERY,
        save_total_limit=1, report_to="none", disable_tqdm=True, gradient_checkpointing=False, seed=seed,
        data_seed=seed, fair_cast="off", sync_checks="off",
        **{k: v for k, v in settings.items()},
    )
    trainer = _trainer_class(arm)(model=resolve_model(SMOLLM2), reward_funcs=[mm.correctness_reward], args=args,
                                  train_dataset=mm.make_mixed_math_dataset("train", calibration))
    trainer.remove_callback(PrinterCallback)

    def evaluate(model, step: int) -> dict:
        torch.manual_seed(10_000 + step)
        return {"heldout": mm.mixed_math_accuracy(model, trainer.processing_class, calibration,
                                                   samples=EVAL_SAMPLES)}

    trainer.add_callback(_runlog.recorder(jsonl, key, EVAL_EVERY if not probe else 10 ** 9,
                                          None if probe else evaluate, _step_metrics(trainer)))
    trainer.train(resume_from_checkpoint=None if probe else "auto")
    if trainer.state.global_step >= steps:
        _runlog.finish(jsonl, key, out)


# ---- report ---------------------------------------------------------------------------------------------------
def _generated_tokens(rec: dict, rows: int) -> float:
    """Completion tokens a step generated: DUET's own count (screens and aborted rollouts included, placeholders
    not), else TRL's mean completion length x rows."""
    return rec["duet/tokens"] if "duet/tokens" in rec else rec["completions/mean_length"] * rows


def _rollouts(rec: dict, rows: int) -> float:
    return sum(rec["n_q"]) if "n_q" in rec else rows


def _zero_variance(rec: dict) -> float | None:
    if "duet/tokens" not in rec:
        return rec.get("frac_reward_zero_std")
    return rec.get("duet/zero_std_groups_frac")


def curves_from(runs: dict, arms: dict = ARMS) -> dict:
    """(arm, seed) -> {points: [(step, tokens, seconds, rollouts, acc)], totals, done, steps run, per-step records}."""
    curves = {}
    for r in runs.values():
        arm, seed = r["key"]["arm"], r["key"]["seed"]
        if arm not in arms:
            continue
        rows = PROMPTS * arms[arm]["num_generations"]
        tokens = seconds = rollouts = 0.0
        points = [(0, 0.0, 0.0, 0.0, r["evals"][0]["heldout"])] if 0 in r["evals"] else []
        for step in sorted(r["steps"]):
            rec = r["steps"][step]
            tokens += _generated_tokens(rec, rows)
            seconds += rec["seconds"]
            rollouts += _rollouts(rec, rows)
            if step in r["evals"]:
                points.append((step, tokens, seconds, rollouts, r["evals"][step]["heldout"]))
        curves[arm, seed] = dict(points=points, tokens=tokens, seconds=seconds, rollouts=rollouts, done=r["done"],
                                 steps=max(r["steps"], default=0), records=[r["steps"][s] for s in sorted(r["steps"])])
    return curves


def first_reaching(points, target):
    for point in points[1:]:  # step 0 does not count
        if point[4] >= target:
            return point
    return None


def auc(points, limit: float) -> float | None:
    """Mean held-out accuracy over generated tokens [0, limit] (trapezoid; None when the run stops short of it)."""
    if not points or points[-1][1] < limit or limit <= 0:
        return None
    area = 0.0
    for (_, x0, _, _, y0), (_, x1, _, _, y1) in zip(points, points[1:]):
        if x0 >= limit:
            break
        if x1 > limit:
            y1 = y0 + (y1 - y0) * (limit - x0) / (x1 - x0)
            x1 = limit
        area += (x1 - x0) * (y0 + y1) / 2
    return area / limit


def bootstrap_mean(xs: list[float], resamples: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """95 % percentile interval of the mean of ``xs`` resampled with replacement."""
    rng = random.Random(seed)
    means = sorted(statistics.mean(rng.choice(xs) for _ in xs) for _ in range(resamples))
    return means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def summary_table(curves: dict, target: float | None) -> list[str]:
    """Per arm, over its finished seeds: mean ± std [min, max] of the generated tokens a step, the held-out accuracy at
    step STEPS // 2 and at the end, the best, the zero-variance group fraction, the fraction of steps whose update had
    no gradient (``grad_norm`` 0: every group the step trained on had one reward, so the step changed nothing) and the
    tokens to target (seeds that reached it, of the finished ones)."""
    half = STEPS // 2
    out = [f"| arm | seeds done | generated tokens a step | held-out at step {half} | held-out at step {STEPS} | best "
           "held-out | zero-variance groups | steps without gradient | tokens to target (seeds that reached it) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        done = [(seed, curves[arm, seed]) for seed in SEEDS if (arm, seed) in curves and curves[arm, seed]["done"]]
        if not done:
            continue
        per_step = [c["tokens"] / c["steps"] for _, c in done]
        mid = [p[4] for _, c in done for p in c["points"] if p[0] == half]
        final = [c["points"][-1][4] for _, c in done]
        best = [max(p[4] for p in c["points"][1:]) for _, c in done]
        zv = [statistics.mean(z) for _, c in done if (z := [x for x in map(_zero_variance, c["records"]) if x is not None])]
        idle = [statistics.mean(float(r["grad_norm"] == 0) for r in c["records"] if "grad_norm" in r) for _, c in done
                if any("grad_norm" in r for r in c["records"])]
        hits = [h[1] for _, c in done if target is not None and (h := first_reaching(c["points"], target))]
        reach = ("pending" if target is None else
                 f"{spread(hits, ',.0f')} ({len(hits)} of {len(done)})" if hits else f"none of {len(done)}")
        out.append(f"| {arm} | {', '.join(str(s) for s, _ in done)} | {spread(per_step, '.0f')} | {spread(mid, '.3f')} | "
                   f"{spread(final, '.3f')} | {spread(best, '.3f')} | {spread(zv, '.3f')} | {spread(idle, '.2f')} | {reach} |")
    return out


def report(jsonl: str, plot: str | None = PLOT) -> list[str]:
    import _runlog

    lines = []
    say = lines.append
    curves = curves_from(_runlog.load_runs(jsonl, KEYS))
    say(f"DUET race: SmolLM2-135M-Instruct, mixed_math, full fine-tuning, fp32, CPU 1 thread; {PROMPTS} prompts a "
        f"step, {STEPS} steps, lr {LR:g} constant, temperature 0.7, cap 128; held-out {EVAL_SAMPLES} samples a "
        f"problem every {EVAL_EVERY} steps; seeds {list(SEEDS)}")
    say(f"pre-registered target: {TARGET_RULE}")
    say("units (arm, seed): " + ", ".join(
        f"{a}/{s}: " + ("done" if (a, s) in curves and curves[a, s]["done"] else
                        f"partial ({curves[a, s]['steps']}/{STEPS} steps)" if (a, s) in curves else "not run")
        for a, s in ORDER))
    half = STEPS // 2
    at_half = [next((p[4] for p in curves["grpo8", s]["points"] if p[0] == half), None)
               for s in SEEDS if ("grpo8", s) in curves]
    at_half = [x for x in at_half if x is not None]
    target = statistics.mean(at_half) if len(at_half) == len(SEEDS) else None
    if target is None:
        say(f"target: pending (GRPO-8 has reached step {half} on {len(at_half)} of {len(SEEDS)} seeds)")
    else:
        start = statistics.mean(c["points"][0][4] for c in curves.values() if c["points"])
        floor = start + MIN_GAIN
        say(f"target: {max(target, floor):.4f} (GRPO-8 at step {half} {target:.4f}, per seed "
            f"{', '.join(f'{x:.3f}' for x in at_half)}; mean held-out at step 0 {start:.4f}, + {MIN_GAIN} = "
            f"{floor:.4f})")
        target = max(target, floor)
    ends = [c["points"][-1][1] for (a, _), c in curves.items() if a in ESSENTIAL and c["done"]]
    limit = min(ends) if ends else 0.0
    say("")
    lines += summary_table(curves, target)
    say("")
    say("| arm | seed | steps | tokens to target | rollouts to target | seconds to target | final acc | AUC (tokens <= "
        f"{limit:,.0f}) | total tokens | zero-variance groups | abort rate | train s |")
    say("|---|---|---|---|---|---|---|---|---|---|---|---|")
    hits = {}
    for arm in ARMS:
        for seed in SEEDS:
            c = curves.get((arm, seed))
            if c is None:
                continue
            h = first_reaching(c["points"], target) if target is not None else None
            hits[arm, seed] = h
            zv = [z for z in map(_zero_variance, c["records"]) if z is not None]
            aborts = [r["duet/abort_frac"] for r in c["records"] if "duet/abort_frac" in r]
            a = auc(c["points"], limit)
            reach = ("pending" if target is None else f"{h[1]:,.0f} | {h[3]:,.0f} | {h[2]:,.0f}" if h else
                     f">= {c['tokens']:,.0f} | >= {c['rollouts']:,.0f} | >= {c['seconds']:,.0f}")
            if target is None:
                reach = "pending | pending | pending"
            say(f"| {arm} | {seed} | {c['steps']}{'' if c['done'] else ' (partial)'} | {reach} | "
                f"{c['points'][-1][4] if c['points'] else float('nan'):.3f} | {'n/a' if a is None else f'{a:.3f}'} | "
                f"{c['tokens']:,.0f} | {statistics.mean(zv) if zv else float('nan'):.3f} | "
                f"{statistics.mean(aborts) if aborts else 0.0:.3f} | {c['seconds']:,.0f} |")
    for arm in ("duet", "duet_alloc", "duet_refill", "duet_passrate"):
        hist = {}
        for (a, _), c in curves.items():
            if a == arm:
                for r in c["records"]:
                    for n in r.get("n_q", []):
                        hist[n] = hist.get(n, 0) + 1
        if hist:
            total = sum(hist.values())
            say(f"{arm} n_q histogram (prompts): " + ", ".join(f"{n}: {hist[n] / total:.3f}" for n in sorted(hist)))
    headline = {}
    for duet, base in [(d, b) for d in DUET_ARMS[::-1] for b in ("grpo4", "grpo8")]:
        ratios, bounds = [], []
        for seed in SEEDS:
            d, g = hits.get((duet, seed)), hits.get((base, seed))
            dc, gc = curves.get((duet, seed)), curves.get((base, seed))
            if dc is None or gc is None or not (dc["done"] and gc["done"]) or target is None:
                bounds.append(f"seed {seed}: pending")
            elif d and g:
                ratios.append(d[1] / g[1])
            elif g:
                bounds.append(f"seed {seed}: >= {dc['tokens'] / g[1]:.2f} ({duet} did not reach it)")
            elif d:
                bounds.append(f"seed {seed}: <= {d[1] / gc['tokens']:.2f} ({base} did not reach it)")
            else:
                bounds.append(f"seed {seed}: neither reached it")
        interval = bootstrap_mean(ratios) if len(ratios) > 1 else None
        say(f"{duet} / {base} tokens to target, per seed: {', '.join(f'{x:.3f}' for x in ratios) or 'none'}; "
            f"{spread(ratios, '.3f')}" + (f"; bootstrap 95 % [{interval[0]:.3f}, {interval[1]:.3f}]" if interval
                                          else "") + (f"; {'; '.join(bounds)}" if bounds else ""))
        # the mean over the seed pairs that both reached the target; the other seeds' bounds follow it, so a mean of
        # one seed out of three does not read as the result of three
        headline[duet, base] = (f"{statistics.mean(ratios):.3f}" + (f" ({len(ratios)} of {len(SEEDS)} seeds; "
                                                                     f"{'; '.join(bounds)})" if bounds else "")
                                if ratios else f"n/a ({'; '.join(bounds) if bounds else 'no seed pair'})")
    if plot and curves:
        _plot(curves, target, plot)
        say(f"plot: {os.path.relpath(plot, os.path.dirname(HERE))}")
    say(f"duet_passrate_tokens_to_target_over_grpo4: {headline['duet_passrate', 'grpo4']}")
    say(f"duet_passrate_tokens_to_target_over_grpo8: {headline['duet_passrate', 'grpo8']}")
    say(f"duet_refill_tokens_to_target_over_grpo4: {headline['duet_refill', 'grpo4']}")
    say(f"duet_refill_tokens_to_target_over_grpo8: {headline['duet_refill', 'grpo8']}")
    say(f"duet_tokens_to_target_over_grpo4: {headline['duet', 'grpo4']}")
    say(f"duet_tokens_to_target_over_grpo8: {headline['duet', 'grpo8']}")
    return lines


DOCS = os.path.join(os.path.dirname(HERE), "docs", "duet.md")
TABLE_START, TABLE_END = "<!-- race-table", "<!-- /race-table -->"


def write_docs_table(lines: list[str], path: str = DOCS) -> None:
    """Replace what stands between the race-table markers of ``path`` by the report's per-arm table (the first
    table of ``lines``) and its units line; written to a temporary file, then renamed."""
    table = []
    for line in lines[lines.index(next(x for x in lines if x.startswith("| arm | seeds done"))):]:
        if not line.startswith("|"):
            break
        table.append(line)
    units = next(x for x in lines if x.startswith("units (arm, seed):"))
    with open(path) as f:
        text = f.read()
    if TABLE_START not in text or TABLE_END not in text:
        raise ValueError(f"{path} has no race-table markers ({TABLE_START} ... {TABLE_END})")
    head, rest = text.split(TABLE_START, 1)
    marker, _ = rest.split("\n", 1)
    _, tail = rest.split(TABLE_END, 1)
    body = "\n".join(table) + f"\n\n{units}\n"
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(head + TABLE_START + marker + "\n" + body + TABLE_END + tail)
    os.replace(tmp, path)


def _plot(curves, target, path) -> None:
    plot_curves(curves, ARMS, SEEDS, target, "DUET race on SmolLM2 mixed_math (dotted: run in progress)", path,
                DOCS_PLOT if path == PLOT else None)


def plot_curves(curves, arms, seeds, target, title, path, docs_path=None) -> None:
    """Held-out accuracy against cumulative generated tokens, one colour per arm, one line per seed (dotted while a
    unit runs), the target dashed; saved to ``path`` (and ``docs_path``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for k, arm in enumerate(arms):
        labelled = False
        for seed in seeds:
            c = curves.get((arm, seed))
            if c is None or not c["points"]:
                continue
            ax.plot([p[1] for p in c["points"]], [p[4] for p in c["points"]], color=f"C{k}", alpha=0.8, marker="o",
                    ms=3, lw=1.2, ls="-" if c["done"] else ":", label=None if labelled else arm)
            labelled = True
    if target is not None:
        ax.axhline(target, color="grey", ls="--", lw=1, label="target (pre-registered)")
    ax.set(xlabel="generated tokens (cumulative)", ylabel="held-out accuracy", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    if docs_path:
        fig.savefig(docs_path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jsonl", default=JSONL)
    parser.add_argument("--output-dir", default="runs/duet_race")
    parser.add_argument("--report", action="store_true", help="tables and plot from --jsonl")
    parser.add_argument("--report-file", default=os.path.join(HERE, "results", "duet_race_smollm2.txt"))
    parser.add_argument("--docs", action="store_true", help="with --report: also write the per-arm table into "
                        "docs/duet.md (between its race-table markers)")
    parser.add_argument("--probe", action="store_true", help="time PROBE_STEPS steps of each essential arm (records "
                        "in results/duet_race_probe.jsonl, step seconds included)")
    parser.add_argument("--units", nargs="*", help="arm:seed units to run (default: ORDER); with --probe: the arms to "
                        "probe (seed 0; default: the essential arms)")
    parser.add_argument("--bf16", action="store_true", help="with --probe: probe each arm in fp32 and then with "
                        "bf16=True (CPU autocast); the race itself is fp32")
    args = parser.parse_args()
    if args.report:
        lines = report(args.jsonl)
        text = "\n".join(lines)
        print(text)
        with open(args.report_file, "w") as f:
            f.write(text + "\n")
        if args.docs:
            write_docs_table(lines)
        return
    if args.bf16 and not args.probe:
        parser.error("--bf16 is for --probe only: the race is fp32 (pre-registered)")
    if args.probe:
        probe = os.path.join(HERE, "results", "duet_race_probe.jsonl")
        arms = [u.split(":")[0] for u in args.units] if args.units else list(ESSENTIAL)
        for arm in arms:
            if arm not in ARMS:
                parser.error(f"unknown arm {arm!r}; one of {', '.join(ARMS)}")
            for bf16 in ((False, True) if args.bf16 else (False,)):  # fp32 then bf16 autocast, same arm and seed
                t0 = time.perf_counter()
                run_unit(arm, 0, probe, args.output_dir, steps=PROBE_STEPS, probe=True, bf16=bf16)
                print(json.dumps({"probe": arm, "bf16": bf16, "steps": PROBE_STEPS,
                                  "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
        return
    units = [(u.split(":")[0], int(u.split(":")[1])) for u in args.units] if args.units else ORDER
    for arm, seed in units:
        if arm not in ARMS:
            parser.error(f"unknown arm {arm!r}; one of {', '.join(ARMS)}")
        print(json.dumps({"unit": arm, "seed": seed, "start": time.time()}), flush=True)
        run_unit(arm, seed, args.jsonl, args.output_dir)


if __name__ == "__main__":
    main()

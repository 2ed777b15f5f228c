"""The per-step cost of DUET's step-boundary state (what a stop inside the next step saves, trl_fp8.checkpoints.boundary)
with full per-prompt tables: the copy of its whole ``state_dict()`` (the former way) over the journaled mark
(``boundary_state()``: the tables' changes are journaled, trl_fp8.duet.lru).

A DUET controller (pass-rate allocator) whose surrogate and pass-rate tables hold ``--prompts`` prompts each (100k,
their default capacity). Each repetition runs a pair, in alternating order (old, new, then new, old, ...), of: take
the boundary state the arm's way, then run one step of the controller on a batch of ``--batch`` prompts (half warm,
half new: the tables evict). Only the boundary state is timed; each step runs after it, so the new arm's journal
holds what a real step changes. The figure is the median over pairs of (old / new). Also printed: the medians, the
new arm's cost at a stop (rebuilding the tables from the journal, paid once, when a stop saves) and a check that it
gives the old arm's state.

    python benchmarks/duet_boundary.py [--prompts 100000] [--batch 64] [--reps 9] [--quick]

Last line: `duet_boundary_copy_over_journal: <number>`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def build(prompts: int):
    from trl_fp8.duet.component import Duet
    from trl_fp8.duet.controller import DuetController
    from trl_fp8.duet.passrate import PassRates
    from trl_fp8.duet.surrogate import PromptStats

    c = DuetController(budget=0.5, slots=8, n_min=2, seed=0, default_length=64.0, allocator="pass_rate")
    c.pass_rates = PassRates(decay=0.5, capacity=prompts)
    c.stats = PromptStats(capacity=prompts, default_length=64.0)
    for i in range(prompts):
        key = f"prompt-{i:07d}"
        c.pass_rates.update(key, i % 5, 4 - i % 5)
        c.stats.update(key, 0.01 * (i % 7), [50.0 + i % 30, 60.0])
    duet = Duet.__new__(Duet)  # the capability's state methods only: no trainer needed
    duet.controller = c
    return duet


def step(duet, batch: int, r: int, prompts: int) -> None:
    import torch

    c = duet.controller
    gen = torch.Generator().manual_seed(r)
    warm = [f"prompt-{int(i):07d}" for i in torch.randint(0, prompts, (batch - batch // 2,), generator=gen)]
    keys = list(dict.fromkeys(warm + [f"new-{r}-{j}" for j in range(batch // 2)]))
    plan = c.plan(keys)
    n = int(plan.counts.sum())
    rewards = torch.rand(n, generator=gen, dtype=torch.float64)
    c.observe(plan, [64] * n, rewards - rewards.mean(), -torch.ones(n, dtype=torch.float64), rewards=rewards)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 5k prompts, 5 repetitions")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.reps = 5_000, 5
    if args.reps < 5:
        parser.error("--reps must be >= 5 (the figure is a median)")
    if args.prompts < 1 or args.batch < 2:
        parser.error("--prompts must be >= 1 and --batch >= 2")

    from trl_fp8.checkpoints.boundary import _copied

    t0 = time.perf_counter()
    duet = build(args.prompts)
    print(f"tables: {len(duet.controller.stats)} + {len(duet.controller.pass_rates)} prompts "
          f"(built in {time.perf_counter() - t0:.1f} s); batch {args.batch}, {args.reps} pairs")

    def old():
        t = time.perf_counter()
        _copied(duet.state_dict())
        return time.perf_counter() - t

    def new():
        t = time.perf_counter()
        duet.boundary_state()
        return time.perf_counter() - t

    times = {"old": [], "new": []}
    ratios = []
    r = 0
    for rep in range(args.reps):
        pair = {}
        for arm in (("old", "new") if rep % 2 == 0 else ("new", "old")):
            pair[arm] = (old if arm == "old" else new)()
            step(duet, args.batch, r, args.prompts)
            r += 1
        times["old"].append(pair["old"])
        times["new"].append(pair["new"])
        ratios.append(pair["old"] / max(pair["new"], 1e-9))

    # at a stop: the journaled state is rebuilt once; it equals the copy taken at the same moment
    copy_now = _copied(duet.state_dict())
    deferred = duet.boundary_state()
    step(duet, args.batch, r, args.prompts)
    t = time.perf_counter()
    rebuilt = deferred()
    at_stop = time.perf_counter() - t
    same = rebuilt == copy_now

    print(f"copy of state_dict (old): median {statistics.median(times['old']) * 1e3:.1f} ms a step")
    print(f"journaled mark (new):     median {statistics.median(times['new']) * 1e3:.3f} ms a step")
    print(f"new, at a stop only: rebuilding the state from the journal {at_stop * 1e3:.1f} ms; equal to the copy: {same}")
    if not same:
        print("error: the journaled state differs from the copy", file=sys.stderr)
        return 1
    print(f"duet_boundary_copy_over_journal: {statistics.median(ratios):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The DUET controller: one object per trainer that plans each generation batch and learns from it.

No TRL imports: the trainer hands it prompt keys, generated lengths, advantages and log-probabilities.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

import torch

from .abort import RolloutMonitor
from .allocation import allocate_rollouts, importance_weights, propensities
from .markers import MarkerDetector
from .passrate import PassRates, allocate_by_variance, passes_and_fails
from .surrogate import LengthQuantiles, PromptStats, informativeness


class Coins:
    """A rollout's own random draws, taken from ``rng`` up front (``random()`` hands them out in order)."""

    PER_ROLLOUT = 2  # RolloutMonitor tosses the trim coin (on a marker) and the abort coin (no marker), each once

    def __init__(self, rng: random.Random):
        self._draws = [rng.random() for _ in range(self.PER_ROLLOUT)]

    def random(self) -> float:
        return self._draws.pop(0)


@dataclass
class BatchPlan:
    """What DUET decided for one generation batch of ``groups`` prompts × ``slots`` slots."""

    keys: list[str]
    counts: torch.Tensor  # real rollouts per prompt
    propensity: torch.Tensor  # per prompt
    lam: float
    slots: int
    inclusion: torch.Tensor | None = None  # per prompt: probability it was given rollouts (1: certainly)
    monitors: list[RolloutMonitor] = field(default_factory=list)  # one per real rollout, prompt by prompt
    # screening (cold start): per prompt, whether it is screened first, and the rollouts the allocator gave it
    screened: torch.Tensor | None = None
    planned: torch.Tensor | None = None
    screen_uniform: list[bool] = field(default_factory=list)  # per screened prompt, after the screen: one reward

    def real_rows(self) -> list[int]:
        """Slot rows (in the full groups × slots layout) that hold a real rollout, in generation order."""
        return [g * self.slots + j for g, n in enumerate(self.counts.tolist()) for j in range(n)]


ALLOCATORS = ("informativeness", "pass_rate")


class DuetController:
    def __init__(self, budget: float, slots: int, n_min: int = 2, n_max: int | None = None, markers=("math",),
                 keep_prob: float = 0.05, min_propensity: float = 0.05, max_weight: float = 1000.0,
                 seed: int = 0, default_length: float = 64.0, margin_threshold: float = 0.9, grace: int = 150,
                 prior_strength: float = 0.0, screen: int = 0, screen_keep_prob: float = 0.1, min_tokens: int = 0,
                 k_gap: int = 0, poll_every: int = 8, allocator: str = "informativeness", pass_threshold: float = 0.5,
                 pass_decay: float = 0.5):
        if allocator not in ALLOCATORS:
            raise ValueError(f"allocator must be one of {ALLOCATORS}, got {allocator!r}")
        self.allocator = allocator
        self.pass_threshold = float(pass_threshold)
        self.pass_rates = PassRates(decay=pass_decay)
        self.budget = budget
        self.slots = slots
        self.n_min = n_min
        self.n_max = n_max or slots
        self.grace = grace
        self.min_tokens, self.k_gap, self.poll_every = min_tokens, k_gap, poll_every
        self.screen = screen
        self.screen_keep_prob = screen_keep_prob
        self.detector = MarkerDetector(list(markers))
        self.keep_prob = keep_prob
        self.min_propensity = min_propensity
        self.max_weight = max_weight
        self.margin_threshold = margin_threshold
        self.stats = PromptStats(default_length=default_length, prior_strength=prior_strength)
        self.quantiles = LengthQuantiles()
        self.rng = random.Random(seed)

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything the controller learned and its random stream: per-prompt statistics, length quantiles, RNG."""
        version, internal, gauss_next = self.rng.getstate()
        return {
            "stats": self.stats.state_dict(),
            "quantiles": self.quantiles.state_dict(),
            "rng": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
            "pass_rates": self.pass_rates.state_dict(),
        }

    def mark(self):
        """A function giving :meth:`state_dict` as it is now (until the next mark), for a step boundary: the per-prompt
        tables are journaled, not copied (:mod:`trl_fp8.duet.lru`), so a mark costs what the bounded parts cost (the
        RNG, the length window) however many prompts the tables hold; the tables are rebuilt only when the function
        is called (a stop that saves)."""
        version, internal, gauss_next = self.rng.getstate()
        rng = {"version": version, "internal": list(internal), "gauss_next": gauss_next}
        stats, pass_rates, quantiles = self.stats.mark(), self.pass_rates.mark(), self.quantiles.state_dict()

        def state() -> dict:
            return {"stats": stats(), "quantiles": quantiles, "rng": rng, "pass_rates": pass_rates()}
        return state

    def load_state_dict(self, state: dict) -> None:
        self.stats.load_state_dict(state["stats"])
        self.quantiles.load_state_dict(state["quantiles"])
        if "pass_rates" in state:  # absent in checkpoints written before the pass-rate allocator: start afresh
            self.pass_rates.load_state_dict(state["pass_rates"])
        rng = state["rng"]
        self.rng.setstate((int(rng["version"]), tuple(int(x) for x in rng["internal"]), rng["gauss_next"]))

    def refill(self, keys: list[str], draw: Callable[[random.Random], tuple[object, str]],
               tries: int) -> tuple[dict[int, object], int]:
        """Substitutes for the batch's idle prompts: the unused budget goes to other prompts of the pool.

        A prompt is idle when it is warm, every group observed of it had one reward throughout, and it is not due
        for a re-probe (:meth:`PromptStats.idle`): its group would teach nothing, so the allocator would give it
        nothing (or a coin's ``n_min``), and with the step's prompts fixed that share of the budget went unused.
        For each idle prompt, in batch order, up to ``tries`` candidates ``(payload, key) = draw(rng)`` are drawn
        from the pool with the controller's stream (so every rank of a DDP run draws the same); the first whose key
        is not in the batch (nor taken by an earlier substitute) and is not idle itself replaces it. A replaced
        prompt counts one allocation (:meth:`PromptStats.touch`), so it still comes due for its re-probe; an idle
        prompt without a substitute stays and is allocated as before.

        This changes which prompts a step trains on, towards those whose groups had reward variance (DAPO's dynamic
        sampling and GRESO's pre-rollout filter do the same): a group whose rewards are all equal has advantage 0 and
        no gradient under GRPO, so what is dropped is what would have added nothing, while the re-probe keeps the
        skipped prompts observed. Returns ``({batch index: payload of its substitute}, number of idle prompts)``."""
        if tries < 0:
            raise ValueError(f"tries must be >= 0, got {tries}")
        idle = [q for q, key in enumerate(keys) if self.stats.idle(key)]
        taken = set(keys)
        substitutes: dict[int, object] = {}
        for q in idle:
            for _ in range(tries):
                payload, key = draw(self.rng)
                if key in taken or self.stats.idle(key):
                    continue
                substitutes[q] = payload
                taken.add(key)
                break
        for q in substitutes:
            self.stats.touch(keys[q])
        return substitutes, len(idle)

    def plan(self, keys: list[str]) -> BatchPlan:
        """Rollouts per prompt for this batch. With screening on (``screen > 0``), a cold prompt (never observed) that
        the allocator gave more than ``screen`` rollouts gets only ``screen`` for now: its first group is a screen, and
        :meth:`after_screen` decides the rest from the screen's rewards (``plan.planned`` keeps the allocator's
        counts). With the pass-rate allocator every cold prompt is screened (it was given its screen first), so a cold
        prompt whose screen is mixed can continue even when the allocator gave it nothing beyond the screen."""
        s, lengths, warm, reprobe = self.stats.lookup(keys)
        mean_len = self.stats.cold_length()
        budget = self.budget * len(keys) * self.slots * mean_len
        screen = min(self.screen, self.n_max)  # a screen cannot be larger than a prompt's group
        if self.allocator == "pass_rate":
            a, b = self.pass_rates.lookup(keys)
            counts, inclusion, _ = allocate_by_variance(a, b, lengths, budget, max(2, self.n_min), self.n_max,
                                                        cold=~warm, screen=screen, rng=self.rng,
                                                        min_inclusion=self.min_propensity)
            lam = float("inf")  # no multiplier: the greedy fill has none
        else:
            counts, lam, inclusion = allocate_rollouts(s, lengths, budget, self.n_min, self.n_max, rng=self.rng,
                                                       min_inclusion=self.min_propensity)
        # exploration floor: stale warm prompts get a group that can be observed again (with certainty: π = 1)
        floor = max(2, self.n_min) if self.n_max >= 2 else self.n_min
        counts = torch.where(reprobe, counts.clamp(min=floor), counts)
        inclusion = torch.where(reprobe, torch.ones_like(inclusion), inclusion)
        planned = counts.clone()
        if screen <= 0:
            screened = torch.zeros_like(warm)
        elif self.allocator == "pass_rate":  # every cold prompt holds its screen: each may continue from the pool
            screened = (~warm) & (counts >= screen)
        else:
            screened = (~warm) & (counts > screen)
        counts = torch.where(screened, torch.full_like(counts, screen), counts)
        plan = BatchPlan(keys, counts, propensities(counts, self.min_propensity), lam, self.slots, inclusion,
                         screened=screened, planned=planned)
        # Each rollout's coins are drawn here, in row order, from the controller's stream (a monitor tosses at most
        # two): which rank generates a row, and in which order its tokens arrive, changes no draw, so every rank of a
        # DDP run keeps the same stream and a global batch gets the same coins on any number of ranks.
        plan.monitors = [self._monitor() for _ in range(int(counts.sum()))]
        return plan

    def _monitor(self) -> RolloutMonitor:
        k1 = max(self.quantiles.k1, self.min_tokens)  # nothing stops before min_tokens
        k2 = max(self.quantiles.k2, k1 + self.k_gap)
        return RolloutMonitor(self.detector, k1, k2, Coins(self.rng), margin_threshold=self.margin_threshold,
                              keep_prob=self.keep_prob, trim_skip_prob=self.keep_prob, grace=self.grace,
                              poll_every=self.poll_every)

    def after_screen(self, plan: BatchPlan, uniform: list[bool | None]) -> list[int]:
        """The rest of the screened prompts' rollouts, from their screens: ``uniform[i]`` is True when the i-th
        screened prompt's kept screen rollouts all got one reward (that group teaches nothing), False when the
        rewards differ, None when fewer than 2 were kept (unknown: treated as mixed).

        A mixed screen always continues; a uniform one continues with probability ``screen_keep_prob`` (one draw
        each, in prompt order) and is then weighted by ``1 / screen_keep_prob`` (its inclusion probability is
        multiplied by it): over the screen's outcome the prompt's expected weight is 1, so the batch gradient stays
        unbiased against the one a full group would give (a stopped uniform screen has advantage 0 anyway). The
        rollouts the allocator gave the screened prompts beyond their screens are pooled and handed out round-robin
        (in prompt order, at most ``n_max`` a prompt) to the prompts that continue: a step whose screens are all
        mixed ends with exactly the allocator's counts (nothing changes where every group is informative); a step
        with uniform screens spends their rollouts on the mixed ones. The bias this leaves: a continuing prompt's
        group size depends on how many others continue (the same propensity weights as any allocation correct it).

        Updates ``plan`` (counts, propensities, inclusion, monitors: new rows' monitors are drawn here, in prompt
        order) and returns the new rows (slot rows in the groups x slots layout), in generation order."""
        idx = plan.screened.nonzero().flatten().tolist()
        if len(uniform) != len(idx):
            raise ValueError(f"uniform must have one entry per screened prompt ({len(idx)}), got {len(uniform)}")
        plan.screen_uniform = [bool(u) for u in uniform]
        continuing = []
        for q, u in zip(idx, uniform, strict=True):
            if u:
                keep = self.rng.random() < self.screen_keep_prob
                if keep:
                    plan.inclusion[q] = plan.inclusion[q] * self.screen_keep_prob
            else:
                keep = True
            if keep:
                continuing.append(q)
        pool = sum(int(plan.planned[q]) - int(plan.counts[q]) for q in idx)
        extra = {q: 0 for q in continuing}
        room = {q: self.n_max - int(plan.counts[q]) for q in continuing}
        while pool > 0 and any(room[q] > extra[q] for q in continuing):
            for q in continuing:
                if pool > 0 and extra[q] < room[q]:
                    extra[q] += 1
                    pool -= 1
        before = plan.counts.tolist()
        by_prompt, row = [], 0
        for n in before:
            by_prompt.append(plan.monitors[row:row + n])
            row += n
        new_rows = []
        for q in continuing:
            for j in range(before[q], before[q] + extra[q]):
                by_prompt[q].append(self._monitor())
                new_rows.append(q * plan.slots + j)
            plan.counts[q] = before[q] + extra[q]
        plan.monitors = [m for ms in by_prompt for m in ms]
        plan.propensity = propensities(plan.counts, self.min_propensity)
        return new_rows

    def weights(self, plan: BatchPlan) -> torch.Tensor:
        """Per real rollout: importance weight, 0 for aborted rollouts."""
        p = plan.propensity.repeat_interleave(plan.counts)
        eps_kept = torch.tensor([m.eps_kept for m in plan.monitors], dtype=torch.bool)
        aborted = torch.tensor([m.aborted for m in plan.monitors], dtype=torch.bool)
        inclusion = plan.inclusion.repeat_interleave(plan.counts) if plan.inclusion is not None else None
        w = importance_weights(p, eps_kept, self.keep_prob, self.min_propensity, self.max_weight, inclusion)
        return torch.where(aborted, torch.zeros_like(w), w)

    def observe(self, plan: BatchPlan, lengths: list[int], advantages: torch.Tensor, sum_logps: torch.Tensor,
                rewards: torch.Tensor | None = None) -> None:
        """Learn from the batch: per-prompt informativeness and lengths of the kept (non-aborted) rollouts, and with
        ``rewards`` (each rollout's total reward, in the order of ``lengths``) their passes (reward >=
        ``pass_threshold``) and fails for the pass-rate surrogate (a NaN reward — every reward function returned None for
        it, TRL's "does not apply" — counts as neither)."""
        if self.allocator == "pass_rate" and rewards is None:
            raise ValueError("the pass-rate allocator learns from rewards: observe() needs them")
        kept_lengths = []
        passes_all = kept_all = 0
        row = 0
        for key, n in zip(plan.keys, plan.counts.tolist(), strict=True):
            idx = [i for i in range(row, row + n) if not plan.monitors[i].aborted]
            row += n
            group_lengths = [lengths[i] for i in idx]
            kept_lengths += group_lengths
            if len(idx) >= 2:
                s = informativeness(advantages[idx], sum_logps[idx])
                self.stats.update(key, s, group_lengths)
                if rewards is not None:  # a NaN reward (no reward function applied) is neither a pass nor a fail
                    passes, fails = passes_and_fails([rewards[i] for i in idx], self.pass_threshold)
                    if passes + fails:
                        self.pass_rates.update(key, passes, fails)
                    passes_all += passes
                    kept_all += passes + fails
        self.pass_rates.observe_batch(passes_all, kept_all)
        self.stats.observe_batch_lengths(kept_lengths)
        self.quantiles.add(kept_lengths)
        self.quantiles.step()

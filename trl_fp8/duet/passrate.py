"""DUET's pass-rate allocator (``duet_allocator="pass_rate"``): rollouts go where a group is likely to show reward
variance at the size it is given. Pure Python/PyTorch, no TRL.

Why: a GRPO group teaches something only when its rewards differ. For a prompt of pass rate p, a group of n shows
variance with probability ``V(n) = 1 - pⁿ - (1 - p)ⁿ``: at p = 0.9 that is 0.57 with n = 8 but 0.18 with n = 2. The
informativeness surrogate judges a prompt from the few small groups DUET gave it, so a nearly-solved prompt looks
"all right" and is dropped, while GRPO-8 keeps learning from it (the race's diagnosis, docs/duet.md).

The surrogate: each prompt's pass rate has a Beta posterior (:class:`PassRates`). A cold prompt starts from the
prior ``Beta(k·m, k·(1 - m))`` with ``m`` the pass rate of the latest observed batch and ``k = PRIOR_ROLLOUTS``; each
observed group adds its passes and fails; each time the prompt comes up again, its past counts are multiplied by
``decay`` (the model moved since: evidence ages by recurrence), so a stale "solved" verdict fades back to the prior.
Under the posterior the expected value of ``V(n)`` has a closed form: ``E[pⁿ] = Π_{i<n} (a + i) / (a + b + i)``
(:func:`variance_probability`).

The allocation (:func:`allocate_by_variance`) maximises the expected number of rollouts that sit in a group with
variance, ``Σ n_q · V_q(n_q)``, under the token budget. ``n · V(n)`` grows faster than n (V rises with n), so a prompt
is worth most at its largest group: prompts are taken in order of ``V_q(n_max) / L_q`` (value per generated token)
and each gets ``n_max`` while the budget lasts; the last one gets what is left if that is at least ``n_min``. A cold
prompt under screening holds its screen already (paid first, out of the same budget) and competes for the rest of
its group. A prompt left out gets ``n_min`` rollouts with probability ``min_inclusion`` and is weighted by its inverse
(Horvitz-Thompson, as in :mod:`~trl_fp8.duet.allocation`), so every prompt keeps a non-zero inclusion probability
and the batch gradient stays unbiased over which prompts were sampled.
"""

from __future__ import annotations

import random

import torch

from .lru import LruTable

PRIOR_ROLLOUTS = 2.0  # strength of a cold prompt's prior, in rollouts
NEUTRAL_RATE = 0.5  # the prior's mean before anything was observed


def power_moment(a: float, b: float, n: int) -> float:
    """``E[pⁿ]`` for ``p ~ Beta(a, b)``: ``Π_{i<n} (a + i) / (a + b + i)`` (1 for n = 0)."""
    if a <= 0 or b <= 0:
        raise ValueError(f"Beta parameters must be positive, got a={a}, b={b}")
    out = 1.0
    for i in range(int(n)):
        out *= (a + i) / (a + b + i)
    return out


def variance_probability(a: float, b: float, n: int) -> float:
    """Probability that a group of ``n`` rollouts shows reward variance (not all pass, not all fail) when the pass
    rate is ``Beta(a, b)``: ``1 - E[pⁿ] - E[(1 - p)ⁿ]``; 0 for n < 2."""
    if n < 2:
        return 0.0
    return max(0.0, 1.0 - power_moment(a, b, n) - power_moment(b, a, n))


class PassRates:
    """Per-prompt Beta posterior of the pass rate, LRU-bounded to ``capacity`` prompts.

    ``decay`` in (0, 1]: each time a warm prompt is looked up (comes up in a batch), its pass and fail counts are
    multiplied by it; 1 keeps every observation at full weight."""

    def __init__(self, decay: float = 0.5, capacity: int = 100_000, prior_rollouts: float = PRIOR_ROLLOUTS):
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if not prior_rollouts > 0:
            raise ValueError(f"prior_rollouts must be > 0, got {prior_rollouts}")
        self.decay = float(decay)
        self.capacity = int(capacity)
        self.prior_rollouts = float(prior_rollouts)
        self.recent_rate = NEUTRAL_RATE  # pass rate of the latest observed batch: the prior's mean
        self._table = LruTable(self.capacity, list)  # key -> [passes, fails] (decayed), least recently used first

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, key) -> bool:
        return key in self._table

    def prior(self) -> tuple[float, float]:
        """``(k·m, k·(1 - m))``, with ``m`` kept inside [0.01, 0.99] so that both parameters stay positive."""
        m = min(0.99, max(0.01, self.recent_rate))
        return self.prior_rollouts * m, self.prior_rollouts * (1.0 - m)

    def counts(self, key: str) -> tuple[float, float]:
        """A prompt's (decayed) passes and fails; (0, 0) when cold. Counts nothing."""
        passes, fails = self._table.get(key, (0.0, 0.0))
        return passes, fails

    def lookup(self, keys: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Posterior ``(a, b)`` per key (prior plus the prompt's counts); ages each warm key once (``decay``)."""
        a0, b0 = self.prior()
        a, b = [], []
        for key in keys:
            if key in self._table:
                self._table.touch(key)  # journaled before the change (see mark)
                entry = self._table[key]
                entry[0] *= self.decay
                entry[1] *= self.decay
                passes, fails = entry
            else:
                passes = fails = 0.0
            a.append(a0 + passes)
            b.append(b0 + fails)
        return torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)

    def update(self, key: str, passes: int, fails: int) -> None:
        """Add one observed group's passes and fails to ``key``."""
        if passes < 0 or fails < 0:
            raise ValueError(f"passes and fails must be >= 0, got {passes}, {fails}")
        old = self._table.get(key, (0.0, 0.0))
        self._table.put(key, [old[0] + passes, old[1] + fails])  # most recently used; the oldest evicted

    def observe_batch(self, passes: int, total: int) -> None:
        """The latest batch's pass rate over its kept rollouts: the mean of the cold prior from now on."""
        if total > 0:
            self.recent_rate = passes / total

    def state_dict(self) -> dict:
        return {"table": [[key, p, f] for key, (p, f) in self._table.items()], "recent_rate": self.recent_rate}

    def load_state_dict(self, state: dict) -> None:
        self._table.load((str(k), [float(p), float(f)]) for k, p, f in state["table"])
        self.recent_rate = float(state["recent_rate"])

    def mark(self):
        """A function giving :meth:`state_dict` as it is now, until the next mark: O(1) now, the table rebuilt from
        the changes since when it is called (:class:`~trl_fp8.duet.lru.LruTable`)."""
        mark, recent_rate = self._table.mark(), self.recent_rate

        def state() -> dict:
            return {"table": [[key, p, f] for key, (p, f) in self._table.items_at_mark(mark)],
                    "recent_rate": recent_rate}
        return state


def total_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each row's total reward as TRL sums it (``(rewards_per_func * weights).nansum(dim=1)``: a function that
    returned None — TRL's NaN, "does not apply to this sample" — is left out), and NaN where every function returned
    None: such a rollout was not judged at all, so it is neither a pass nor a fail (:meth:`PassRates.update` never
    sees it; TRL itself warns about such rows and lets them count 0 in the advantage)."""
    weighted = rewards_per_func * weights.to(rewards_per_func.device).unsqueeze(0)
    total = weighted.nansum(dim=1)
    return torch.where(torch.isnan(rewards_per_func).all(dim=1), torch.full_like(total, float("nan")), total)


def passes_and_fails(rewards, threshold: float) -> tuple[int, int]:
    """Passes (reward >= ``threshold``) and fails among ``rewards``; a NaN reward (no reward function applied to
    it) is neither."""
    values = [float(r) for r in rewards]
    judged = [v for v in values if v == v]  # NaN != NaN
    passes = sum(v >= threshold for v in judged)
    return passes, len(judged) - passes


def allocate_by_variance(
    a: torch.Tensor, b: torch.Tensor, lengths: torch.Tensor, budget: float, n_min: int, n_max: int,
    cold: torch.Tensor | None = None, screen: int = 0, rng: random.Random | None = None,
    min_inclusion: float = 0.05,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rollouts per prompt, inclusion probabilities and each prompt's value ``V_q(n_max)``.

    ``a, b``: the pass-rate posterior per prompt; ``lengths``: expected rollout length; ``budget``: generated
    tokens for the batch (in expectation). With ``screen > 0`` the ``cold`` prompts first get ``screen`` rollouts each
    (their cost comes off the budget; their inclusion is 1); then, in order of ``V_q(n_max) / L_q`` (ties in prompt
    order), each prompt's group is filled up to ``n_max`` while the budget lasts -- a partial group if what is left
    reaches ``n_min`` (for a cold prompt: anything above its screen). A warm prompt left with no rollouts gets
    ``n_min`` with probability ``min_inclusion`` (one draw from ``rng`` each, in prompt order; without ``rng``, none)
    and that inclusion probability; the realised cost exceeds the budget by those coins' luck. When the budget fits
    no group at all, the first prompt in that order gets ``n_min`` (a step never samples nothing)."""
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    lengths = torch.as_tensor(lengths, dtype=torch.float64)
    if not (a.ndim == 1 and a.shape == b.shape == lengths.shape):
        raise ValueError(f"a, b and lengths must be 1-D of equal size, got {tuple(a.shape)}, {tuple(b.shape)}, "
                         f"{tuple(lengths.shape)}")
    if torch.any(lengths <= 0):
        raise ValueError("lengths must be positive")
    if not 2 <= n_min <= n_max:
        raise ValueError(f"need 2 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
    if screen and not 2 <= screen <= n_max:
        raise ValueError(f"screen must be 0 or in [2, n_max={n_max}], got {screen}")
    if not 0 < min_inclusion <= 1:
        raise ValueError(f"min_inclusion must be in (0, 1], got {min_inclusion}")
    size = a.numel()
    cold = torch.zeros(size, dtype=torch.bool) if cold is None else torch.as_tensor(cold, dtype=torch.bool)
    counts = torch.zeros(size, dtype=torch.long)
    inclusion = torch.ones(size, dtype=torch.float64)
    value = torch.tensor([variance_probability(float(x), float(y), n_max) for x, y in zip(a, b)], dtype=torch.float64)
    left = float(budget)
    if screen:
        counts[cold] = screen
        left -= float((lengths[cold] * screen).sum())
    order = sorted(range(size), key=lambda q: (-float(value[q] / lengths[q]), q))
    for q in order:
        have = int(counts[q])
        fits = int(max(0.0, left) // float(lengths[q]))
        give = min(n_max - have, fits)
        if have == 0 and give < n_min:
            continue
        if give > 0:
            counts[q] = have + give
            left -= give * float(lengths[q])
    if size and int(counts.sum()) == 0:  # the budget fits no group where it is best spent: the best prompt gets the
        counts[order[0]] = n_min  # smallest group (certainly: a step that samples nothing is a wasted step)
    for q in range(size):
        if counts[q] == 0:
            inclusion[q] = min_inclusion
            if rng is not None and rng.random() < min_inclusion:
                counts[q] = n_min
    return counts, inclusion, value

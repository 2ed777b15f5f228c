"""How many rollouts each prompt gets under a token budget (DUET axis 1), and the matching weights.

Cost-weighted Neyman allocation: the target ``t_q = s_q / sqrt(λ L_q)`` with ``s_q`` the prompt's informativeness
and ``L_q`` its expected rollout length, under ``Σ n_q L_q <= budget`` (in expectation) and
``n_q ∈ {0} ∪ [n_min, n_max]``. Pure PyTorch, no TRL.

**No lone rollouts.** GRPO's advantages are relative to the group: a prompt with a single rollout gets advantage 0
and teaches nothing, so with ``n_min = 2`` (the default) a prompt gets either no rollout or a group of at least two.
A prompt whose target is below ``n_min`` is *sampled*: it gets ``n_min`` rollouts with probability
``π_q = clamp(t_q / n_min, π_min, 1)`` and none otherwise -- the expected count is the target (above the floor),
and weighting a sampled prompt by ``1 / π_q`` (Horvitz-Thompson) keeps the batch gradient unbiased over which prompts
were sampled: ``E[1{q sampled} / π_q] = 1`` for every prompt, because every prompt has ``π_q >= π_min > 0``.
"""

from __future__ import annotations

import math
import random

import torch


def _targets(s: torch.Tensor, lengths: torch.Tensor, lam: float) -> torch.Tensor:
    return s / torch.sqrt(lam * lengths)


def inclusion_probabilities(targets: torch.Tensor, n_min: int, min_inclusion: float) -> torch.Tensor:
    """``π_q``: 1 where the target reaches ``n_min``, else ``clamp(t_q / n_min, min_inclusion, 1)``."""
    return torch.where(targets >= n_min, torch.ones_like(targets),
                       (targets / n_min).clamp(min=min_inclusion, max=1.0))


def _expected_counts(targets: torch.Tensor, n_min: int, n_max: int, min_inclusion: float) -> torch.Tensor:
    """Counts of prompts whose target reaches ``n_min`` (rounded, clipped); ``π_q · n_min`` for the others."""
    whole = torch.clamp(torch.round(targets), n_min, n_max)
    return torch.where(targets >= n_min, whole, inclusion_probabilities(targets, n_min, min_inclusion) * n_min)


def allocate_rollouts(
    s: torch.Tensor, lengths: torch.Tensor, budget: float, n_min: int = 2, n_max: int = 32,
    rng: random.Random | None = None, min_inclusion: float = 0.05, iters: int = 80, at_least_one: bool = True,
) -> tuple[torch.Tensor, float, torch.Tensor]:
    """Rollouts per prompt, the multiplier λ and the inclusion probabilities ``π_q``.

    ``n_q = clip(round(t_q), n_min, n_max)`` where ``t_q = s_q / sqrt(λ L_q) >= n_min``; below, ``n_q = n_min`` with
    probability ``π_q`` (one draw from ``rng`` per such prompt, in prompt order) else 0. λ is found by bisection on
    log λ: the smallest λ whose *expected* cost ``Σ E[n_q] L_q`` fits the budget. The realised cost can exceed the
    budget by the sampled prompts' luck; it is ``budget`` on average. With ``rng=None`` nothing is sampled: a prompt
    below ``n_min`` gets ``n_min`` when ``π_q >= 0.5``, else 0 (deterministic rounding, for inspection and tests).
    Zero informativeness everywhere means nothing to learn: every prompt is sampled at ``min_inclusion``.

    ``at_least_one`` (default): a batch where every prompt's coin failed still gets one group (see
    :func:`_at_least_one_group`): a step that samples nothing is a wasted optimizer step, and it would log no reward.
    """
    s = torch.as_tensor(s, dtype=torch.float64).clamp(min=0)
    lengths = torch.as_tensor(lengths, dtype=torch.float64)
    if s.ndim != 1 or s.shape != lengths.shape:
        raise ValueError(f"s and lengths must be 1-D of equal size, got {tuple(s.shape)} and {tuple(lengths.shape)}")
    if torch.any(lengths <= 0):
        raise ValueError("lengths must be positive")
    if not 1 <= n_min <= n_max:
        raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
    if not 0 < min_inclusion <= 1:
        raise ValueError(f"min_inclusion must be in (0, 1], got {min_inclusion}")

    def cost(lam):
        return float((_expected_counts(_targets(s, lengths, lam), n_min, n_max, min_inclusion) * lengths).sum())

    lam = float("inf")
    targets = torch.zeros_like(s)
    if s.max() > 0:
        # t_q reaches n_max + 0.5 everywhere when lam <= lo; t_q < n_min * min_inclusion everywhere when lam >= hi
        positive = s > 0
        lo = math.log(float(((s[positive] / (n_max + 0.5)) ** 2 / lengths[positive]).min())) - 1.0
        hi = math.log(float(((s[positive] / (n_min * min_inclusion)) ** 2 / lengths[positive]).max())) + 1.0
        if cost(math.exp(lo)) <= budget:
            lam = math.exp(lo)
        else:
            for _ in range(iters):  # invariant: cost(lo) > budget; cost(hi) is the floor's cost, the least possible
                mid = 0.5 * (lo + hi)
                if cost(math.exp(mid)) > budget:
                    lo = mid
                else:
                    hi = mid
            lam = math.exp(hi)
        targets = _targets(s, lengths, lam)
    inclusion = inclusion_probabilities(targets, n_min, min_inclusion)
    counts = torch.clamp(torch.round(targets), n_min, n_max).long()
    for q in (targets < n_min).nonzero().flatten().tolist():
        draw = rng.random() if rng is not None else 0.5
        counts[q] = n_min if draw < float(inclusion[q]) else 0
    if at_least_one and s.numel():
        counts, inclusion = _at_least_one_group(counts, inclusion, n_min, rng)
    return counts, lam, inclusion


def _at_least_one_group(counts: torch.Tensor, inclusion: torch.Tensor, n_min: int,
                        rng: random.Random | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch never samples nothing: when every prompt's coin failed (probability ``P0 = Π (1 - π_q)``), one prompt
    is picked with probability ``π_q / Σ π`` and given ``n_min`` rollouts (one more draw from ``rng``; without it, the
    largest ``π_q``). The returned inclusion probabilities are the marginal ones of this two-stage draw,
    ``π'_q = π_q + P0 · π_q / Σ π``, so weighting by ``1 / π'_q`` keeps the Horvitz-Thompson estimate unbiased. The
    expected cost grows by ``P0 · n_min · L``: the budget is exceeded in expectation by that much."""
    p0 = float(torch.prod(1.0 - inclusion))
    if p0 <= 0.0:  # some prompt is certain to get rollouts
        return counts, inclusion
    share = inclusion / inclusion.sum()
    inclusion = inclusion + p0 * share
    if int(counts.sum()) == 0:
        if rng is None:
            q = int(torch.argmax(share))
        else:
            draw, cumulative, q = rng.random(), 0.0, len(share) - 1
            for i, x in enumerate(share.tolist()):
                cumulative += x
                if draw < cumulative:
                    q = i
                    break
        counts = counts.clone()
        counts[q] = n_min
    return counts, inclusion


def propensities(n: torch.Tensor, min_propensity: float = 0.05) -> torch.Tensor:
    """``p_q = clamp(n_q / mean(n), min_propensity, 1)``, the mean over prompts that got rollouts: how
    under-allocated each generated prompt is (prompts with none get ``min_propensity``; they have no rows)."""
    n = torch.as_tensor(n, dtype=torch.float64)
    generated = n[n > 0]
    if generated.numel() == 0:
        return torch.full_like(n, min_propensity)
    return (n / generated.mean()).clamp(min_propensity, 1.0)


def importance_weights(
    p: torch.Tensor, eps_kept: torch.Tensor, keep_prob: float = 0.05, min_propensity: float = 0.05,
    max_weight: float = 1000.0, inclusion: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-rollout weight ``(1 / max(p, min_propensity)) · (1 / π) · (1 / keep_prob if ε-kept else 1)``, clamped;
    ``π`` is the prompt's inclusion probability (1 when not given)."""
    p = torch.as_tensor(p, dtype=torch.float64)
    w = 1.0 / p.clamp(min=min_propensity)
    if inclusion is not None:
        w = w / torch.as_tensor(inclusion, dtype=torch.float64)
    w = torch.where(torch.as_tensor(eps_kept, dtype=torch.bool), w / keep_prob, w)
    return w.clamp(max=max_weight)

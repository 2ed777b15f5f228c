"""How many rollouts each prompt gets under a token budget (DUET axis 1), and the matching propensities.

Cost-weighted Neyman allocation: ``n_q ∝ s_q / sqrt(L_q)`` with ``s_q`` the prompt's informativeness and
``L_q`` its expected rollout length, subject to ``Σ n_q L_q <= budget`` and ``n_min <= n_q <= n_max``.
Pure PyTorch, no TRL.
"""

from __future__ import annotations

import math

import torch


def _counts(s: torch.Tensor, lengths: torch.Tensor, lam: float, n_min: int, n_max: int) -> torch.Tensor:
    return torch.clamp(torch.round(s / torch.sqrt(lam * lengths)), n_min, n_max).long()


def allocate_rollouts(
    s: torch.Tensor, lengths: torch.Tensor, budget: float, n_min: int = 1, n_max: int = 32, iters: int = 80
) -> tuple[torch.Tensor, float]:
    """Rollouts per prompt and the multiplier λ: ``n_q = clip(round(s_q / sqrt(λ L_q)), n_min, n_max)``.

    λ is found by bisection on log λ: the smallest λ whose allocation fits the budget (so the budget is used
    as fully as the rounding allows). If even that overshoots, or ``n_min`` everywhere already does, the prompt
    with the largest ``L_q`` among those above ``n_min`` is decremented until the budget holds (or all are at
    ``n_min``). Zero informativeness everywhere gives ``n_min`` for all.
    """
    s = torch.as_tensor(s, dtype=torch.float64).clamp(min=0)
    lengths = torch.as_tensor(lengths, dtype=torch.float64)
    if s.ndim != 1 or s.shape != lengths.shape:
        raise ValueError(f"s and lengths must be 1-D of equal size, got {tuple(s.shape)} and {tuple(lengths.shape)}")
    if torch.any(lengths <= 0):
        raise ValueError("lengths must be positive")
    if not 1 <= n_min <= n_max:
        raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")

    def cost(n):
        return float((n.double() * lengths).sum())

    lam = float("inf")
    n = torch.full_like(s, n_min, dtype=torch.long)
    if s.max() > 0:
        # n_q >= 1 needs lam <= (s/0.5)^2 / L; n_q <= n_max reached when lam <= (s/(n_max+0.5))^2 / L
        positive = s > 0
        hi = math.log(float(((s[positive] / 0.5) ** 2 / lengths[positive]).max())) + 1.0
        lo = math.log(float(((s[positive] / (n_max + 0.5)) ** 2 / lengths[positive]).min())) - 1.0
        if cost(_counts(s, lengths, math.exp(lo), n_min, n_max)) <= budget:
            lam = math.exp(lo)
        else:
            for _ in range(iters):  # invariant: cost(lo) > budget >= cost(hi)
                mid = 0.5 * (lo + hi)
                if cost(_counts(s, lengths, math.exp(mid), n_min, n_max)) > budget:
                    lo = mid
                else:
                    hi = mid
            lam = math.exp(hi)
        n = _counts(s, lengths, lam, n_min, n_max)
    while cost(n) > budget:
        above = n > n_min
        if not above.any():
            break
        masked = torch.where(above, lengths, torch.full_like(lengths, -1.0))
        n[int(torch.argmax(masked))] -= 1
    return n, lam


def propensities(n: torch.Tensor, min_propensity: float = 0.05) -> torch.Tensor:
    """``p_q = clamp(n_q / mean(n), min_propensity, 1)``: how under-allocated each prompt is."""
    n = torch.as_tensor(n, dtype=torch.float64)
    return (n / n.mean()).clamp(min_propensity, 1.0)


def importance_weights(
    p: torch.Tensor, eps_kept: torch.Tensor, keep_prob: float = 0.05, min_propensity: float = 0.05,
    max_weight: float = 1000.0,
) -> torch.Tensor:
    """Per-rollout weight ``(1 / max(p, min_propensity)) · (1 / keep_prob if ε-kept else 1)``, clamped."""
    p = torch.as_tensor(p, dtype=torch.float64)
    w = 1.0 / p.clamp(min=min_propensity)
    w = torch.where(torch.as_tensor(eps_kept, dtype=torch.bool), w / keep_prob, w)
    return w.clamp(max=max_weight)

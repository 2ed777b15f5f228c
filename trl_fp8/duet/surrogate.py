"""DUET's per-prompt surrogate: how informative a prompt's rollouts are, and how long they run.

Pure Python/PyTorch, no TRL. Informativeness of a group of rollouts is the standard deviation of
``g_i = Ā_i · Σ_t log π_old(y_i,t)`` (token-mean advantage times summed log-probability): zero when all
rewards in the group agree. Warm prompts keep a running (Welford) mean of it and of their kept lengths, keyed by
prompt id in a bounded LRU table; cold prompts get a prior.

With ``prior_strength`` k > 0 a prompt's estimate is shrunk towards the mean over every group observed so far
(``m``): ``(count * mean + k * m) / (count + k)``, and a cold prompt gets ``m``. One group of a few rollouts is a
noisy estimate -- with 4 rollouts a prompt of pass rate 0.5 shows zero variance one time in eight -- and without
shrinkage a single zero keeps a prompt at (almost) no rollouts until it is re-probed; the cold prior 1.0 is also on
another scale than the observed values. k = 0 is the unshrunk estimate.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .lru import LruTable


def informativeness(advantages: torch.Tensor, sum_logps: torch.Tensor) -> float:
    """Std (population) of ``advantages * sum_logps`` over one group's kept rollouts; 0 for fewer than 2."""
    g = torch.as_tensor(advantages, dtype=torch.float64) * torch.as_tensor(sum_logps, dtype=torch.float64)
    if g.numel() < 2:
        return 0.0
    return float(g.std(unbiased=False))


@dataclass
class _Entry:
    count: int = 0
    mean_s: float = 0.0
    mean_len: float = 0.0
    since_update: int = 0


class PromptStats:
    """Running informativeness and length per prompt id (LRU-bounded to ``capacity`` prompts).

    ``reprobe_every``: a warm prompt that has not been updated for that many allocations is flagged for a
    re-probe (the trainer then gives it at least 2 rollouts), so a prompt once seen with zero variance does not
    stay at one rollout -- which can never be updated -- for good.
    """

    def __init__(self, capacity: int = 100_000, prior_s: float = 1.0, default_length: float = 64.0,
                 reprobe_every: int = 4, prior_strength: float = 0.0):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if not prior_strength >= 0:
            raise ValueError(f"prior_strength must be >= 0, got {prior_strength}")
        self.capacity = capacity
        self.prior_s = float(prior_s)
        self.prior_strength = float(prior_strength)
        self.groups = 0  # groups observed in all, and the mean of their informativeness: the shrinkage target
        self.mean_all = 0.0
        self.default_length = float(default_length)
        self.reprobe_every = int(reprobe_every)
        self._table = LruTable(capacity, dataclasses.replace)  # key -> _Entry, least recently used first
        self._recent_lengths: list[float] = []

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, key) -> bool:
        return key in self._table

    def update(self, key: str, s: float, lengths: list[float]) -> None:
        """Record one observed group (>= 2 kept rollouts) of prompt ``key``."""
        if len(lengths) < 2:
            return
        self.groups += 1
        self.mean_all += (s - self.mean_all) / self.groups
        old = self._table.get(key) or _Entry()
        e = dataclasses.replace(old)
        e.count += 1
        e.mean_s += (s - e.mean_s) / e.count
        e.mean_len += (sum(lengths) / len(lengths) - e.mean_len) / e.count
        e.since_update = 0
        self._table.put(key, e)  # most recently used at the end; the oldest evicted

    def observe_batch_lengths(self, lengths: list[float]) -> None:
        """Kept lengths of the latest batch: the length estimate of cold prompts."""
        if lengths:
            self._recent_lengths = list(lengths)

    def cold_length(self) -> float:
        if self._recent_lengths:
            return sum(self._recent_lengths) / len(self._recent_lengths)
        return self.default_length

    def state_dict(self) -> dict:
        """The table (in LRU order) and the latest batch's lengths: plain lists, for a checkpoint."""
        return {
            "table": [[key, e.count, e.mean_s, e.mean_len, e.since_update] for key, e in self._table.items()],
            "recent_lengths": list(self._recent_lengths),
            "groups": self.groups,
            "mean_all": self.mean_all,
        }

    def mark(self):
        """A function giving :meth:`state_dict` as it is now, until the next mark: O(1) for the table now (it is
        rebuilt from the changes since when the function is called, :class:`~trl_fp8.duet.lru.LruTable`), the
        latest batch's lengths copied."""
        mark = self._table.mark()
        rest = {"recent_lengths": list(self._recent_lengths), "groups": self.groups, "mean_all": self.mean_all}

        def state() -> dict:
            return {"table": [[key, e.count, e.mean_s, e.mean_len, e.since_update]
                              for key, e in self._table.items_at_mark(mark)], **rest}
        return state

    def load_state_dict(self, state: dict) -> None:
        self._table.load(
            (str(key), _Entry(int(count), float(mean_s), float(mean_len), int(since)))
            for key, count, mean_s, mean_len, since in state["table"]
        )
        self._recent_lengths = list(state["recent_lengths"])
        self.groups = int(state.get("groups", 0))  # absent in checkpoints written before shrinkage: start afresh
        self.mean_all = float(state.get("mean_all", 0.0))

    def idle(self, key: str) -> bool:
        """Whether ``key`` is warm, every group observed of it had one reward throughout (informativeness 0: its
        advantages were all 0), and it is not due for a re-probe at its next allocation: a prompt a step can skip
        (see :meth:`trl_fp8.duet.controller.DuetController.refill`). Counts nothing."""
        e = self._table.get(key)
        if e is None or e.mean_s > 0:
            return False
        return not (self.reprobe_every > 0 and e.since_update + 1 > self.reprobe_every)

    def touch(self, key: str) -> None:
        """Count one allocation of a warm ``key`` that a step looked at and skipped (as :meth:`lookup` counts one),
        so that a skipped prompt still comes due for its re-probe; a cold key is left alone."""
        e = self._table.get(key)
        if e is not None:
            self._table.changing(key)
            e.since_update += 1

    def lookup(self, keys: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(s, L, warm, reprobe) tensors for ``keys``; counts one allocation for each warm key."""
        s, lengths, warm, reprobe = [], [], [], []
        k = self.prior_strength
        shrink = k > 0 and self.groups > 0
        for key in keys:
            e = self._table.get(key)
            if e is None:
                s.append(self.mean_all if shrink else self.prior_s)
                lengths.append(self.cold_length())
                warm.append(False)
                reprobe.append(False)
                continue
            self._table.touch(key)  # journaled before the change
            e.since_update += 1
            s.append((e.count * e.mean_s + k * self.mean_all) / (e.count + k) if shrink else e.mean_s)
            lengths.append(max(e.mean_len, 1.0))
            warm.append(True)
            reprobe.append(self.reprobe_every > 0 and e.since_update > self.reprobe_every)
        return (torch.tensor(s, dtype=torch.float64), torch.tensor(lengths, dtype=torch.float64),
                torch.tensor(warm), torch.tensor(reprobe))


class LengthQuantiles:
    """K1 / K2: the 30th / 80th percentiles of recent kept lengths, refit every ``refit_every`` steps once
    ``min_count`` lengths were seen (until then both are infinite: no abort before calibration)."""

    def __init__(self, q1: float = 0.3, q2: float = 0.8, window: int = 2048, refit_every: int = 10,
                 min_count: int = 32):
        self.q1, self.q2 = q1, q2
        self.window, self.refit_every, self.min_count = window, refit_every, min_count
        self.lengths: list[float] = []
        self.k1 = self.k2 = math.inf
        self._steps = 0

    def add(self, lengths: list[float]) -> None:
        self.lengths = (self.lengths + list(lengths))[-self.window:]

    def state_dict(self) -> dict:
        return {"lengths": list(self.lengths), "k1": self.k1, "k2": self.k2, "steps": self._steps}

    def load_state_dict(self, state: dict) -> None:
        self.lengths = list(state["lengths"])
        self.k1, self.k2 = float(state["k1"]), float(state["k2"])
        self._steps = int(state["steps"])

    def step(self) -> None:
        """Called once per training step; refits when due."""
        if len(self.lengths) >= self.min_count and self._steps % self.refit_every == 0:
            t = torch.tensor(self.lengths, dtype=torch.float64)
            self.k1 = float(torch.quantile(t, self.q1))
            self.k2 = float(torch.quantile(t, self.q2))
        self._steps += 1

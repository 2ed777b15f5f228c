"""The weight-sync checks on many processes (DDP): every rank checks its own sampler, and the ranks agree.

- :func:`agree`: after each sync, every rank's results (and a digest of what its sync sent) go to every rank in one
  all-gather; each check becomes one result for all ranks — passed where every rank that compared something
  passed, else failed with the first failing rank's message (naming it and the other failing ranks). Every rank
  then raises (or warns) with the *same* error, so a fault on one rank stops them all instead of leaving the others
  waiting in the next collective. The digests add one check DDP needs: every replica serves the same bits
  (reported under ``freshness``).
- :func:`reduce_stats`: the logprob check's token sums over the global batch (one all-gather), so its band judges
  the same numbers, and keeps the same state, on every rank.

Metrics are recorded once, from the agreed results (``sync/<check>``: 1 only if every rank passed; the
``sync/logp_gap_*`` gaps of the global batch).
"""

from __future__ import annotations

import torch

from .. import distributed
from .checks import LOGPROB_STAT_OPS, CheckResult

_GOLDEN64 = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64 (wrapping multiplication)


@torch.no_grad()
def tensor_digest(t: torch.Tensor) -> int:
    """A position-weighted sum of the tensor's bit pattern (on its own device, wrapping int64): equal bits give equal
    digests; changing any one element changes it."""
    t = t.detach().contiguous()
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    x = t.view(bits).reshape(-1).to(torch.int64) if t.is_floating_point() else t.reshape(-1).to(torch.int64)
    weights = torch.arange(1, x.numel() + 1, dtype=torch.int64, device=x.device) * _GOLDEN64 | 1
    return int((x * weights).sum().item())


def digests(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    return {name: tensor_digest(t) for name, t in tensors.items()}


def agree(results: list[CheckResult], sent: dict[str, int] | None = None, step: int | None = None,
          error: str | None = None) -> list[CheckResult]:
    """One all-gather; the same merged results on every rank. ``sent``: this rank's digests of what its sync sent
    (compared with rank 0's); ``error``: an exception this rank hit while checking (it fails the round everywhere)."""
    payload = ([(r.check, r.passed, r.message, r.metrics, r.applicable) for r in results], sent, error)
    everyone = distributed.gather_objects(payload)
    order: list[str] = []
    by_check: dict[str, list[tuple[int, tuple]]] = {}
    for rank, (items, _, _) in enumerate(everyone):
        for item in items:
            if item[0] not in by_check:
                order.append(item[0])
                by_check[item[0]] = []
            by_check[item[0]].append((rank, item))
    merged = []
    for check in order:
        entries = by_check[check]
        applicable = [(rank, item) for rank, item in entries if item[4]]
        if not applicable:
            merged.append(CheckResult(check, True, entries[0][1][2], applicable=False))
            continue
        failing = [(rank, item) for rank, item in applicable if not item[1]]
        metrics = dict(applicable[0][1][3])
        if not failing:
            merged.append(CheckResult(check, True, metrics=metrics))
            continue
        rank, item = failing[0]
        others = [r for r, _ in failing[1:]]
        plural = "s" if len(others) > 1 else ""
        also = f" (also failing on rank{plural} {', '.join(map(str, others))})" if others else ""
        merged.append(CheckResult(check, False, f"on rank {rank} of {len(everyone)}: {item[2]}{also}", metrics))
    reference = everyone[0][1]
    if reference is not None:
        for rank, (_, sent_r, _) in enumerate(everyone[1:], start=1):
            differ = sorted(n for n in reference if sent_r is None or sent_r.get(n) != reference[n])
            if differ:
                at = f" at step {step}" if step is not None else ""
                merged.insert(0, CheckResult(
                    "freshness", False, f"the replicas do not serve the same weights{at}: rank {rank} sent other bits "
                    f"than rank 0 for {len(differ)} tensor(s), e.g. {', '.join(repr(n) for n in differ[:3])}"))
                break
    for rank, (_, _, err) in enumerate(everyone):
        if err is not None:
            merged.append(CheckResult("sync_checks", False,
                                      f"rank {rank} of {len(everyone)} failed while checking: {err}"))
            break
    return merged


def reduce_stats(stats: dict, device=None) -> dict:
    """The logprob check's token statistics summed (maxed) over every rank."""
    keys = list(LOGPROB_STAT_OPS)
    hist = [float(v) for v in stats["hist"]]
    values = distributed.reduce_floats([float(stats[k]) for k in keys] + hist,
                                       [LOGPROB_STAT_OPS[k] for k in keys] + ["sum"] * len(hist), device)
    out = dict(zip(keys, values[: len(keys)], strict=True))
    out["hist"] = values[len(keys):]
    out["count"], out["covered"] = int(out["count"]), int(out["covered"])
    out["where"] = None  # a token index of one rank's batch means nothing globally
    return out

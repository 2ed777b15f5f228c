"""The share of an optimizer step's update that round-to-nearest into a 16-bit served dtype drops: pure torch.

For a sampled element with master value ``w`` before the step and ``w + δ`` after it, the served copy under
round-to-nearest moves iff ``RN(w + δ) != RN(w)``. The share dropped is ``Σ |δ|·[RN(w + δ) = RN(w)] / Σ |δ|``: the
part of the step's update (by magnitude) that did not move the served copy this step. It stays in the fp32 master and
reaches the served copy only once the updates add up to the nearest rounding boundary — the sampler lags the learner
meanwhile (stochastic rounding passes every update in expectation). 0: every updated element's served value moved;
1: none did. A step that moved no sampled element gives no reading (None), not a ratio of zeros.
"""

from __future__ import annotations

import torch

ELEMENTS = 4096  # sampled elements per tensor
TENSORS = 64  # sampled tensors, spread evenly over the trained ones


def sample_sizes(numels: list[int], elements: int = ELEMENTS, tensors: int = TENSORS) -> list[int]:
    """The number of elements sampled from each chosen tensor (the chosen: ``tensors`` spread evenly over
    ``numels``)."""
    return [min(elements, numels[i]) for i in chosen(len(numels), tensors)]


def chosen(n: int, tensors: int = TENSORS) -> list[int]:
    """Indices of ``min(n, tensors)`` of ``n`` tensors, spread evenly (first and last included)."""
    if n <= tensors:
        return list(range(n))
    return sorted({round(i * (n - 1) / (tensors - 1)) for i in range(tensors)})


class DroppedShare:
    """A fixed sample of the trained tensors (``[(name, parameter)]``): ``begin()`` before an optimizer step,
    ``end()`` after it returns the share of the step's update that round-to-nearest into ``dtype`` dropped."""

    def __init__(self, params: list[tuple[str, torch.Tensor]], dtype: torch.dtype = torch.bfloat16,
                 elements: int = ELEMENTS, tensors: int = TENSORS, seed: int = 0):
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"the served dtype must be torch.bfloat16 or torch.float16, got {dtype}.")
        generator = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        self.samples = []
        for i in chosen(len(params), tensors):
            name, param = params[i]
            n = param.numel()
            k = min(elements, n)
            index = torch.randperm(n, generator=generator)[:k].sort().values if k < n else torch.arange(n)
            self.samples.append((name, param, index.to(param.device)))
        self.before: list[torch.Tensor] | None = None

    @property
    def elements(self) -> int:
        return sum(index.numel() for _, _, index in self.samples)

    def _read(self) -> list[torch.Tensor]:
        return [param.detach().reshape(-1).index_select(0, index).float() for _, param, index in self.samples]

    def begin(self) -> None:
        self.before = self._read()

    def end(self) -> float | None:
        """The share dropped by the step since :meth:`begin` (None: no sampled element moved, or no begin)."""
        if self.before is None or not self.samples:
            return None
        before, self.before = self.before, None
        sums: dict[torch.device, list[torch.Tensor]] = {}
        for w0, w1 in zip(before, self._read()):
            delta = (w1 - w0).abs().double()
            kept = w1.to(self.dtype) == w0.to(self.dtype)
            sums.setdefault(delta.device, []).append(torch.stack([(delta * kept).sum(), delta.sum()]))
        dropped, total = (sum(values) for values in zip(*(torch.stack(v).sum(0).tolist() for v in sums.values())))
        if not total > 0:
            return None
        return dropped / total

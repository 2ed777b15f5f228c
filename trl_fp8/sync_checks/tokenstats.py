"""The token statistics of the logprob-agreement check: sums, counts, extremes and a histogram of the per-token gap
``|logπ_learner − logμ_sampler|`` on one batch, in a form ranks combine exactly (:data:`LOGPROB_STAT_OPS`).

:func:`logprob_stats` is computed by a few tensor operations on any device; on a CPU, where the compiled kernels
of :mod:`trl_fp8.native` are built, by one call into them instead (one pass over the batch, no
temporaries: the check runs on every batch, and on a small batch its two dozen tensor operations cost more than
the arithmetic). Both give the same counts, largest gap (and where it is) and histogram; sums and exponentials agree to
rounding (tested).
"""

from __future__ import annotations

import math

import torch

# |Δ logp| histogram of the logprob check: log-spaced bins, so the fraction of tokens over a band is exact to one bin
# (a ratio of 10^(1/HIST_PER_DECADE) ≈ 1.047) and ranks add their counts.
HIST_LOW, HIST_DECADES, HIST_PER_DECADE = 1e-5, 7, 50
HIST_BINS = HIST_DECADES * HIST_PER_DECADE + 2  # + one below HIST_LOW, one at or above HIST_LOW × 10^HIST_DECADES


_HIST_EDGES: dict = {}  # (device, dtype) -> the bins' lower edges HIST_LOW·10^(j/m), j = 0 … HIST_DECADES·m


def _edges(device, dtype) -> torch.Tensor:
    """The bins' lower edges (ascending), cached per device and dtype."""
    key = (device, dtype)
    edges = _HIST_EDGES.get(key)
    if edges is None:
        exponents = torch.arange(HIST_BINS - 1, dtype=torch.float64) / HIST_PER_DECADE
        edges = _HIST_EDGES[key] = (HIST_LOW * torch.pow(10.0, exponents)).to(device=device, dtype=dtype)
    return edges


def _histogram_counts(deltas: torch.Tensor) -> torch.Tensor:
    """The float64 counts of :func:`delta_histogram`, on ``deltas``' device."""
    edges = _edges(deltas.device, deltas.dtype)
    # the number of edges at or below each delta is its bin: 0 below HIST_LOW, HIST_BINS - 1 from the last edge up
    bins = torch.bucketize(deltas.detach(), edges, right=True)
    return torch.bincount(bins, minlength=HIST_BINS).double()


def delta_histogram(deltas: torch.Tensor) -> list[float]:
    """Counts of ``deltas`` (>= 0) per bin: bin 0 below HIST_LOW, bin k for [HIST_LOW·10^((k−1)/m), ·10^(k/m))."""
    return _histogram_counts(deltas).tolist()


def over_fraction(stats: dict, limit: float) -> float:
    """Fraction of the masked tokens whose |Δ logp| exceeds ``limit`` (counted from the bin holding ``limit`` up)."""
    hist, count = stats.get("hist"), stats["count"]
    if not hist or not count:
        return 0.0
    first = 0 if limit < HIST_LOW else min(HIST_BINS - 1, int(math.floor(math.log10(limit / HIST_LOW)
                                                                            * HIST_PER_DECADE)) + 1)
    return float(sum(hist[first + 1:])) / count



# How each entry of :func:`logprob_stats` combines over ranks ("hist": element-wise sum).
LOGPROB_STAT_OPS = {"sum": "sum", "sq_sum": "sum", "count": "sum", "max": "max", "explained_sum": "sum",
                    "path_sum": "sum", "judged_sum": "sum", "judged_sq_sum": "sum", "covered": "sum", "numerics": "max",
                    "partial": "max", "ratio_sum": "sum", "ratio_min": "min", "ratio_max": "max",
                    "seq_ratio_sum": "sum", "seq_ratio_min": "min", "seq_ratio_max": "max", "seqs": "sum"}


def logprob_stats(learner_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor,
                  numerics_logps: torch.Tensor | None = None, numerics_mask: torch.Tensor | None = None) -> dict:
    """Token sums of the logprob check on one batch: |learner − sampler| over ``mask`` (sum, sum of squares, count,
    max, where the max is, a histogram), the importance ratios, and over the tokens the reference covers the
    |learner − ρ|, |ρ − sampler| and |learner − sampler| sums (the last with its sum of squares). Sums, counts,
    minima and maxima, so that ranks combine them exactly (:data:`LOGPROB_STAT_OPS`). On the CPU, one call into the compiled kernels where they are built."""
    out = {"sum": 0.0, "sq_sum": 0.0, "count": 0, "max": 0.0, "explained_sum": 0.0, "path_sum": 0.0,
           "judged_sum": 0.0, "judged_sq_sum": 0.0, "covered": 0, "numerics": 0, "partial": 0, "where": None,
           "ratio_sum": 0.0, "ratio_min": math.inf, "ratio_max": -math.inf, "seq_ratio_sum": 0.0,
           "seq_ratio_min": math.inf, "seq_ratio_max": -math.inf, "seqs": 0, "hist": [0.0] * HIST_BINS}
    native = _native_stats(learner_logps, sampler_logps, mask, numerics_logps, numerics_mask)
    if native is not None:
        numbers, hist = native
        if numbers["count"]:
            out.update({k: numbers[k] for k in ("sum", "sq_sum", "max", "ratio_sum", "ratio_min", "ratio_max",
                                                "seq_ratio_sum", "seq_ratio_min", "seq_ratio_max")},
                       count=int(numbers["count"]), where=int(numbers["where"]), seqs=int(numbers["seqs"]), hist=hist)
            if numerics_logps is not None:
                out.update({k: numbers[k] for k in ("explained_sum", "path_sum", "judged_sum", "judged_sq_sum")},
                           numerics=1, partial=int(numerics_mask is not None), covered=int(numbers["covered"]))
        return out
    learner = learner_logps.float()
    device = learner.device
    mask = mask.bool().to(device)
    sampler = sampler_logps.float().to(device)
    signed = learner - sampler
    wide = signed.double()
    masked = wide[mask]  # the masked tokens' signed gaps, row-major
    count = masked.numel()
    if count == 0:
        return out
    d = masked.abs()
    ratio = masked.exp()
    rows = torch.where(mask, wide, 0.0).sum(dim=1)[mask.any(dim=1)]
    seq = rows.exp()
    ratio_min, ratio_max = torch.aminmax(ratio)
    seq_min, seq_max = torch.aminmax(seq)
    # a float32 gap widened is exact, so the largest and where it is are the float32 gaps'
    largest, where = d.max(dim=0)  # the first largest
    scalars = [d.sum(), largest, where.double(), ratio.sum(), ratio_min, ratio_max, seq.sum(), seq_min, seq_max,
               d.dot(d)]
    if numerics_logps is not None:
        covered = mask if numerics_mask is None else numerics_mask.bool().to(device) & mask
        reference = numerics_logps.float().to(device)
        explained = (learner - reference)[covered].abs().double()
        path = (reference - sampler)[covered].abs().double()
        judged = wide[covered].abs()
        scalars += [explained.sum(), path.sum(), judged.sum(), covered.sum().double(), judged.dot(judged)]
    # every scalar and the histogram in float64 on one device: one concatenation, one host transfer
    values = torch.cat([torch.stack(scalars), _histogram_counts(d)]).tolist()
    out.update(sum=values[0], count=count, max=values[1], where=int(values[2]), ratio_sum=values[3],
               ratio_min=values[4], ratio_max=values[5], seq_ratio_sum=values[6], seq_ratio_min=values[7],
               seq_ratio_max=values[8], sq_sum=values[9], seqs=int(seq.numel()), hist=values[-HIST_BINS:])
    if numerics_logps is not None:
        out.update(numerics=1, partial=int(numerics_mask is not None), explained_sum=values[10], path_sum=values[11],
                   judged_sum=values[12], covered=int(values[13]), judged_sq_sum=values[14])
    return out




# The order of the compiled kernel's output (see trl_fp8_logprob_stats in trl_fp8/native_source.py),
# followed by the HIST_BINS histogram counts.
_NATIVE_FIELDS = ("sum", "sq_sum", "count", "max", "where", "ratio_sum", "ratio_min", "ratio_max", "seq_ratio_sum",
                  "seq_ratio_min", "seq_ratio_max", "seqs", "explained_sum", "path_sum", "judged_sum", "covered",
                  "judged_sq_sum")
_MASK_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)  # 0 / non-zero words


def _host_floats(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as a contiguous float32 CPU tensor whose memory the kernel may read, or None (not on the CPU)."""
    if not t.is_cpu or t.layout != torch.strided or t.is_complex():
        return None
    t = t.detach()
    if t.dtype != torch.float32:
        t = t.float()
    t = t.contiguous()
    return t if type(t) in (torch.Tensor, torch.nn.Parameter) else None


def _host_mask(t: torch.Tensor) -> torch.Tensor | None:
    if not t.is_cpu or t.layout != torch.strided:
        return None
    t = t.detach()
    if t.dtype not in _MASK_DTYPES:
        t = t.bool()
    t = t.contiguous()
    return t if type(t) in (torch.Tensor, torch.nn.Parameter) else None


def _native_stats(learner_logps, sampler_logps, mask, numerics_logps, numerics_mask) -> dict | None:
    """:func:`logprob_stats`'s numbers from one call into the compiled kernels, or None where that path does not
    apply (no library, a tensor off the CPU, shapes other than one ``[rows, steps]``, a non-finite gap)."""
    from .compare import _native_lib

    lib = _native_lib()
    if lib is None:
        return None
    shape = learner_logps.shape
    if len(shape) != 2 or any(t is not None and t.shape != shape
                              for t in (sampler_logps, mask, numerics_logps, numerics_mask)):
        return None
    learner, sampler, flags = _host_floats(learner_logps), _host_floats(sampler_logps), _host_mask(mask)
    reference = _host_floats(numerics_logps) if numerics_logps is not None else None
    covered = _host_mask(numerics_mask) if numerics_logps is not None and numerics_mask is not None else None
    if learner is None or sampler is None or flags is None or (numerics_logps is not None and reference is None) or \
            (numerics_logps is not None and numerics_mask is not None and covered is None):
        return None
    edges = _edges(torch.device("cpu"), torch.float64)
    out = torch.empty(len(_NATIVE_FIELDS) + HIST_BINS, dtype=torch.float64)
    if lib.trl_fp8_logprob_stats(shape[0], shape[1], learner.data_ptr(), sampler.data_ptr(), flags.data_ptr(),
                                 flags.element_size(), reference.data_ptr() if reference is not None else None,
                                 covered.data_ptr() if covered is not None else None,
                                 covered.element_size() if covered is not None else 0, edges.data_ptr(),
                                 edges.numel(), out.data_ptr()):
        return None  # a gap that is not finite: the tensor path says how the extremes treat it
    values = out.tolist()
    return dict(zip(_NATIVE_FIELDS, values)), values[len(_NATIVE_FIELDS):]

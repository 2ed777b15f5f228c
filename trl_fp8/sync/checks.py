"""The seven weight-sync checks as pure functions (PyTorch only, no TRL).

Each check compares what the learner meant the sampler to serve with what the sampler actually serves, and
returns a :class:`CheckResult`. A failed result names the check, the tensor or layer, and the numbers; the
:class:`~trl_fp8.sync.monitor.SyncMonitor` turns it into a :class:`WeightSyncError` (or a warning).

Terms: *sent* tensors are what the sync streamed (learner names); a *sampler* exposes ``read(name)`` (the
tensor it computes with, sliced out of fused layers), ``version()``, ``cached_blocks()``, ``recipe()`` and
``alias_columns()`` (see :mod:`trl_fp8.sync.samplers`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

CHECKS = (
    "recipe_parity", "coverage", "freshness", "quant_parity", "logprob_agreement", "differential_oracle",
    "cache_hygiene",
)
# Cheap enough to leave on every step in production (the differential oracle reloads the weights several times).
DEFAULT_CHECKS = tuple(c for c in CHECKS if c != "differential_oracle")
RECIPE_FIELDS = ("dtype", "format", "block_size", "scale_dtype", "scale_rounding", "excluded", "kernel", "cast")
LOGPROB_BAND_FACTOR = 3.0  # the mean gap may grow to this multiple of the calibrated mean gap ...
LOGPROB_BAND_FLOOR = 0.01  # ... or this absolute floor, whichever is larger (per-token noise is real) ...
LOGPROB_CALIBRATION = 3  # calibrated gap: the largest mean gap of the first evaluations (step 0 and the next ones)
LOGPROB_MAX_RATIO = 1.05  # and exp(mean gap) may never exceed this


class WeightSyncError(RuntimeError):
    """A weight-sync check failed: the sampler does not serve what the learner trains."""

    def __init__(self, check: str, message: str):
        super().__init__(f"[{check}] {message}")
        self.check = check


class WeightSyncWarning(UserWarning):
    """A weight-sync check failed with ``sync_check_action="warn"``."""


@dataclass
class CheckResult:
    check: str
    passed: bool
    message: str = ""
    metrics: dict[str, float] = field(default_factory=dict)


def resolve_checks(value) -> tuple[str, ...]:
    """``"default"`` / ``"all"`` / ``"off"`` or a list of check names -> the tuple of checks to run."""
    if isinstance(value, str):
        presets = {"default": DEFAULT_CHECKS, "all": CHECKS, "off": ()}
        if value in presets:
            return presets[value]
        value = [v.strip() for v in value.split(",") if v.strip()]
    names = list(value)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise ValueError(
            f"sync_checks: unknown check(s) {', '.join(map(repr, unknown))}; known checks: {', '.join(CHECKS)} "
            "(or one of 'default', 'all', 'off')."
        )
    return tuple(c for c in CHECKS if c in names)


def _describe_diff(expected: torch.Tensor, actual: torch.Tensor) -> str:
    e, a = expected.float(), actual.float()
    differ = ~((e == a) | (torch.isnan(e) & torch.isnan(a)))
    n = int(differ.sum())
    delta = (e - a).abs()[differ]
    worst = delta.max().item() if delta.numel() else float("nan")
    return f"{n} of {e.numel()} elements differ (max |Δ| {worst:.4g})"


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaNs with equal payloads count as equal)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point:
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.int8}[a.element_size()]
        return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))
    return torch.equal(a, b)


# -- 1. recipe parity ---------------------------------------------------------------------------------------------
def recipe_parity(learner: dict[str, dict], sampler: dict[str, dict]) -> CheckResult:
    """Per-tensor recipe (dtype, quantization format, block, scale dtype and rounding, exclusion, kernel, the
    cast the sampler applies on load) equal on both sides."""
    problems = []
    for name in sorted(set(learner) | set(sampler)):
        if name not in sampler:
            problems.append(f"'{name}': in the learner's recipe but not served")
            continue
        if name not in learner:
            problems.append(f"'{name}': served but not in the learner's recipe")
            continue
        for key in RECIPE_FIELDS:
            lv, sv = learner[name].get(key), sampler[name].get(key)
            if lv != sv:
                problems.append(f"'{name}': {key} learner={lv!r} sampler={sv!r}")
    if problems:
        return CheckResult("recipe_parity", False, f"{len(problems)} mismatch(es): " + "; ".join(problems[:5]))
    return CheckResult("recipe_parity", True)


# -- 2. coverage --------------------------------------------------------------------------------------------------
def coverage(sent: dict[str, int], expected: dict[str, tuple], sampler_targets: dict[str, list[str]],
             sent_shapes: dict[str, tuple], sampler_shapes: dict[str, tuple]) -> CheckResult:
    """Every served tensor written exactly once, with the right shape.

    ``sent``: learner name -> times streamed. ``expected``: learner name -> shape the learner serves.
    ``sampler_targets``: sampler target (a parameter, or a shard of a fused one) -> the learner names that map
    to it (an empty list: nothing maps there). ``*_shapes``: per learner name.
    """
    missing = sorted(n for n in expected if sent.get(n, 0) == 0)
    duplicate = sorted(n for n, c in sent.items() if c > 1)
    unknown = sorted(n for n in sent if n not in expected)
    unwritten = sorted(t for t, names in sampler_targets.items() if not any(sent.get(n, 0) for n in names))
    shape = sorted(
        f"'{n}' sent {tuple(sent_shapes[n])} served {tuple(sampler_shapes[n])}"
        for n in sent_shapes if n in sampler_shapes and tuple(sent_shapes[n]) != tuple(sampler_shapes[n])
    )
    unmapped = sorted(n for n in sent if n in expected and n not in sampler_shapes)
    metrics = {"missing": len(missing), "duplicate": len(duplicate)}
    problems = []
    for label, items in (("not sent", missing), ("sent more than once", duplicate), ("sent but not served", unknown),
                         ("served but never written", unwritten), ("shape mismatch", shape),
                         ("no served counterpart", unmapped)):
        if items:
            problems.append(f"{label}: {', '.join(map(str, items[:5]))}" + (" …" if len(items) > 5 else ""))
    if problems:
        return CheckResult("coverage", False, "; ".join(problems), metrics)
    return CheckResult("coverage", True, metrics=metrics)


# -- 3. freshness -------------------------------------------------------------------------------------------------
def freshness(step: int, version, sent: dict[str, torch.Tensor], read, alias_reads: dict[str, tuple]) -> CheckResult:
    """The sampler's weight version is the learner step, and what it serves is bitwise what was sent.

    ``read(name)`` returns the sampler's tensor for a learner name; ``sent`` tensors are cast to its dtype the
    way the sampler's load casts them (``copy_``: round-to-nearest). ``alias_reads``: alias -> (what the alias
    effectively computes with, the tensor it must equal), e.g. a tied ``lm_head`` probed through its forward.
    """
    if version is not None and str(version) != str(step):
        return CheckResult("freshness", False, f"the sampler serves weight version {version!r}, the learner is at "
                                               f"step {step}")
    for name, tensor in sent.items():
        served = read(name)
        expected = tensor.detach().to(device=served.device, dtype=served.dtype)
        if not bitwise_equal(expected, served):
            return CheckResult("freshness", False, f"'{name}' is not what the sync sent at step {step}: "
                                                   f"{_describe_diff(expected, served)}")
    for alias, (effective, target) in alias_reads.items():
        if not bitwise_equal(target.to(effective.dtype), effective):
            return CheckResult("freshness", False, f"'{alias}' (tied) computes with a stale copy at step {step}: "
                                                   f"{_describe_diff(target, effective)}")
    return CheckResult("freshness", True)


# -- 4. quantized-weight parity ---------------------------------------------------------------------------------
def quant_parity(names, reference, read, sent: dict[str, torch.Tensor] | None = None) -> CheckResult:
    """What the sampler computes with equals the learner's reference quantizer applied to the learner's weights.

    ``reference(name)`` is the learner side (the Fair Cast export, the MXFP8 quantize-dequantize, or a plain
    round-to-nearest cast); ``read(name)`` the sampler side (dequantized where the sampler stores FP8 data and
    scales). Bitwise. ``sent``: pass the tensors a freshness check just verified, to skip names whose reference
    *is* the sent tensor (Fair Cast's export): comparing them again would prove nothing new.
    """
    for name in names:
        ref = reference(name)
        if sent is not None and sent.get(name) is ref:
            continue  # the learner's reference is the very tensor sent, and freshness compared it bitwise
        served = read(name)
        ref = ref.to(served.device)
        if ref.shape != served.shape or ref.dtype != served.dtype:
            return CheckResult("quant_parity", False, f"'{name}': learner reference {ref.dtype} {tuple(ref.shape)}, "
                                                      f"sampler {served.dtype} {tuple(served.shape)}")
        if not bitwise_equal(ref, served):
            return CheckResult("quant_parity", False, f"'{name}' differs from the learner's quantizer output: "
                                                      f"{_describe_diff(ref, served)}")
    return CheckResult("quant_parity", True)


# -- 5. logprob agreement ---------------------------------------------------------------------------------------
class LogprobBand:
    """Calibrates the sampler/learner logprob gap on the first evaluations, then enforces the band.

    Every evaluation must keep exp(mean gap) ≤ ``max_ratio``; after calibration the mean gap must also stay
    within ``max(factor × calibrated, floor)``.
    """

    def __init__(self, factor: float = LOGPROB_BAND_FACTOR, floor: float = LOGPROB_BAND_FLOOR,
                 max_ratio: float = LOGPROB_MAX_RATIO, calibration: int = LOGPROB_CALIBRATION):
        self.factor, self.floor, self.max_ratio = factor, floor, max_ratio
        self.calibration = max(1, int(calibration))
        self.seen: list[float] = []
        self.calibrated: float | None = None

    @property
    def limit(self) -> float:
        assert self.calibrated is not None
        return min(max(self.factor * self.calibrated, self.floor), math.log(self.max_ratio))

    def check(self, learner_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor,
              step: int) -> CheckResult:
        mask = mask.bool()
        gap = (learner_logps.float() - sampler_logps.float()).abs()[mask]
        if gap.numel() == 0:
            return CheckResult("logprob_agreement", True)
        mean, worst = gap.mean().item(), gap.max().item()
        metrics = {"logp_gap_mean": mean, "logp_gap_max": worst}
        if not math.isfinite(mean):
            return CheckResult("logprob_agreement", False, f"non-finite logprob gap at step {step}", metrics)
        if mean > math.log(self.max_ratio):
            return CheckResult(
                "logprob_agreement", False,
                f"mean |logπ_learner − logμ_sampler| is {mean:.4g} at step {step} (max {worst:.4g}): exp(mean gap) "
                f"= {math.exp(mean):.4f} > {self.max_ratio}", metrics)
        if self.calibrated is None:
            self.seen.append(mean)
            if len(self.seen) >= self.calibration:
                self.calibrated = max(self.seen)
            return CheckResult("logprob_agreement", True, metrics=metrics)
        if mean > self.limit:
            where = int(torch.argmax(gap))
            return CheckResult(
                "logprob_agreement", False,
                f"mean |logπ_learner − logμ_sampler| {mean:.4g} at step {step} exceeds the band {self.limit:.4g} "
                f"(calibrated {self.calibrated:.4g} × {self.factor:g}, floor {self.floor:g}, exp(mean) ≤ "
                f"{self.max_ratio}); max gap {worst:.4g} at masked token {where}", metrics)
        return CheckResult("logprob_agreement", True, metrics=metrics)


# -- 6. differential oracle -------------------------------------------------------------------------------------
def compare_states(label: str, expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> str | None:
    for name, tensor in expected.items():
        if name not in actual:
            return f"{label}: '{name}' missing"
        if not bitwise_equal(tensor, actual[name]):
            return f"{label}: '{name}' {_describe_diff(tensor, actual[name])}"
    return None


# -- 7. cache hygiene -------------------------------------------------------------------------------------------
def cache_hygiene(step: int, reset_ok: bool | None, cached_blocks: int | None) -> CheckResult:
    """After a sync the prefix/KV cache holds nothing computed with the old weights."""
    if reset_ok is False:
        return CheckResult("cache_hygiene", False, f"the sampler refused to reset its prefix cache at step {step}")
    if cached_blocks:
        return CheckResult("cache_hygiene", False, f"{cached_blocks} prefix-cache block(s) computed with the old "
                                                   f"weights survived the sync to step {step}")
    return CheckResult("cache_hygiene", True)

"""The seven weight-sync checks as pure functions (PyTorch only, no TRL).

Each check compares what the learner meant the sampler to serve with what the sampler actually serves, and
returns a :class:`CheckResult`. A failed result names the check, the tensor or layer, and the numbers; the
:class:`~trl_fp8.sync_checks.monitor.SyncMonitor` turns it into a :class:`WeightSyncError` (or a warning).

Terms: *sent* tensors are what the sync streamed (learner names); a *sampler* exposes ``read(name)`` (the
tensor it computes with, sliced out of fused layers), ``version()``, ``cached_blocks()``, ``recipe()`` and
``alias_reads()`` (see :mod:`trl_fp8.samplers`). A check with nothing to compare returns a result that is
*not applicable* (``applicable=False``): neither a pass nor a failure.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from .compare import PairComparer, StorageReleased, bitwise_equal, describe_diff, meta_name, same_device
from .tokenstats import (  # noqa: F401 (re-exported: the checks' token statistics)
    HIST_BINS, HIST_DECADES, HIST_LOW, HIST_PER_DECADE, LOGPROB_STAT_OPS, delta_histogram, logprob_stats, over_fraction)

from .names import CHECKS, DEFAULT_CHECKS, resolve_checks  # noqa: F401 (re-exported)
RECIPE_FIELDS = ("dtype", "format", "block_size", "scale_dtype", "scale_rounding", "excluded", "kernel", "cast")
# logprob agreement (see LogprobBand): the gap the sampler's precision explains is measured on every evaluated batch
LOGPROB_BAND_FACTOR = 3.0  # the mean gap may be this multiple of the gap the sampler's precision explains (≥ 1 + √2) ...
LOGPROB_BAND_FLOOR = 0.01  # ... or this absolute floor, whichever is larger (per-token noise is real)
LOGPROB_PERSISTENCE = 3  # an over-band gap fails on this many consecutive evaluations (one spike does not)
LOGPROB_GROSS_FACTOR = 10.0  # a mean gap over max(log(LOGPROB_MAX_RATIO), this × band) fails at once ...
LOGPROB_MAX_RATIO = 1.05  # ... (the gross ceiling never drops below exp(mean gap) = this) ...
LOGPROB_GROSS_Z = 3.0  # ... when even the mean minus this many standard errors of it is over the ceiling
LOGPROB_CALIBRATION = 3  # fallback without numerics: the reference is enforced after this many evaluations ...
LOGPROB_FALLBACK_FACTOR = 3.0  # ... and the band is this multiple of the largest gap that passed so far
LOGPROB_PATH_FACTOR = 3.0  # with an approximate ρ (ZeRO-3): the sampler's path may reach this multiple of its calibration
LOGPROB_REFERENCE_EVERY = 32  # after calibration, ρ is measured on every 32nd evaluation; between, its terms are held


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
    applicable: bool = True  # False: the check had nothing to compare (``message`` says why)


@functools.lru_cache(maxsize=None)
def _widens(narrow: torch.dtype, wide: torch.dtype) -> bool:
    """Whether every value of float dtype ``narrow`` is exactly a value of ``wide`` (bf16, fp16, fp8 into fp32)."""
    return narrow.is_floating_point and wide in (torch.float32, torch.float64) and \
        torch.finfo(narrow).bits < torch.finfo(wide).bits


def _meta_text(name: str, side: str, step: int | None = None) -> str:
    at = "" if step is None else f" at step {step}"
    return (f"'{name}' is a meta tensor on the {side}'s side{at}: it holds no values (never materialised, or offloaded "
            "without being gathered back), so what is served cannot be compared")


# -- 1. recipe parity ---------------------------------------------------------------------------------------------
def recipe_parity(learner: dict, sampler: dict) -> CheckResult:
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
            lv, sv = getattr(learner[name], key), getattr(sampler[name], key)
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
    comparer = PairComparer()
    for name, tensor in sent.items():
        served = read(name)
        side = meta_name((tensor, served))
        if side is not None:
            return CheckResult("freshness", False, _meta_text(name, side, step))
        expected = tensor if tensor.dtype == served.dtype and same_device(tensor, served) else \
            tensor.detach().to(device=served.device, dtype=served.dtype)
        if not comparer.add(name, expected, served):
            break
    try:
        comparer.finish()
    except StorageReleased as err:
        return CheckResult("freshness", False, f"{err} (step {step})")
    if comparer.mismatch is not None:
        name, expected, served = comparer.mismatch
        return CheckResult("freshness", False, f"'{name}' is not what the sync sent at step {step}: "
                                               f"{describe_diff(expected, served)}")
    for alias, (effective, target) in alias_reads.items():
        if not bitwise_equal(target.to(effective.dtype), effective):
            return CheckResult("freshness", False, f"'{alias}' (tied) computes with a stale copy at step {step}: "
                                                   f"{describe_diff(target, effective)}")
    return CheckResult("freshness", True)


def served_after_rollouts(step: int, synced_step: int, sent: dict[str, str], served: dict[str, str]) -> CheckResult:
    """After a generation, what the sampler computes with (``served``: digests it computed where it lives, by learner
    name) is still what the sync at ``synced_step`` sent and freshness verified (``sent``): nothing cached per version
    name, so a reload in place under the same name, an ignored upsert or an overwritten slot is caught at the step
    whose rollouts it touched, naming the tensor."""
    for name, digest in sent.items():
        if name not in served:
            return CheckResult("freshness", False, f"after the rollouts of step {step}, the sampler serves nothing for "
                                                   f"'{name}' (the sync at step {synced_step} sent it)")
        if served[name] != digest:
            return CheckResult("freshness", False, f"after the rollouts of step {step}, '{name}' is not what the sync at "
                                                   f"step {synced_step} sent (digest {served[name]} served, {digest} "
                                                   "sent): the served copy changed after the sync (a reload in place, "
                                                   "an overwritten slot)")
    return CheckResult("freshness", True)


def rollout_routing(step: int, routes: dict | None, label=None) -> CheckResult:
    """Part of freshness, per token: every token the engine computed since the last call read the LoRA slot that holds
    the adapter its request named (``routes``: :meth:`trl_fp8._trl.vllm_routing.RouteGuard.take`, None: the sampler
    does not observe it). ``label(lora_id)``: the version an engine LoRA id serves (None if unknown; 0 is no
    adapter). A stale slot mapping decodes a request with another adapter or none while the request names the right
    one — every per-request and per-tensor comparison passes."""
    if routes is None:
        return CheckResult("freshness", True, "the sampler does not report its tokens' LoRA slots", applicable=False)
    if routes.get("unreadable"):
        return CheckResult("freshness", True, routes["unreadable"], applicable=False)
    tokens, wrong = int(routes.get("tokens") or 0), int(routes.get("misrouted") or 0)
    if not tokens:
        return CheckResult("freshness", True, "no forward with a LoRA mapping since the last check", applicable=False)
    if wrong:
        def named(lora_id):
            if not lora_id:
                return "no adapter (the bare base)"
            version = label(lora_id) if label is not None else None
            return f"LoRA id {lora_id}" + (f" (adapter version {version!r})" if version is not None else
                                            " (no version the learner pushed)")

        example = routes.get("example") or [None, None]
        detail = (f"; e.g. a token whose request named {named(example[0])} read the slot of {named(example[1])}"
                  if example[0] is not None else "")
        return CheckResult("freshness", False, f"at step {step}, {wrong} of {tokens} tokens the engine computed read "
                                               f"a LoRA slot other than the one holding their request's adapter (a "
                                               f"misrouted slot: its per-token slot indices disagree with its slot "
                                               f"layout){detail}", {"tokens_misrouted": float(wrong)})
    return CheckResult("freshness", True, metrics={"tokens_routed": float(tokens)})


def rollout_versions(step: int, synced, generated: dict) -> CheckResult:
    """Part of freshness, per rollout: every request that finished since the last call was generated with the
    adapter version the learner synced (``synced``, e.g. its step). ``generated``: version -> finished requests, as
    the engine reports them (None: a request without a LoRA request, served by the bare base; ``"unknown"``: a LoRA
    id never pushed). Nothing reported: not applicable."""
    total = sum(generated.values())
    if not total:
        return CheckResult("freshness", True, "no finished request reported the adapter it used", applicable=False)
    wrong = {v: n for v, n in generated.items() if v is None or str(v) != str(synced)}
    if wrong:
        def label(v):
            return "no adapter (the bare base)" if v is None else f"adapter version {v!r}"

        kinds = sorted(wrong.items(), key=lambda kv: str(kv[0]))
        named = label(kinds[0][0]) if len(kinds) == 1 else \
            "another adapter (" + ", ".join(f"{n} with {label(v)}" for v, n in kinds) + ")"
        return CheckResult("freshness", False, f"at step {step}, {sum(wrong.values())} of {total} rollouts were "
                                               f"generated with {named}; the learner synced adapter version "
                                               f"{synced!r}", {"rollouts_wrong_version": float(sum(wrong.values()))})
    return CheckResult("freshness", True, metrics={"rollouts_checked": float(total)})


# -- 4. quantized-weight parity ---------------------------------------------------------------------------------
def quant_parity(names, reference, read, sent: dict[str, torch.Tensor] | None = None) -> CheckResult:
    """What the sampler computes with equals the learner's reference quantizer applied to the learner's weights.

    ``reference(name)`` is the learner side (the Fair Cast export, the MXFP8 quantize-dequantize, or a plain
    round-to-nearest cast); ``read(name)`` the sampler side (dequantized where the sampler stores FP8 data and
    scales). Bitwise; a reference in a wider float dtype than the served tensor (e.g. the fp32 value the learner's
    loss computes with, against a bf16 copy) is compared with the served tensor widened (exact): equal bit for bit
    only where the served dtype holds the reference exactly. ``sent``: pass the tensors a freshness check just
    verified, to skip names whose reference *is* the sent tensor (Fair Cast's export): comparing them again would
    prove nothing new.
    """
    compared, comparer = 0, PairComparer()
    for name in names:
        ref = reference(name)
        if sent is not None and sent.get(name) is ref:
            continue  # the learner's reference is the very tensor sent, and freshness compared it bitwise
        served = read(name)
        side = meta_name((ref, served))
        if side is not None:
            return CheckResult("quant_parity", False, _meta_text(name, side))
        if not same_device(ref, served):
            ref = ref.to(served.device)
        # a narrower served tensor is widened (exact: one cast of the served side instead of rounding the reference)
        if ref.dtype is not served.dtype and not _widens(served.dtype, ref.dtype) or ref.shape != served.shape:
            if comparer.finish() is not None:  # a tensor compared before it differs: that one is reported first
                break
            return CheckResult("quant_parity", False, f"'{name}': learner reference {ref.dtype} {tuple(ref.shape)}, "
                                                      f"sampler {served.dtype} {tuple(served.shape)}")
        compared += 1
        if not comparer.add(name, ref, served):
            break
    try:
        comparer.finish()
    except StorageReleased as err:
        return CheckResult("quant_parity", False, str(err))
    if comparer.mismatch is not None:
        name, ref, served = comparer.mismatch
        return CheckResult("quant_parity", False, f"'{name}' differs from the learner's quantizer output: "
                                                  f"{describe_diff(ref, served.to(ref.dtype))}")
    if not compared:
        return CheckResult("quant_parity", True, "every served tensor is the very tensor freshness compared; no "
                                                 "quantizer between them", applicable=False)
    return CheckResult("quant_parity", True, metrics={"compared": compared})


# -- 5. logprob agreement ---------------------------------------------------------------------------------------
class LogprobBand:
    """Sampler/learner logprob agreement, judged against what numerics alone explain, measured on the same tokens.

    ``gap`` is the mean |logπ_learner − logμ_sampler| over the masked tokens. A healthy gap is not zero and not
    constant: the learner and the sampler compute in different precisions (fp32 or autocast against a sampler in
    bf16 end to end) and along different paths (one teacher-forced forward against incremental decoding with a KV
    cache, or another engine's kernels), and both effects grow as the policy sharpens. So every evaluation is judged
    against a reference ``ρ`` (``numerics_logps``): the logprobs of the same tokens computed *from the learner's own
    weights, the way the sampler computes* (the learner's tensors as the sampler is meant to hold them, every op in
    the served dtype, autocast off). Since |π − μ| ≤ |π − ρ| + |ρ − μ| token by token, the gap splits into

    - ``explained`` = mean |π − ρ|: what the sampler's precision alone produces on this very batch, and
    - ``path`` = mean |ρ − μ|: the same weights and dtype, computed by the sampler itself: its decoding path and
      kernels — and any fault (stale or corrupted weights, a wrong cache), since ρ never reads the sampler's state.

    The band is an absolute bound from the two sides' precisions (:meth:`bound`), in force from the first evaluation:

        band = max(floor, factor × explained)

    A band learned from a run's first evaluations would absorb whatever gap exists then — another base on the
    server, a missing adapter, a wrong dtype from step 0 would become "normal" — so nothing the run shows widens it.
    The path term has no independent measure; it is calibrated only for its own gross ceiling:
    ``path_reference`` is the largest path term that passed on an evaluation whose sync was verified (bitwise
    freshness passed, or could not run), enforced once ``calibration`` evaluations have fed it.

    ρ costs a forward, so once calibrated it is measured on every ``reference_every``-th evaluation
    (:meth:`reference_due`); an evaluation without it is judged on all its tokens against the band of the last
    measured precision term (*held*). Over that band nothing fails yet: ρ is measured on the next evaluation, and
    only measured evaluations count towards ``persistence``. Where ρ is not exact (``exact=False``: ZeRO-3's
    autocast approximation) or never given, the band calibrates — ``max(factor × explained, path_factor ×
    path_reference)``, or ``fallback_factor × reference`` with ``reference`` the largest gap that has passed — and
    never exceeds the absolute bound ``max(floor, log max_ratio)``, which also holds while it calibrates.

    An evaluation is *over* when gap > band. The check fails after ``persistence`` consecutive over-evaluations
    (a one-batch spike passes), and at once on a non-finite gap, a gross excess
    ``gap − gross_z × se > max(log(max_ratio), gross_factor × band)``, or a gross path term ``path > max(log(max_ratio), gross_factor × path_reference)``.

    ``se`` is the standard error of the mean gap, ``sqrt(s² / n)`` with ``s²`` the sample variance of the ``n``
    judged tokens' gaps (infinite for one token): the gross rule stops a run at once only when the mean is over the
    ceiling by more than sampling noise of a mean over ``n`` tokens can explain. A mean over a handful of tokens that
    one token's gap drives over the ceiling is not that (one token of gap x among n of gap 0 has mean x/n and standard
    error x/n, so mean − se = 0 whatever x): such an evaluation, over the ceiling but within ``gross_z`` standard
    errors of it, is *over* (it fails after ``persistence`` consecutive over-evaluations, and calibrates nothing),
    while a desync that moves most tokens has a small spread and fails at once as before. Over many tokens ``se``
    vanishes and the rule is the plain ceiling. The path term's ceiling has no such margin: it is relative to this
    run's own verified calibration, and a small drift of the served weights shows there first, barely over it
    (``tests/sync_checks/test_trainer_sync.py``: a 3 % embedding error, path 0.053 against 0.049 over 24 tokens,
    standard error 0.015).
    """

    def __init__(self, factor: float = LOGPROB_BAND_FACTOR, floor: float = LOGPROB_BAND_FLOOR,
                 persistence: int = LOGPROB_PERSISTENCE, gross_factor: float = LOGPROB_GROSS_FACTOR,
                 max_ratio: float = LOGPROB_MAX_RATIO, calibration: int = LOGPROB_CALIBRATION,
                 fallback_factor: float = LOGPROB_FALLBACK_FACTOR, path_factor: float = LOGPROB_PATH_FACTOR,
                 reference_every: int = LOGPROB_REFERENCE_EVERY, gross_z: float = LOGPROB_GROSS_Z):
        self.factor, self.floor, self.max_ratio = factor, floor, max_ratio
        self.gross_z = float(gross_z)
        self.persistence = max(1, int(persistence))
        self.gross_factor, self.fallback_factor, self.path_factor = gross_factor, fallback_factor, path_factor
        self.calibration = max(1, int(calibration))
        self.reference: float | None = None  # the largest gap that passed (the fallback's reference)
        self.evaluations = 0  # evaluations that fed the reference
        self.path_reference: float | None = None  # the largest path term that passed after a verified sync
        self.path_evaluations = 0  # evaluations that fed it
        self.over = 0  # consecutive over-band evaluations
        self.reference_every = max(1, int(reference_every))
        self.held: tuple[float, int] | None = None  # (explained, step) of the last evaluation that measured ρ
        self.since_reference = 0  # evaluations judged since ρ was last measured
        self.remeasure = False  # a held evaluation was over its band: measure ρ on the next one
        self.exact = True  # ρ is computed the way the sampler computes (False: ZeRO-3's autocast approximation)

    def reference_due(self) -> bool:
        """Whether the next evaluation should measure ρ: every evaluation while the path term calibrates, then
        every ``reference_every``-th (between them the last measured precision term is held)."""
        if self.path_reference is None or self.path_evaluations < self.calibration or self.held is None:
            return True
        if self.remeasure or self.over:  # the last evaluation was over its band: this one is judged on a measured ρ
            return True
        return self.since_reference + 1 >= self.reference_every

    def bound(self, explained: float | None) -> tuple[float, str]:
        """The absolute bound on the mean gap, from the two sides' precisions alone — what no calibration may widen.
        With an exact precision term (ρ computed the way the sampler computes): ``max(floor, factor × explained)``. The
        learner's π differs from ρ by one rounding process at the sampler's precision (``explained``); the sampler's μ
        by ρ's and its own path's, two of the same size, so ``E|π − μ| ≤ E|π − ρ| + E|ρ − μ| ≈ (1 + √2) × explained``
        (two independent roundings differ by √2 of one) — the factor 3 covers that with margin for a batch's spread
        (clean runs on record: at most 2.8 × explained above the floor). Without one (no numerics logprobs, or ZeRO-3's
        approximate ρ): ``max(floor, log max_ratio)``, a mean probability ratio of ``max_ratio``."""
        if explained is not None and self.exact:
            scaled = self.factor * explained
            if scaled >= self.floor:
                return scaled, f"numerics explain {explained:.4g} × {self.factor:g}"
            return self.floor, f"floor {self.floor:g} (numerics explain {explained:.4g} × {self.factor:g} = {scaled:.4g})"
        return max(self.floor, math.log(self.max_ratio)), f"the absolute bound log {self.max_ratio:g}"

    def calibrating(self, explained: float | None) -> bool:
        """Whether a band without an exact ρ is still calibrating (an exact ρ's band never calibrates)."""
        if explained is not None and self.exact:
            return False
        if explained is not None:
            return self.path_reference is None or self.path_evaluations < self.calibration
        return self.reference is None or self.evaluations < self.calibration

    def band(self, explained: float | None, path: float | None = None) -> tuple[float, str]:
        """(the band, how it was derived) for this evaluation. With an exact precision term the band *is* the bound
        (:meth:`bound`), from the first evaluation on: a gap present from step 0 (another base, a missing adapter, a
        wrong dtype) is judged against what precision explains, never learned. Without one, the band calibrates on
        the first evaluations (the largest passing path term, or gap) and never admits more than the bound."""
        bound, said = self.bound(explained)
        if explained is not None and self.exact:
            if self.path_reference is None or self.path_evaluations < self.calibration:
                said += f" (path calibrating {self.path_evaluations}/{self.calibration})"
            return bound, said
        if explained is not None:  # an approximate ρ: its path term calibrates, under the bound
            if self.path_reference is None or self.path_evaluations < self.calibration:
                return bound, f"{said} (approximate numerics; path calibrating {self.path_evaluations}/" \
                              f"{self.calibration})"
            scaled = max(self.factor * explained, self.path_factor * self.path_reference)
            what = (f"the larger of numerics explain {explained:.4g} × {self.factor:g} and sampler path "
                    f"{self.path_reference:.4g} × {self.path_factor:g}")
        else:
            if self.reference is None or self.evaluations < self.calibration:
                return bound, f"{said} (no numerics logprobs; fallback calibrating {self.evaluations}/" \
                              f"{self.calibration})"
            scaled = self.fallback_factor * self.reference
            what = f"no numerics logprobs: largest passing gap {self.reference:.4g} × {self.fallback_factor:g}"
        if scaled > bound:
            return bound, f"{said} ({what} = {scaled:.4g}, capped)"
        if scaled >= self.floor:
            return scaled, what
        return self.floor, f"floor {self.floor:g} ({what} = {scaled:.4g})"

    def _uncertain_gross(self, what: str, held: bool, metrics: dict) -> CheckResult:
        """An evaluation over a gross ceiling within ``gross_z`` standard errors of it (``self.over`` already
        counted): over, not failed at once; fails after ``persistence`` such or over-band evaluations in a row, and
        calibrates nothing."""
        if held:
            self.remeasure = True
        if self.over >= self.persistence:
            return CheckResult("logprob_agreement", False, f"{what}; over for {self.over} consecutive evaluations "
                                                           f"(fails after {self.persistence})", metrics)
        return CheckResult("logprob_agreement", True, metrics=metrics)

    def path_ceiling(self) -> float | None:
        """The path term's own gross ceiling once calibrated: a sampler that suddenly computes far from the
        learner's weights (a stale or corrupted copy) fails at once even where precision explains a wide band."""
        if self.path_reference is None or self.path_evaluations < self.calibration:
            return None
        return max(math.log(self.max_ratio), self.gross_factor * self.path_reference)

    def check(self, learner_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor, step: int,
              numerics_logps: torch.Tensor | None = None, numerics_mask: torch.Tensor | None = None,
              verified: bool | None = None) -> CheckResult:
        """``numerics_mask``: the tokens ``numerics_logps`` cover (default ``mask``): the reference may be measured on
        a few rollouts of the batch. The gap is *reported* over ``mask`` (``logp_gap_mean``) and *judged* on the
        tokens the reference covers (the same tokens on both sides of the comparison)."""
        stats = logprob_stats(learner_logps, sampler_logps, mask, numerics_logps, numerics_mask)
        return self.judge(stats, step, verified)

    def judge(self, stats: dict, step: int, verified: bool | None = None) -> CheckResult:
        """Judge the token statistics of :func:`logprob_stats` — one rank's, or every rank's reduced with
        :data:`LOGPROB_STAT_OPS` (the band then judges the global batch, identically on every rank). ``verified``:
        False when the sync before these rollouts was not verified bitwise (its path term calibrates nothing)."""
        name = "logprob_agreement"
        if stats["count"] == 0:
            return CheckResult(name, True)
        gap, worst = stats["sum"] / stats["count"], stats["max"]
        metrics = {"logp_gap_mean": gap, "logp_gap_max": worst}
        metrics.update(ratio_metrics(stats))
        if not math.isfinite(gap):
            self.over += 1
            return CheckResult(name, False, f"non-finite mean |logπ_learner − logμ_sampler| ({gap}) at step {step}",
                               metrics)
        explained = path = None
        tokens, se = stats["count"], standard_error(gap, stats["sq_sum"], stats["count"])
        if stats["numerics"]:
            covered = stats["covered"]
            explained = stats["explained_sum"] / covered if covered else float("nan")
            path = stats["path_sum"] / covered if covered else float("nan")
            if math.isfinite(explained) and math.isfinite(path):
                metrics["logp_gap_numerics"] = explained
                metrics["logp_gap_path"] = path
                if stats["partial"]:  # judge the gap on the tokens the reference covers
                    gap = stats["judged_sum"] / covered
                    metrics["logp_gap_judged"] = gap
                    tokens, se = covered, standard_error(gap, stats["judged_sq_sum"], covered)
            else:  # the reference's low-precision forward overflowed: no explanation on this batch
                explained = path = None
        held = False
        if explained is not None:
            self.held, self.since_reference, self.remeasure = (explained, step), 0, False
        else:
            self.since_reference += 1
            if self.held is not None and not stats["numerics"] and self.path_evaluations >= self.calibration:
                explained, held = self.held[0], True  # ρ not measured on this evaluation: its last terms hold
        limit, derivation = self.band(explained, path)
        if held:
            derivation += f", held from step {self.held[1]}"
        # the gross ceiling's base: the band; while a band without an exact ρ calibrates, the floor (its bound is a
        # policy's 5 %, not a measured precision: ten times it would let a gross desync run for three evaluations)
        used = self.floor if self.calibrating(explained) else limit
        if held:
            metrics["logp_gap_numerics_held"] = explained
        ceiling = max(math.log(self.max_ratio), self.gross_factor * used)
        metrics["logp_gap_limit"] = limit
        metrics["logp_over_band_frac"] = over_fraction(stats, limit)
        where = f" at masked token {stats['where']}" if stats.get("where") is not None else ""
        said = f"mean |logπ_learner − logμ_sampler| {gap:.4g} at step {step} (max gap {worst:.4g}{where})"
        if explained is not None and not held:
            said += f"; numerics explain {explained:.4g}, the sampler's path adds {path:.4g}"
        z = self.gross_z
        if gap > ceiling:
            self.over += 1
            if gap - z * se > ceiling:
                return CheckResult(
                    name, False,
                    f"{said}: exceeds the gross ceiling {ceiling:.4g} = max(log {self.max_ratio:g}, "
                    f"{self.gross_factor:g} × band {used:.4g}); band from {derivation}: fails at once (by more than "
                    f"{z:g} standard errors over {tokens} tokens: {_se_text(gap, se, z)}; consecutive over-band "
                    f"evaluations: {self.over})", metrics)
            return self._uncertain_gross(
                f"{said}: over the gross ceiling {ceiling:.4g} = max(log {self.max_ratio:g}, {self.gross_factor:g} × "
                f"band {used:.4g}) by less than {z:g} standard errors over {tokens} tokens ({_se_text(gap, se, z)})",
                held, metrics)
        path_ceiling = self.path_ceiling()
        if path is not None and path_ceiling is not None and path > path_ceiling:
            self.over += 1
            return CheckResult(
                name, False,
                f"{said}: the sampler's path term {path:.4g} exceeds its gross ceiling {path_ceiling:.4g} = "
                f"max(log {self.max_ratio:g}, {self.gross_factor:g} × calibrated path {self.path_reference:.4g}): "
                "fails at once", metrics)
        if gap > limit and held:
            # over a band whose precision term was measured on other rollouts, earlier: measure ρ on the next
            # evaluation and judge there (a healthy batch can hold lower-probability tokens than the measured one)
            self.remeasure = True
            return CheckResult(name, True, metrics=metrics)
        if gap > limit:
            self.over += 1
            if self.over >= self.persistence:
                return CheckResult(
                    name, False,
                    f"{said}: exceeds the band {limit:.4g} ({derivation}) for {self.over} consecutive evaluations "
                    f"(fails after {self.persistence})", metrics)
            return CheckResult(name, True, metrics=metrics)
        self.over = 0
        self.reference = gap if self.reference is None else max(self.reference, gap)
        self.evaluations += 1
        if path is not None and verified is not False:
            self.path_reference = path if self.path_reference is None else max(self.path_reference, path)
            self.path_evaluations += 1
        return CheckResult(name, True, metrics=metrics)


def standard_error(mean: float, sq_sum: float, n: int) -> float:
    """Standard error of a mean over ``n`` values from their mean and sum of squares: ``sqrt(s² / n)`` with the
    sample variance ``s² = (Σx² − n·mean²) / (n − 1)`` (clamped at 0 against rounding); infinite for ``n < 2``."""
    if n < 2:
        return math.inf
    variance = max(0.0, (sq_sum - n * mean * mean) / (n - 1))
    return math.sqrt(variance / n)


def _se_text(mean: float, se: float, z: float) -> str:
    if not math.isfinite(se):
        return "one token: no spread to judge"
    return f"standard error {se:.4g}, mean − {z:g} × se = {mean - z * se:.4g}"


def ratio_metrics(stats: dict) -> dict:
    """Importance-ratio statistics as TRL's ``vllm_importance_sampling_*`` options use them: per token
    ``exp(logπ − logμ)`` and per sequence ``exp(Σ_t (logπ − logμ))``, min / mean / max."""
    out = {}
    if stats.get("count"):
        out.update(is_ratio_token_min=stats["ratio_min"], is_ratio_token_mean=stats["ratio_sum"] / stats["count"],
                   is_ratio_token_max=stats["ratio_max"])
    if stats.get("seqs"):
        out.update(is_ratio_seq_min=stats["seq_ratio_min"], is_ratio_seq_mean=stats["seq_ratio_sum"] / stats["seqs"],
                   is_ratio_seq_max=stats["seq_ratio_max"])
    return out


# -- 6. differential oracle -------------------------------------------------------------------------------------
def compare_states(label: str, expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> str | None:
    for name, tensor in expected.items():
        if name not in actual:
            return f"{label}: '{name}' missing"
        if tensor.is_meta or actual[name].is_meta:
            return f"{label}: '{name}' is a meta tensor (no values to compare)"
        if not bitwise_equal(tensor, actual[name]):
            return f"{label}: '{name}' {describe_diff(tensor, actual[name])}"
    return None


# -- 7. cache hygiene -------------------------------------------------------------------------------------------
def cache_hygiene(step: int, cached_blocks: int | None, observable: bool = True) -> CheckResult:
    """After a sync the prefix/KV cache holds nothing computed with the old weights (``cached_blocks``: the blocks
    it holds, None where it cannot say). A sampler whose cache cannot be observed (``observable=False``, and no
    count) makes the check not applicable."""
    if not observable and cached_blocks is None:
        return CheckResult("cache_hygiene", True, "the sampler's prefix cache cannot be observed (a vLLM server's "
                                                  "reset endpoint reports nothing)", applicable=False)
    if cached_blocks:
        return CheckResult("cache_hygiene", False, f"{cached_blocks} prefix-cache block(s) computed with the old "
                                                   f"weights survived the sync to step {step}")
    return CheckResult("cache_hygiene", True)

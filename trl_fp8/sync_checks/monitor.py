"""Runs the weight-sync checks around each sync and each step, and turns failures into errors or warnings.

Cadence (``interval`` = ``sync_check_interval``):

- first sync: ``recipe_parity``; ``differential_oracle`` (cold state A, perturbed B: warm A→B == cold B where the
  sampler can be built cold, B twice == B, A→B→A == A) runs *before* it;
- every ``interval``-th sync: ``coverage``, ``freshness``, ``quant_parity``, ``cache_hygiene``; every
  ``10 × interval``-th sync the oracle reloads the current weights (B twice == B);
- every ``interval``-th step: ``logprob_agreement`` on the tokens just generated.

Which checks a sampler can feed follows from what it declares (:mod:`trl_fp8.samplers`): a sampler whose tensors
cannot be read back gets no ``freshness``, ``quant_parity`` or ``differential_oracle``; one without a prefix cache
no ``cache_hygiene``. A check that had nothing to compare (e.g. ``quant_parity`` when every served tensor is the
very tensor that ``freshness`` already compared, or a cache that cannot be observed) is *not applicable*: it is
logged once and recorded as no pass. Metrics go to ``record(name, value)``: the trainer passes TRL's own
per-mode metrics.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterable

import torch

from .. import numerics
from ..digest import tensor_digest
from ..samplers import Sampler, SyncLog
from . import checks as C

logger = logging.getLogger("trl_fp8.sync_checks")
ORACLE_EVERY = 10  # the oracle's reload re-runs every ORACLE_EVERY × interval syncs


class LearnerSide:
    """What the learner means the sampler to serve.

    ``exported()`` yields the tensors a sync streams (learner names); ``specs`` maps each served name to the
    :class:`~trl_fp8.numerics.TensorSpec` the sampler must follow (contributed by the capabilities that own the
    tensor). The learner's reference for a name — what the sampler must compute with — is the spec's quantizer
    applied to the exported tensor; :meth:`update` streams the learner's tensors again before a round of checks
    (a trainer may re-wrap or re-place its parameters after set-up).
    """

    def __init__(self, exported: Callable[[], Iterable[tuple[str, torch.Tensor]]],
                 specs: dict[str, numerics.TensorSpec], computed: Callable[[str], torch.Tensor | None] | None = None):
        """``computed(name)``: where the stream *is* the served tensor (Fair Cast's export), the value the learner's
        loss computes with, read from its parameters instead (None for a name without one): the reference is then
        that value through the spec's quantizer (a dense spec: the value itself, in its own dtype, which the served
        tensor widened exactly must equal bit for bit), an independent side for ``quant_parity``."""
        self.exported = exported
        self.specs = specs
        self.computed = computed
        self._current: dict[str, torch.Tensor] = dict(exported())
        self.shapes = {n: tuple(t.shape) for n, t in self._current.items()}

    def update(self) -> None:
        self._current = dict(self.exported())

    def reference(self, name: str) -> torch.Tensor:
        spec = self.specs[name]
        value = self.computed(name) if self.computed is not None else None
        if value is None:
            return numerics.quantize(self._current[name], spec)
        # dense: no cast here (a round-to-nearest would hide a value the served dtype cannot hold)
        if spec.format == "dense":
            return value.detach() if value.requires_grad else value
        return numerics.quantize(value, spec)


def supported_checks(sampler: Sampler) -> frozenset[str]:
    """The checks a sampler can feed, from what it declares."""
    out = set(C.CHECKS)
    if not sampler.synced:  # nothing is synced into it (e.g. fast QLoRA's rollout cache, rebuilt per generation)
        return frozenset({"logprob_agreement"})
    if not sampler.readable:
        out -= {"freshness", "quant_parity", "differential_oracle"}
    if not sampler.has_prefix_cache:
        out.discard("cache_hygiene")
    return frozenset(out)


class SyncMonitor:
    def __init__(self, checks: Iterable[str], sampler: Sampler, learner: LearnerSide, interval: int = 1,
                 action: str = "raise", record: Callable[[str, float], None] | None = None, ranks=None):
        """``ranks``: None on one process; with many (DDP), an object with ``agree(results, sent, step, error)`` and
        ``reduce_stats(stats)`` (:mod:`trl_fp8.sync_checks.ranks`): results are then agreed across ranks once per sync
        and the logprob check judges the global batch."""
        self.ranks = ranks
        self._round: list | None = None
        self.sampler = sampler
        self.learner = learner
        self.interval = max(1, int(interval))
        self.action = action
        self.record = record or (lambda name, value: None)
        wanted = C.resolve_checks(checks) if isinstance(checks, str) else tuple(checks)
        supported = supported_checks(sampler)
        self.skipped = tuple(c for c in wanted if c not in supported)
        self.checks = tuple(c for c in wanted if c in supported)
        if self.skipped:
            logger.info("weight-sync checks %s are not available with a %s sampler; running %s",
                        ", ".join(self.skipped), sampler.label, ", ".join(self.checks) or "none")
        self.band = C.LogprobBand()
        self.syncs = 0
        self.steps = 0
        self.compared: dict[str, int] = {}  # check -> evaluations that compared something
        self.not_applicable: dict[str, str] = {}  # check -> why it had nothing to compare (first reason)
        self.failures: list[C.CheckResult] = []
        self.verified: bool | None = None  # the last sync verified bitwise by freshness (None: not checked)
        self._sent_digests: tuple[int, dict[str, str]] | None = None  # (step, digests) of the last verified sync
        if "freshness" in self.checks:
            sampler.watch_routes()  # before the first rollout: which LoRA slot each token reads

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Counters (the interval's phase; first-sync checks run once per run, not per session), the logprob band's
        memory (reference, consecutive over-band evaluations) and what was compared or failed so far."""
        band = self.band
        return {
            "syncs": self.syncs, "steps": self.steps,
            "band": {"reference": band.reference, "evaluations": band.evaluations, "over": band.over,
                     "path_reference": band.path_reference, "path_evaluations": band.path_evaluations,
                     "held": None if band.held is None else list(band.held), "since_reference": band.since_reference,
                     "remeasure": band.remeasure},
            "compared": dict(self.compared), "not_applicable": dict(self.not_applicable),
            "failures": [[r.check, r.message] for r in self.failures],
        }

    def load_state_dict(self, state: dict) -> None:
        self.syncs, self.steps = int(state["syncs"]), int(state["steps"])
        band = state["band"]
        self.band.reference = None if band["reference"] is None else float(band["reference"])
        self.band.evaluations, self.band.over = int(band["evaluations"]), int(band["over"])
        path = band.get("path_reference")  # absent in checkpoints of trl_fp8 <= 0.1's band: it calibrates afresh
        self.band.path_reference = None if path is None else float(path)
        self.band.path_evaluations = int(band.get("path_evaluations", 0))
        held = band.get("held")
        self.band.held = None if held is None else (float(held[0]), int(held[1]))
        self.band.since_reference = int(band.get("since_reference", 0))
        self.band.remeasure = bool(band.get("remeasure", False))
        self.compared = {str(k): int(v) for k, v in state["compared"].items()}
        self.not_applicable = {str(k): str(v) for k, v in state["not_applicable"].items()}
        self.failures = [C.CheckResult(check, False, message) for check, message in state["failures"]]

    def enabled(self, check: str) -> bool:
        return check in self.checks

    # -- reporting ----------------------------------------------------------------------------------------------
    def report(self, result: C.CheckResult) -> None:
        if self._round is not None:  # many processes: applied once the ranks agree (see _agreed)
            self._round.append(result)
            return
        self._apply(result)

    @contextlib.contextmanager
    def _agreed(self, step: int, sent=None):
        """Many processes: collect the results of the block, agree on them across ranks (one collective, on every
        rank, whatever happened in the block), then apply them — the same error on every rank."""
        if self.ranks is None:
            yield
            return
        self._round = []
        error = None
        try:
            yield
        except Exception as err:  # noqa: BLE001 - the other ranks must hear of it, then it is raised here
            error = err
        finally:
            results, self._round = self._round, None
        digests = self.ranks.digests(sent()) if sent is not None and error is None else None
        merged = self.ranks.agree(results, digests, step, None if error is None else repr(error))
        if error is not None:
            raise error
        for result in merged:
            self._apply(result)

    def _apply(self, result: C.CheckResult) -> None:
        if not result.applicable:  # nothing was compared: neither a pass nor a failure
            if result.check not in self.not_applicable:
                self.not_applicable[result.check] = result.message
                logger.info("weight-sync check %s: not applicable (%s)", result.check, result.message)
            return
        self.compared[result.check] = self.compared.get(result.check, 0) + 1
        self.record(f"sync/{result.check}", 1.0 if result.passed else 0.0)
        for key, value in result.metrics.items():
            if key.startswith(("logp_", "is_ratio_", "tokens_")):  # the gap, the ratio, the tokens routed
                self.record(f"sync/{key}", float(value))
        if result.passed:
            return
        self.failures.append(result)
        if self.action == "raise":
            raise C.WeightSyncError(result.check, result.message)
        warnings.warn(f"[{result.check}] {result.message}", C.WeightSyncWarning, stacklevel=3)

    # -- around a sync ------------------------------------------------------------------------------------------
    def _state(self, sampler: Sampler, step: int) -> dict[str, torch.Tensor]:
        served = sampler.manifest()
        state = {n: sampler.read(n).detach().clone() for n in self.learner.shapes if n in served}
        for alias, (effective, _) in sampler.alias_reads(step).items():
            state[f"{alias} (effective)"] = effective.detach().clone()
        return state

    @torch.no_grad()
    def before_sync(self, step: int) -> None:
        self._before = []
        if self.syncs == 0 and self.enabled("differential_oracle"):
            if self.ranks is not None:  # agreed with the rest of this sync's results, after it
                self._before.append(self.startup_oracle(step))
            else:
                self.report(self.startup_oracle(step))

    @torch.no_grad()
    def startup_oracle(self, step: int) -> C.CheckResult:
        s = self.sampler
        served = s.manifest()
        a = {n: s.read(n).detach().clone() for n in self.learner.shapes if n in served}
        b = {n: (torch.nextafter(t, torch.full_like(t, float("inf"))) if t.is_floating_point() else t)
             for n, t in a.items()}
        state_a = self._state(s, step)
        s.load(b.items())
        state_ab = self._state(s, step)
        problems = []
        cold = s.cold(b)
        if cold is not None:
            problems.append(C.compare_states("warm A→B vs cold B", self._state(cold, step), state_ab))
        s.load(b.items())
        problems.append(C.compare_states("B loaded twice vs once", state_ab, self._state(s, step)))
        s.load(a.items())
        problems.append(C.compare_states("A→B→A vs A", state_a, self._state(s, step)))
        s.reset_cache()
        problems = [p for p in problems if p]
        if problems:
            return C.CheckResult("differential_oracle", False, "; ".join(problems))
        return C.CheckResult("differential_oracle", True)

    @torch.no_grad()
    def after_sync(self, step: int, log: SyncLog) -> None:
        before, self._before = getattr(self, "_before", []), []
        due = self.syncs % self.interval == 0
        sent = (lambda: log.tensors) if due and self.enabled("freshness") else None  # replicas compared (DDP)
        with self._agreed(step, sent):
            for result in before:
                self.report(result)
            self._after_sync(step, log)

    def _after_sync(self, step: int, log: SyncLog) -> None:
        s, first = self.sampler, self.syncs == 0
        s.begin_round()
        self._sent_digests = None  # re-verified after the rollouts only what this sync's freshness verified
        self.verified = None  # whether this sync was verified bitwise (None: freshness did not run on it)
        self.syncs += 1
        due = (self.syncs - 1) % self.interval == 0
        manifest = s.manifest() if (first or due) and self.checks else {}
        if first and self.enabled("recipe_parity"):
            sampler_recipe = {}
            for name, spec in s.recipe().items():  # the cast the sampler's load applied (copy_: RTN)
                sent = log.tensors.get(name)
                sampler_recipe[name] = spec.with_(
                    cast="none" if sent is None or sent.dtype == manifest[name][1] else "rtn")
            self.report(C.recipe_parity(self.learner.specs, sampler_recipe))
        if not due:
            return
        if self.enabled("coverage"):
            self.report(C.coverage(
                log.counts, self.learner.shapes, s.targets(self.learner.shapes),
                {n: tuple(t.shape) for n, t in log.tensors.items()}, {n: v[0] for n, v in manifest.items()}))
        verified = None
        if self.enabled("freshness"):
            sent = {n: t for n, t in log.tensors.items() if n in manifest}
            result = C.freshness(step, s.version(), sent, s.read, s.alias_reads(step))
            if result.applicable:
                self.verified = result.passed
            self.report(result)
            verified = sent if result.passed else None
            if s.serves_digests and result.passed:  # what the rollouts must be generated with: re-verified after them
                self._sent_digests = (step, {n: tensor_digest(t if t.dtype == manifest[n][1] else t.to(manifest[n][1]))
                                             for n, t in sent.items()})
        if self.enabled("quant_parity"):
            self.learner.update()
            self.report(C.quant_parity([n for n in self.learner.shapes if n in manifest], self.learner.reference,
                                       s.read_effective, verified))
        if self.enabled("cache_hygiene"):
            self.report(C.cache_hygiene(step, s.cached_blocks(), s.cache_observable))
        if self.enabled("differential_oracle") and not first and (self.syncs - 1) % (ORACLE_EVERY * self.interval) == 0:
            before = self._state(s, step)
            s.load((n, t) for n, t in log.tensors.items() if n in manifest)
            problem = C.compare_states("B loaded twice vs once", before, self._state(s, step))
            s.reset_cache()
            self.report(C.CheckResult("differential_oracle", problem is None, problem or ""))

    # -- after a generation -------------------------------------------------------------------------------------
    def after_rollouts(self, step: int, synced) -> None:
        """Every generation (on every rank, the same points: the ranks agree on the result): the adapter version each
        finished rollout was generated with against the one the learner synced (freshness, per rollout), where the
        sampler reports it."""
        generated = self.sampler.rollout_versions()
        if not self.enabled("freshness"):
            return
        sent = self._sent_digests if self.sampler.serves_digests else None
        if generated is None and sent is None:
            return
        with self._agreed(step):
            if generated is not None:
                self.report(C.rollout_versions(step, synced, generated))
            if sent is not None:
                self.sampler.begin_round()
                self.report(C.served_after_rollouts(step, sent[0], sent[1], self.sampler.served_digests(sent[1])))
            routes = self.sampler.served_routes()
            if routes is not None:
                self.report(C.rollout_routing(step, routes, self.sampler.route_label))

    def logprob_due(self) -> bool:
        """Call once per generation: whether ``logprob_agreement`` runs on it."""
        due = self.enabled("logprob_agreement") and self.steps % self.interval == 0
        self.steps += 1
        return due

    def after_generation(self, step: int, learner_logps, sampler_logps, mask, numerics_logps=None,
                         numerics_mask=None) -> None:
        """``numerics_logps``: the learner's logprobs of the same tokens at the sampler's precision (the gap that
        numerics alone explain, see :class:`~trl_fp8.sync_checks.checks.LogprobBand`), on ``numerics_mask`` (default
        ``mask``)."""
        stats = C.logprob_stats(learner_logps, sampler_logps, mask, numerics_logps, numerics_mask)
        if self.ranks is not None:  # the global batch, the same judgement (and band state) on every rank
            stats = self.ranks.reduce_stats(stats)
        self.report(self.band.judge(stats, step, self.verified))

    def summary(self) -> dict:
        """What ran: per check, the evaluations that compared something, and the checks that never could."""
        return {"compared": dict(self.compared), "not_applicable": dict(self.not_applicable),
                "failed": [f"[{r.check}] {r.message}" for r in self.failures]}

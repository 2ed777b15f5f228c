"""``trl_fp8.GRPOTrainer``: ``trl.GRPOTrainer`` with trl_fp8's capabilities composed in.

The trainer is the composer only: it holds the ordered list of the capabilities a run asks for
(:data:`trl_fp8.registry.CAPABILITIES`) and calls their hooks (:class:`trl_fp8.capability.Capability`) at
fixed points of TRL's step. Who generates and what the sampler is sent is one sampling decision
(:mod:`trl_fp8.sampling`), made before TRL builds anything; after set-up the owner it names makes its offer
(:class:`~trl_fp8.capability.SamplerOffer`), which the decision's kind handler (:mod:`trl_fp8.kinds`) installs; every
sync of it (the in-process twin's, here; TRL's vLLM sync, wrapped once) is observed by every capability (the
weight-sync checks).
A capability may replace the in-process generation path or the vLLM engine call (DUET), and record the sampler's
logprobs on the way (the checks). Every TRL-private name it touches goes through :mod:`trl_fp8._trl`. With every trl_fp8 field
of :class:`trl_fp8.GRPOConfig` at its default the list is empty and training is TRL's, step for step
(``tests/test_trainer.py`` proves it bit for bit on CPU) — with one exception: a LoRA policy over a 4-bit base with
vLLM is served as base + adapters (TRL would merge the adapters into 4-bit weights).
"""

from __future__ import annotations

import contextlib
import logging

import torch
from trl import GRPOTrainer as _TRLGRPOTrainer

from . import _trl, checkpoints, composition, distributed, kinds, models, sampling, trackers
from .registry import CAPABILITIES
from .capability import GENERATION_PATH_HONOURS, Capability, SamplerOffer, StopNow
from .config import GRPOConfig
from .metrics import MetricsJsonlCallback
from .samplers import SyncLog

logger = logging.getLogger("trl_fp8")


class GRPOTrainer(_TRLGRPOTrainer):
    """Drop-in replacement for :class:`trl.GRPOTrainer`; takes the same arguments.

    ``args`` may be a :class:`trl_fp8.GRPOConfig` or a plain :class:`trl.GRPOConfig` (or None, as in TRL);
    with a plain TRL config every trl_fp8 capability is off.
    """

    _tag_names = ["trl", "grpo", "trl-fp8"]
    capabilities: dict[str, Capability] = {}  # class default: TRL's __init__ may run overridden methods first
    _loss_inputs = None

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, *pargs, **kwargs):
        if isinstance(args, GRPOConfig):
            args.validate_trl_fp8()  # again: a field set after the config was built skipped its checks
        model = models.resolve_model(model)  # e.g. "trl-fp8:smollm2" -> its converted folder
        # Who samples and what it is sent: decided once, before TRL loads or builds anything (a refusal names the
        # fields here); the engine build, the install below, the checks and the memory plan read it
        self.sampling = None
        if isinstance(args, GRPOConfig):
            self.sampling = sampling.decide_for(model, args, _trl.peft_config_argument(pargs, kwargs),
                                                _trl.quantization_config_argument(pargs, kwargs), CAPABILITIES)
        with _trl.engine_context(self.sampling):
            super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        trackers.attach(self)  # W&B / trackio: a resumed session continues the same run
        self._guard_4bit_cpu_repack()
        self.capabilities = {}
        layout = distributed.detect(self)  # DeepSpeed/FSDP from args, an accelerate config or the trainer itself
        for cls in CAPABILITIES:  # set-up order is list order
            if cls.wanted(self.args) and distributed.admit(cls, self.args, layout, CAPABILITIES):
                capability = cls()
                self.capabilities[cls.name] = capability  # visible to those set up after it
                if capability.setup(self) is False:
                    del self.capabilities[cls.name]
        self._install_sampler()
        metrics_jsonl = getattr(self.args, "metrics_jsonl", None)
        if metrics_jsonl:
            self.add_callback(MetricsJsonlCallback(metrics_jsonl))

    def _guard_4bit_cpu_repack(self) -> None:
        """Every 4-bit policy (and reference model), whatever samples it: bitsandbytes' in-place CPU repack switched
        off (on an AVX512-BF16 CPU an eval-mode forward, e.g. the logprob check's reference, would repack the weights
        for its inference kernel; training through them afterwards fails on a bias or silently loses the gradient
        through the base), and undone where a forward before training already did it."""
        from . import fourbit

        repacked = fourbit.guard_cpu_repack(self.accelerator.unwrap_model(self.model))
        if self.ref_model is not None:
            repacked += fourbit.guard_cpu_repack(self.accelerator.unwrap_model(self.ref_model))
        if repacked:
            logger.warning("%d 4-bit weights had been repacked in place for bitsandbytes' CPU inference kernel (an "
                           "eval-mode forward before training); converted back before training (the repack rounded "
                           "their block scales to bf16).", repacked)

    # -- composition --------------------------------------------------------------------------------------------
    def capability(self, name: str) -> Capability | None:
        """The running capability called ``name`` (e.g. ``"fair_cast"``), or None when it is off."""
        return self.capabilities.get(name)

    def describe_tensors(self, model: torch.nn.Module) -> dict:
        """Specs of the tensors whose numerics a capability changes (e.g. MXFP8 linears), read from ``model``."""
        out = {}
        for capability in self.capabilities.values():
            out.update(capability.describe(model))
        return out

    # -- the sampler: one offer, resolved and installed once; every sync observed -------------------------------
    def _install_sampler(self) -> None:
        """Install what the sampling decision (``self.sampling``) says: the owner's offer (its stream, dtype, sampler),
        with the decision's kind handler (:func:`trl_fp8.kinds.handler`: e.g. a dense stream set as TRL's vLLM
        stream, or LoRA versions pushed to the engine); tell every capability (``sampler_ready``: e.g. the
        checks build both sides of the comparison), and put the capabilities around TRL's vLLM sync as observers
        (``before_sync`` / ``after_sync``). Then print the decision where the user sees it."""
        self._sampler_offer = None
        decision = self.sampling
        if decision is None:
            return
        if self.capabilities:
            composition.check_replacements(self)  # two undeclared replacements fail here, not at the first generation
        offer = None
        if decision.owner is not None and decision.owner != sampling.BUILTIN_OWNER:
            owner = self.capabilities.get(decision.owner)
            if owner is None:
                raise RuntimeError(f"the sampling decision names {decision.owner!r} to serve the sampler, but it did "
                                   "not set up on this run")
            offer = owner.offer(self)
            if offer is not None:
                offer.owner = owner.name
        if offer is None and decision.kind != sampling.TRL:
            offer = SamplerOffer(owner=decision.owner or "")
        if offer is not None:
            offer.kind = decision.kind
            installed = kinds.handler(decision).install(self, offer)
            if installed is not None:
                offer.sampler = installed
        self._sampler_offer = offer
        for name, capability in list(self.capabilities.items()):
            if capability.sampler_ready(self, offer) is False:
                del self.capabilities[name]
        if decision.vllm != "off" and composition.sync_observers(self.capabilities.values()):
            _trl.wrap_vllm_sync(self.vllm_generation, self._observed_vllm_sync)
        if self.accelerator.is_main_process and (self.capabilities or decision.kind != sampling.TRL):
            for line in decision.describe() + composition.describe(self):
                self.accelerator.print(line)

    def offer(self) -> SamplerOffer | None:
        """The sampler offer that won (e.g. Fair Cast's served copy and twin, fast QLoRA's rollout cache or dense
        ``dequant(W) + ΔW`` stream, LoRA versions pushed to vLLM), as resolved at set-up; None: TRL's own sampler and
        stream."""
        return getattr(self, "_sampler_offer", None)

    def _observed_vllm_sync(self, run) -> None:
        """TRL's vLLM sync (whatever stream the offer installed), with every capability observing it."""
        step = int(self.state.global_step)
        for capability in list(self.capabilities.values()):
            capability.before_sync(self, step)
        log = SyncLog()
        run(log.tap)
        for capability in list(self.capabilities.values()):
            capability.after_sync(self, step, log)

    def _sync_sampler(self) -> None:
        """Bring an in-process sampler that a sync feeds (e.g. Fair Cast's twin) to the current export, once per
        learner step, with every capability observing the sync."""
        offer = self.offer()
        if self.sampling is None or not kinds.handler(self.sampling).synced(offer):
            return
        sampler = offer.sampler
        step = int(self.state.global_step)
        if sampler.version() == step:
            return
        for capability in list(self.capabilities.values()):
            capability.before_sync(self, step)
        log = SyncLog()
        sampler.load(log.tap(offer.stream()))
        sampler.set_version(step)
        for capability in list(self.capabilities.values()):
            capability.after_sync(self, step, log)

    def _generation_model(self):
        """The in-process model to generate with instead of the learner (e.g. Fair Cast's twin), synced to the current
        export first; None when the learner generates itself."""
        offer = self.offer()
        if offer is None or offer.model is None:
            return None
        self._sync_sampler()
        return offer.model

    # Mirrors trl 1.16 GRPOTrainer._generate_single_turn: vLLM and continuous batching are TRL's paths (Fair Cast's
    # stream and the checks are wired into TRL's sync; a capability may answer TRL's vLLM engine call, e.g. DUET's
    # step loop); the in-process path runs in this order. Which capability offers what is declared (composition).
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        vllm_generate = composition.vllm_generate(self) if self.use_vllm else None
        if vllm_generate is not None:  # on the engine, after TRL's sync
            with _trl.replacing_vllm_generate(self.vllm_generation, vllm_generate):
                out = super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                    has_tool_images)
            self._stop_point()
            return out
        if self.use_vllm or self.use_transformers_continuous_batching or not self.capabilities:
            out = super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                has_tool_images)
            self._stop_point()
            return out
        model = self._generation_model()  # 1. e.g. Fair Cast's twin instead of the learner
        caps = list(self.capabilities.values())
        path = composition.generation_path(self)
        with contextlib.ExitStack() as stack:
            for c in caps:
                stack.enter_context(c.generating(self))
            if path is not None:  # 2. e.g. DUET's planned rollouts replace the path (honouring stopping criteria)
                honour = {hook: [x for c in caps for x in getattr(c, hook)(self)] for hook in GENERATION_PATH_HONOURS}
                out = path(prompt_ids, images, multimodal_fields, num_generations, model, **honour)
                self._stop_point()
                return out
            criteria = [x for c in caps for x in c.stopping_criteria(self)]  # 3. extra stopping criteria (the time
            with _trl.generating_with(self, model, stopping_criteria=criteria):  # budget's stop)
                completion_ids, logprobs = super()._generate_single_turn(prompt_ids, images, multimodal_fields,
                                                                         num_generations, has_tool_images)
        self._stop_point()  # before any capability sees a generation a stop may have cut short
        for c in caps:
            c.after_generation(self, completion_ids)
        return completion_ids, logprobs

    # -- stopping the step in flight (e.g. on SIGTERM): at a micro-batch or generation boundary ------------------
    def _stop_point(self) -> None:
        """Ask every capability (all of them, on every process, at the same points: they may all-reduce) whether to
        stop the optimizer step in flight; :meth:`train` then saves the last complete step."""
        if not self.model.training or not self.capabilities:
            return
        if any([c.stop_now(self) for c in self.capabilities.values()]):  # a list: every capability is asked
            raise StopNow()

    def training_step(self, model, inputs, num_items_in_batch=None):
        checkpoints.mark_step_boundary(self)  # at a step's first micro-batch: the state a stop inside it saves
        self._stop_point()
        return super().training_step(model, inputs, num_items_in_batch)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        scored = bool((~torch.isnan(rewards).all(dim=1)).any()) if rewards.numel() else False
        for capability in self.capabilities.values():
            rewards = capability.adjust_rewards(self, rewards)
        # every scored row withheld by a capability (DUET sampled nothing this step): no reward statistics for it
        self._rewards_withheld = scored and bool(torch.isnan(rewards).all())
        return rewards

    def _generate_and_score_completions(self, inputs):
        self._rewards_withheld = False
        for capability in self.capabilities.values():  # e.g. DUET's refill replaces idle prompts' rows
            inputs = capability.adjust_inputs(self, inputs)
        self._generation_inputs = inputs  # the batch's dataset rows, slot-aligned: a generation path may score them
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._generation_inputs = None
        if self._rewards_withheld:
            _trl.drop_reward_metrics_of_last_batch(self)
        for capability in self.capabilities.values():
            output = capability.adjust_batch(self, output)
        dropping = [c.name for c in self.capabilities.values() if c.drops_masked_rows]
        if self.model.training and dropping:
            output, dropped = _trl.drop_masked_rows(self, output)  # e.g. DUET's placeholders: no loss pass on them
            _trl.record_metric(self, f"{dropping[0]}/loss_rows_dropped_frac",
                               dropped / (dropped + output["completion_mask"].size(0)))
        return output

    # Mirrors trl 1.16 GRPOTrainer._compute_loss: its first _get_per_token_logps_and_entropies call is the policy's
    # forward on the batch; capabilities see those logprobs (e.g. the logprob check's learner side, for free).
    def _compute_loss(self, model, inputs):
        self._loss_inputs = inputs
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._loss_inputs = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *args,
                                                         **kwargs)
        inputs, self._loss_inputs = self._loss_inputs, None
        if inputs is not None:
            for capability in self.capabilities.values():
                capability.on_policy_logps(self, inputs, out[0])
        return out

    def end(self):
        """TRL's ``end()`` (trackers finished, process group destroyed), after shutting a colocated vLLM engine down
        in order (otherwise vLLM's exit hook later destroys groups that no longer exist and prints a traceback), and
        after the decision's kind handler took back what the run left (with adapter versions to a server: the last
        version unloaded and its RAM-backed folder removed)."""
        _trl.shutdown_trainer_vllm(self)
        if self.sampling is not None:
            kinds.handler(self.sampling).teardown(self, self.offer())
        super().end()

    # -- checkpoints: atomic, each capability's state inside, resumed from the newest complete one -----------------
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None):
        """TRL's ``train``, with ``resume_from_checkpoint="auto"`` (also taken from ``args.resume_from_checkpoint``
        when no argument is given): the newest complete checkpoint, else the previous one, else a fresh start.
        ``True`` skips incomplete checkpoints too; any checkpoint written with other trl_fp8 settings is refused; a
        checkpoint at ``max_steps`` is loaded without training a step past it.
        See :mod:`trl_fp8.checkpoints`."""
        resume = checkpoints.prepare_resume(self, resume_from_checkpoint, trial)
        finished = checkpoints.finished_run(self, resume)  # at max_steps already: nothing to train
        if finished is not None:
            return finished
        self._step_boundary = None
        try:
            return super().train(resume_from_checkpoint=resume, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval)
        except StopNow:  # a capability stopped the step in flight: keep the last complete one
            return checkpoints.save_stopped_run(self, trial)
        except Exception as err:
            self._save_before_server_gone(err, trial)
            raise
        finally:  # also when training raises (on_train_end never ran)
            trackers.restore_env(self)

    def _save_before_server_gone(self, err: Exception, trial) -> None:
        """A vLLM server that stopped answering and did not come back (:class:`~trl_fp8._trl.vllm_server_lora.
        ServerGone`) stops the run inside a step, before its optimizer update, as a SIGTERM would: the last complete
        step's checkpoint is saved, so a resume once the server runs again loses nothing. One process only: with
        several, the others wait in a collective for the one that talks to the server."""
        from ._trl.vllm_server_lora import ServerGone

        if not isinstance(err, ServerGone) or self.args.world_size > 1 or not self.model.training:
            return
        checkpoints.save_stopped_run(self, trial)

    def _save_checkpoint(self, model, trial):
        checkpoints.save_checkpoint(self, trial)  # what TRL writes, written atomically; push and rotation after

    def _get_train_sampler(self, dataset=None):
        self._train_sampler = super()._get_train_sampler(dataset)  # a resume advances it to the resumed epoch
        return self._train_sampler

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            checkpoints.load_states(self, checkpoint)

"""``trl_fp8.GRPOTrainer``: ``trl.GRPOTrainer`` with trl_fp8's capabilities composed in.

The trainer is the composer only: it holds the ordered list of the capabilities a run asks for
(:data:`trl_fp8.registry.CAPABILITIES`) and calls their hooks (:class:`trl_fp8.capability.Capability`) at
fixed points of TRL's step. Where capabilities must compose, the order is written here, once: Fair Cast's twin is
the model generation runs with (synced, with the checks observing the sync), DUET replaces the in-process
generation path (with vLLM: the engine call of TRL's path, after TRL's own sync), the checks record the sampler's
logprobs on the way. Every TRL-private name it touches goes through :mod:`trl_fp8._trl`. With every trl_fp8 field
of :class:`trl_fp8.GRPOConfig` at its default the list is empty and training is TRL's, step for step
(``tests/test_trainer.py`` proves it bit for bit on CPU).
"""

from __future__ import annotations

import contextlib

import torch
from trl import GRPOTrainer as _TRLGRPOTrainer

from . import _trl, checkpoints, composition, distributed, models, trackers
from .registry import CAPABILITIES
from .capability import GENERATION_PATH_HONOURS, Capability, Serving, StopNow
from .config import GRPOConfig
from .metrics import MetricsJsonlCallback


class GRPOTrainer(_TRLGRPOTrainer):
    """Drop-in replacement for :class:`trl.GRPOTrainer`; takes the same arguments.

    ``args`` may be a :class:`trl_fp8.GRPOConfig` or a plain :class:`trl.GRPOConfig` (or None, as in TRL);
    with a plain TRL config every trl_fp8 capability is off.
    """

    _tag_names = ["trl", "grpo", "trl-fp8"]
    capabilities: dict[str, Capability] = {}  # class default: TRL's __init__ may run overridden methods first
    _loss_inputs = None

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, *pargs, **kwargs):
        model = models.resolve_model(model)  # e.g. "trl-fp8:smollm2" -> its converted folder
        with _trl.engine_context(args, CAPABILITIES):
            super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        trackers.attach(self)  # W&B / trackio: a resumed session continues the same run
        self.capabilities = {}
        engine = distributed.detect(self)  # DeepSpeed/FSDP from args, an accelerate config or the trainer itself
        for cls in CAPABILITIES:  # set-up order is list order
            if cls.wanted(self.args) and distributed.admit(cls, self.args, engine):
                capability = cls()
                self.capabilities[cls.name] = capability  # visible to those set up after it
                if capability.setup(self) is False:
                    del self.capabilities[cls.name]
        metrics_jsonl = getattr(self.args, "metrics_jsonl", None)
        if metrics_jsonl:
            self.add_callback(MetricsJsonlCallback(metrics_jsonl))

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

    def serving(self) -> Serving | None:
        """What the sampler is sent instead of TRL's stream (e.g. Fair Cast's served copy, or fast QLoRA's dense
        ``dequant(W) + ΔW`` to a vLLM engine), as the capabilities declare it; None: TRL's own stream."""
        return composition.serving(self)

    def _generation_model(self):
        """The in-process model to generate with instead of the learner (e.g. Fair Cast's twin, synced to the current
        export), as the capabilities declare it; None when the learner generates itself."""
        return composition.generation_model(self)

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
            processors = [p for c in caps for p in c.logits_processors(self)]  # 3. extra processors and
            criteria = [x for c in caps for x in c.stopping_criteria(self)]  # criteria (the time budget's stop)
            with _trl.generating_with(self, model, processors, criteria):
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
        self._generation_inputs = inputs  # the batch's dataset rows, slot-aligned: a generation path may score them
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._generation_inputs = None
        if self._rewards_withheld:
            _trl.drop_reward_metrics_of_last_batch(self)
        for capability in self.capabilities.values():
            output = capability.adjust_batch(self, output)
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
        in order: otherwise vLLM's exit hook later destroys groups that no longer exist and prints a traceback."""
        _trl.shutdown_trainer_vllm(self)
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

    def _save_checkpoint(self, model, trial):
        checkpoints.save_checkpoint(self, trial)  # what TRL writes, written atomically; push and rotation after

    def _get_train_sampler(self, dataset=None):
        self._train_sampler = super()._get_train_sampler(dataset)  # a resume advances it to the resumed epoch
        return self._train_sampler

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            checkpoints.load_states(self, checkpoint)

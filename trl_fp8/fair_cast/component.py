"""Fair Cast as a trainer capability: its config fields, the served copy, the in-process twin it generates with,
TRL's vLLM stream, its optimizer-step callback and its checkpoint state."""

from __future__ import annotations

import copy
import logging

import torch

from .. import _trl, distributed, fourbit, numerics, sampling, serving
from ..numerics import dtype_name
from ..capability import Capability, Conflict, SamplerOffer, check_choice
from ..samplers import TransformersSampler
from .callback import FairCastCallback
from .rounding import SERVED_DTYPES
from .served import ParamUnit, ServedCopy
from . import declaration
from .declaration import FairCastArgs, FAIR_CAST_MODES  # noqa: F401 (re-exported)

logger = logging.getLogger("trl_fp8.fair_cast")




def _refuse_unsupported_peft(model) -> None:
    """Fair Cast serves a full model, or a LoRA model as base + rounded adapter factors (``lora_serving="adapters"``,
    the default) or as merged weights (``"merged"``); other PEFT methods have neither form."""
    from accelerate.utils import is_peft_model

    if not is_peft_model(model):
        return
    config = getattr(model, "peft_config", {}).get(getattr(model, "active_adapter", "default"))
    kind = str(getattr(config, "peft_type", "unknown")).rsplit(".", 1)[-1]
    if kind != "LORA" or getattr(config, "is_prompt_learning", False):
        raise ValueError(
            f"fair_cast with a PEFT {kind} model is not supported: Fair Cast serves the full weights, or a LoRA "
            "model's base with its rounded adapter factors (or its merged weights W + ΔW), and a prompt-learning or "
            "other adapter has neither form to serve. Use LoRA (peft LoraConfig), a full model, or fair_cast='off'."
        )


class FairCast(Capability):
    name = "fair_cast"
    Args = FairCastArgs
    state_file = "fair_cast_state.pt"
    # its state (masters, served copy, residual, lag metric) moves only at the optimizer step, which a step stopped
    # mid-way never reaches: saved as it is at the stop, not copied (model-sized) at every step boundary
    state_at_stop = "current"
    resume_fields = ("fair_cast", "served_dtype", "lora_serving")
    layouts = {
        "ddp": None,  # every replica exports the same bits: SR keyed by (seed, step, tensor), EF deterministic
        # ZeRO-1/2/3: the export replaces DeepSpeed's fp32 -> 16-bit partition copy (fair_cast.zero)
        "deepspeed": None,
        "fsdp": "the trainer does not yet export into FSDP's all-gather shards (the shard-invariant export itself "
                "is trl_fp8.fair_cast.sharded)",
    }
    off_hint = "fair_cast='off'"
    after = declaration.AFTER
    overrides = declaration.OVERRIDES
    conflicts = tuple(Conflict(f, "TRL's continuous-batching path casts the model to the mixed-precision dtype in "
                               "place, which silently discards the fp32 master. Use the default transformers "
                               "generation or vLLM.") for f in (
        "use_transformers_continuous_batching", "use_transformers_paged"))

    @classmethod
    def wanted(cls, args) -> bool:
        return declaration.wanted(args)

    @classmethod
    def adapt_precision(cls, args, resolved: str) -> str | None:
        """Under fp16 autocast (GPUs without native bf16) the served copy is fp16 too, unless another dtype was
        asked for."""
        if resolved == "fp16" and cls.wanted(args) and getattr(args, "served_dtype", None) == "bfloat16":
            args.served_dtype = "float16"
            return "Fair Cast served_dtype='float16'"
        return None

    @classmethod
    def serves(cls, args, facts) -> str | None:
        return declaration.serves(args, facts)

    def offer(self, trainer) -> SamplerOffer | None:
        """The served copy as what the sampler is sent, for the kind decided (asked only when Fair Cast owns the
        decision): to the in-process twin (which then generates), to TRL's vLLM sync (the served tensors in place of
        its stream), or, for a LoRA policy served as adapters, to the engine's LoRA slots (one version per sync).
        Adapters in-process are no kind of Fair Cast's: the policy itself, its factors holding the served values,
        generates (or fast QLoRA's rollout cache decodes from them)."""
        kind = trainer.sampling.kind
        if kind in sampling.ADAPTER_KINDS:
            return SamplerOffer(self.export_stream, self.dtype, learner_values=self._learner_value)
        if kind == sampling.DENSE_STREAM:
            from .vllm import VLLMExport

            self.vllm_export = VLLMExport(trainer.vllm_generation, self.served, self.export_stream)
            return SamplerOffer(self.export_stream, self.dtype, learner_values=self._learner_value,
                                vllm_stream=self.vllm_export)
        if kind == sampling.TWIN:
            return SamplerOffer(self.export_stream, self.dtype, sampler=self.sampler, model=self.sampler.model,
                                numerics=self._twin_numerics, learner_values=self._learner_value)
        raise RuntimeError(f"Fair Cast was decided the owner of a {kind!r} sampler, which it does not serve")

    def _learner_value(self, name: str) -> torch.Tensor | None:
        """What the loss computes with for a served tensor, read from the learner's parameter (which holds the
        served value between optimizer steps; an adapter's ``lora_B`` holds it divided by its scaling ``s``) — for
        the checks' ``quant_parity``, independently of the stream. Under autocast the loss casts the parameter to the
        autocast dtype and scales the layer's output by ``s``, so the effective factor is ``cast(B̂ / s) · s``,
        computed here in fp32 and returned in fp32: the check compares the served tensor, widened exactly, with it bit
        for bit (a value the served dtype cannot hold fails). None where no parameter holds it (a merged LoRA layer,
        a 4-bit base, DeepSpeed's partitions)."""
        unit = self.served.units.get(name) if self.served is not None and self.zero is None else None
        param = getattr(unit, "param", None)
        if param is None:
            return None
        value = param.detach()
        autocast = self._autocast_dtype
        if autocast is not None:
            value = value.to(autocast)
        scale = getattr(unit, "scale", 1.0)
        if scale == 1 and value.dtype == torch.float32:
            return value  # what serving.folded returns for it (the checks ask per tensor, per sync)
        return serving.folded(value, scale)

    @staticmethod
    def validate(args) -> None:
        check_choice("fair_cast", args.fair_cast, FAIR_CAST_MODES)
        check_choice("served_dtype", args.served_dtype, tuple(SERVED_DTYPES))
        seed = args.fair_cast_seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"fair_cast_seed must be an integer or None, got {seed!r}.")
        if args.fair_cast == "off":
            return
        mode = f"fair_cast={args.fair_cast!r}"
        if args.bf16 and args.served_dtype != "bfloat16":
            raise ValueError(
                f"{mode}: bf16=True autocasts the learner to bfloat16, which would re-round a "
                f"served_dtype={args.served_dtype!r} copy. Use served_dtype='bfloat16', or fp16=True."
            )
        if args.fp16 and args.served_dtype != "float16":
            raise ValueError(
                f"{mode}: fp16=True autocasts the learner to float16, which would re-round a "
                f"served_dtype={args.served_dtype!r} copy. Use served_dtype='float16'."
            )

    def setup(self, trainer) -> bool:
        from accelerate.utils import is_peft_model

        args = trainer.args
        model = trainer.accelerator.unwrap_model(trainer.model)
        _refuse_unsupported_peft(model)
        if is_peft_model(model) and any(spec.format != "dense" for spec in trainer.describe_tensors(model).values()):
            raise ValueError(
                "fair_cast with a PEFT (LoRA) model whose layers another capability quantizes (e.g. mxfp8=True) is not "
                "supported yet: Fair Cast serves the LoRA factors (or export(W + ΔW)) while the base would be "
                "quantized alone. Use one of the two with LoRA."
            )
        self.dtype = SERVED_DTYPES[args.served_dtype]
        self._autocast_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
        self.mode, self.seed = args.fair_cast, args.resolved_fair_cast_seed()
        layout = distributed.detect(trainer)
        self.zero = None
        self.sampler = None  # the in-process twin, as a sampler
        self.vllm_export = None
        record = lambda name, value: _trl.record_metric(trainer, name, value)  # noqa: E731
        self.adapters = False
        if layout.backend == "deepspeed" and layout.zero_stage == 3:
            return self._setup_zero3(trainer, model, record)
        self.adapters = is_peft_model(model) and trainer.sampling.serving == "adapters"  # as decided
        if self.adapters:
            from .peft import adapter_units

            refusal = sampling.scaling_refusal(args, trainer.sampling.facts.lora,
                                               "Fair Cast serves (and the policy holds between steps) one rounded "
                                               "factor export(s · B), divided by s")
            if refusal:
                raise ValueError(refusal)
            units = adapter_units(model)
        elif is_peft_model(model):
            from .peft import lora_units

            units = lora_units(model)
        else:
            units = [ParamUnit(n, p) for n, p in model.named_parameters()]
        self.served = ServedCopy(units, args.fair_cast, self.dtype, args.resolved_fair_cast_seed())
        if self.adapters:
            pass  # the policy itself is the served policy: its base as loaded, its factors holding the served values
            # between optimizer steps. No twin; TRL's generation (or fast QLoRA's rollout cache) runs on it, or a
            # colocated vLLM engine or a server is pushed the served factors as LoRA versions (see offer)
        elif trainer.sampling.kind == sampling.TWIN:
            self.sampler = TransformersSampler(self._twin(trainer, model, units), describe=trainer.describe_tensors)
        if layout.backend == "deepspeed":  # ZeRO-1/2: DeepSpeed holds master and served copy
            from .zero import ZeroFairCast

            self.zero = ZeroFairCast(trainer, args.fair_cast, self.dtype, args.resolved_fair_cast_seed(), record)
            self.callback = self.zero
        else:
            self.callback = FairCastCallback(self.served, record)
        trainer.add_callback(self.callback)
        return True

    def _setup_zero3(self, trainer, model, record) -> bool:
        """ZeRO-3: the policy's parameters are partitioned already. The twin is built from the gathered weights (in the
        served dtype, as DeepSpeed's own 16-bit copy starts); DeepSpeed keeps master and served copy from then on."""
        from accelerate.utils import is_peft_model

        from .zero import ZeroFairCast, gathered_twin

        if trainer.sampling.vllm != "off" or is_peft_model(model):
            raise ValueError("fair_cast under DeepSpeed ZeRO-3 runs with trl_fp8's in-process sampler and a full model "
                             "only (TRL's ZeRO-3 vLLM sync gathers and sends the parameters itself; PEFT merges "
                             "them): use ZeRO-1/2 or DDP for those.")
        self.served = None
        self.sampler = TransformersSampler(gathered_twin(trainer, model, self.dtype), describe=trainer.describe_tensors)
        self.zero = ZeroFairCast(trainer, self.mode, self.dtype, self.seed, record)
        self.callback = self.zero
        trainer.add_callback(self.callback)
        return True

    def _twin(self, trainer, model, units) -> torch.nn.Module:
        """The in-process sampler: a twin of the policy (merged, for LoRA; dense, over a 4-bit base) in the served
        dtype. Its parameters are
        the sampler's own tensors, written by a sync before each generation; buffers stay as they are (e.g. rotary
        frequencies in fp32, as inference engines keep them)."""
        from accelerate.utils import is_peft_model

        twin = copy.deepcopy(model)
        if is_peft_model(model):
            fourbit.unload_dense(twin)  # LoRA over a 4-bit base: merged exactly in fp32, never into the 4-bit weight
            twin = twin.merge_and_unload()
        _trl.repatch_fused_head(trainer, twin)
        for p in twin.parameters():
            p.data = p.data.to(self.dtype)
            p.requires_grad_(False)
        twin.eval()
        served = dict(twin.named_parameters())
        unit_names = {u.name for u in units}
        if unit_names != set(served):
            raise ValueError(
                "Fair Cast could not match the learner's parameters to the served model's: only in the learner "
                f"{sorted(unit_names - set(served))[:5]}, only served {sorted(set(served) - unit_names)[:5]}."
            )
        with torch.no_grad():  # until the first export, the served copy holds the twin's values
            for name, tensor in self.served.served.items():
                tensor.copy_(served[name])
        return twin

    # -- generation ----------------------------------------------------------------------------------------------
    def export_stream(self):
        """What a sync streams: the served copy, by learner name (under ZeRO-1/2, once training runs, DeepSpeed's
        16-bit weights, which hold it)."""
        if self.zero is not None and (self.zero.active or self.served is None):
            return self.zero.stream() if self.zero.active else iter(
                (n, p.detach()) for n, p in self.sampler.model.named_parameters())  # ZeRO-3 before training
        return iter(self.served.served.items())

    def _twin_numerics(self):
        """The twin with the current export in place of its own tensors: what the twin computes when a sync has
        brought it the learner's weights (the logprob check's reference; the twin's own state is not read)."""
        return numerics.parameters_replaced(self.sampler.model, dict(self.export_stream()))

    # -- memory --------------------------------------------------------------------------------------------------
    def held_tensors(self) -> dict:
        """Fair Cast's own tensors, by the categories of :mod:`trl_fp8.fair_cast.memory`: the fp32 masters
        (``master``; an adapter factor's unscaled ``stored`` master; a merged LoRA layer's master is derived, not
        held), the fp32 base a merged 16-bit LoRA layer keeps aside (``base_copy``), the served buffers
        (``served``), the error-feedback residuals (``residual``), the in-process twin's parameters and buffers
        (``twin``) and the fixed metric sample (``metrics``). Under DeepSpeed, DeepSpeed holds master and served
        copy (its optimizer state); only a ZeRO-3 twin is Fair Cast's own."""
        out = {"fair_cast/master": [], "fair_cast/base_copy": [], "fair_cast/served": [], "fair_cast/residual": [],
               "fair_cast/twin": [], "fair_cast/metrics": []}
        served = getattr(self, "served", None)
        if served is not None:
            for unit in served.units.values():
                if hasattr(unit, "stored"):  # AdapterUnit: `master` is computed (scaled) from it
                    out["fair_cast/master"].append(unit.stored)
                elif hasattr(unit, "base_master"):  # LoraUnit (merged serving): W kept aside, W + ΔW derived
                    if unit.base_master is not None:
                        out["fair_cast/base_copy"].append(unit.base_master)
                elif isinstance(unit, ParamUnit):
                    out["fair_cast/master"].append(unit.master)
            out["fair_cast/served"] = list(served.served.values())
            out["fair_cast/residual"] = list(served.residual.values())
            out["fair_cast/metrics"] = [t for t in (*served._subset.values(), served._prev_master,
                                                    served._prev_served, served._ema) if t is not None]
        if self.sampler is not None:
            twin = self.sampler.model
            out["fair_cast/twin"] = list(twin.parameters()) + list(twin.buffers())
        return {k: v for k, v in out.items() if v}

    # -- state ---------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        if self.zero is not None:  # DeepSpeed checkpoints the master; SR/RTN need only the step to export again
            step = self.zero.export.step_count if self.zero.active else 0
            return {"mode": self.mode, "served_dtype": dtype_name(self.dtype), "seed": self.seed,
                    "step": step, "deepspeed": True}
        return self.served.state_dict()

    def save_process_files(self, trainer, folder: str) -> None:
        if self.zero is not None:  # EF under DeepSpeed: every rank's partitions (their residuals) beside its files
            self.zero.save_rank_state(folder)

    def load_process_files(self, trainer, folder: str) -> None:
        if self.zero is not None:  # EF under DeepSpeed reads every rank's file from the checkpoint being resumed
            self.zero.rank_folder = folder

    def load_state_dict(self, state: dict) -> None:
        if self.zero is not None or state.get("deepspeed"):
            for key, mine in (("mode", self.mode), ("served_dtype", dtype_name(self.dtype)),
                              ("deepspeed", self.zero is not None)):
                if state.get(key, False) != mine:
                    raise ValueError(f"Fair Cast checkpoint has {key}={state.get(key)!r}, but this run uses {mine!r}.")
            self.seed = self.zero.seed = int(state["seed"])
            self.zero.restored_step = int(state["step"])
            return
        self.served.load_state_dict(state)
        self.callback.restored = True

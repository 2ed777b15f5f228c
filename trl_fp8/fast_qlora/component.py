"""Fast QLoRA as a trainer capability: its config fields, the edits to a 4-bit LoRA policy at start (dense copies of
the highest-error layers, speed mode), the rollout dequant cache around each in-process generation call, the
16-bit stream a vLLM engine is sent instead of TRL's lossy 4-bit merge, and its counters.

The user's script stays TRL's QLoRA script: a model loaded with ``BitsAndBytesConfig(load_in_4bit=True, ...)`` (or
``model_init_kwargs`` with one) plus ``peft_config=LoraConfig(...)``.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from .. import _trl, fourbit, sampling, serving
from ..capability import Capability, Conflict, SamplerOffer, check_choice
from . import memory
from .cache import RolloutCache
from .counters import DequantCounter
from .layers import PolicyEdits, rank_layers, select_within_budget
from . import declaration
from .declaration import FastQLoRAArgs, FAST_QLORA_MODES, CACHE_DTYPES, DEFAULT_KEEP_BUDGET_GB  # noqa: F401 (re-exported)

logger = logging.getLogger("trl_fp8.fast_qlora")
GIB = 2**30




def _check_gb(field_name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
        extra = " or None (automatic)" if allow_none else ""
        raise ValueError(f"{field_name} must be a number of GiB >= 0{extra}, got {value!r}.")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls natively (AVX512-BF16 or AMX-BF16)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def free_memory_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def automatic_cache_bytes(device: torch.device) -> int:
    """The automatic rollout-cache budget for ``device``'s free memory (:func:`trl_fp8.fast_qlora.memory.
    automatic_cache_bytes`: the rule the memory plan reads too); 0 where the free memory is unknown."""
    free = free_memory_bytes(device)
    return 0 if free is None else memory.automatic_cache_bytes(free)


def resolve_cache_dtype(name: str, compute: torch.dtype, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu" and compute == torch.float32 and cpu_has_native_bf16():
        return torch.bfloat16
    return compute


class FastQLoRA(Capability):
    name = "fast_qlora"
    Args = FastQLoRAArgs
    # which layers stay dense and which adapters train; the rollout cache (size, dtype) may change between sessions
    resume_fields = ("fast_qlora", "qlora_keep_budget_gb", "qlora_adapter_layers")
    layouts = {
        "ddp": None,  # each rank keeps the same dense copies and its own rollout cache; DDP reduces the adapters' grads
        "deepspeed": "DeepSpeed casts and flattens the model's parameters for its 16-bit partitions, and bitsandbytes' "
                     "4-bit bases (which its dense copies and rollout cache are built from) have not been run under it",
        "fsdp": "FSDP would shard the 4-bit bases its dense copies and rollout cache are built from",
    }
    off_hint = "fast_qlora='off'"
    derived_stream = declaration.DERIVED_STREAM
    excludes = {"mxfp8": "MXFP8 quantizes dense linears, and a 4-bit base has none to quantize. Use one of the two."}
    conflicts = (Conflict("use_transformers_continuous_batching", "the rollout cache works on the default "
                          "transformers generation path (or with vLLM).", when=lambda args: args.fast_qlora == "on"),)

    @classmethod
    def wanted(cls, args) -> bool:
        return declaration.wanted(args)

    @classmethod
    def serves(cls, args, facts) -> str | None:
        return declaration.serves(args, facts)

    @staticmethod
    def validate(args) -> None:
        check_choice("fast_qlora", args.fast_qlora, FAST_QLORA_MODES)
        _check_gb("qlora_keep_budget_gb", args.qlora_keep_budget_gb)
        _check_gb("qlora_rollout_cache_gb", args.qlora_rollout_cache_gb, allow_none=True)
        check_choice("qlora_cache_dtype", args.qlora_cache_dtype, CACHE_DTYPES)
        value = args.qlora_adapter_layers
        if isinstance(value, int) and not isinstance(value, bool):
            args.qlora_adapter_layers = value = str(value)
        if not isinstance(value, str) or not (value.strip().lower() == "all" or
                                              (value.strip().isdigit() and int(value) >= 1)):
            raise ValueError(f"qlora_adapter_layers must be 'all' or a number of top blocks >= 1, got {value!r}.")
        if args.fast_qlora == "off":
            return

    # -- set-up --------------------------------------------------------------------------------------------------
    def setup(self, trainer) -> bool:
        from accelerate.utils import is_peft_model

        args = trainer.args
        model = trainer.accelerator.unwrap_model(trainer.model)
        layers = fourbit.lora_layers(model) if is_peft_model(model) else []
        if fourbit.has_8bit(model):
            raise ValueError(f"fast_qlora={args.fast_qlora!r}: the policy has 8-bit (LLM.int8) layers; fast QLoRA "
                             "supports 4-bit bases only (BitsAndBytesConfig(load_in_4bit=True)).")
        if not layers:
            why = ("the policy has no 4-bit layers" if not fourbit.has_4bit(model) else
                   "the policy has 4-bit layers but no LoRA adapters on them (pass peft_config=LoraConfig(...))")
            if args.fast_qlora == "on":
                raise ValueError(f"fast_qlora='on': {why}. Load the model with BitsAndBytesConfig(load_in_4bit=True) "
                                 "and pass a LoraConfig, or use fast_qlora='auto'.")
            logger.info("fast QLoRA: %s; nothing to do.", why)
            return False
        self._refuse_unsupported(trainer, model, layers)
        self.trainer = trainer
        self.model = model
        self.layers = dict(layers)
        first_base = layers[0][1].get_base_layer()
        self.device = first_base.weight.device
        self.cache_dtype = resolve_cache_dtype(args.qlora_cache_dtype, fourbit.compute_dtype(first_base), self.device)
        self.ranking = rank_layers(layers)
        self.edits = PolicyEdits(model)
        self._apply_edits()
        self.counter = DequantCounter()
        self.counter.attach(model)
        self.cache = RolloutCache(layers, 0, self.cache_dtype, on_dequant=self.counter.count_explicit)
        self._dropout_noted = False
        self.vllm_export = None  # the dense stream, once offered (merged serving to vLLM)
        from .callback import FastQLoRACallback

        trainer.add_callback(FastQLoRACallback(self))
        logger.info("fast QLoRA: %d LoRA layers over 4-bit bases; %s", len(layers), self.summary())
        return True

    @staticmethod
    def _refuse_unsupported(trainer, model, layers) -> None:
        for name, layer in layers:
            if any(layer.use_dora.get(a, False) for a in layer.active_adapters):
                raise ValueError(f"fast QLoRA does not support DoRA (layer '{name}'): its forward is not W + ΔW, so "
                                 "neither a dense copy nor the rollout cache can reproduce it. Use use_dora=False.")
            if any(getattr(layer, "lora_bias", {}).get(a, False) for a in layer.active_adapters):
                raise ValueError(f"fast QLoRA does not support lora_bias=True (layer '{name}').")
            if any(a in getattr(layer, "lora_variant", {}) for a in layer.active_adapters):
                raise ValueError(f"fast QLoRA supports plain LoRA only; layer '{name}' uses a LoRA variant "
                                 f"({type(layer.lora_variant[layer.active_adapters[0]]).__name__}).")
            if getattr(layer, "merged", False):
                raise ValueError(f"LoRA layer '{name}' is merged into its 4-bit base (lossy); fast QLoRA needs "
                                 "unmerged adapters.")

    def _apply_edits(self) -> None:
        args = self.trainer.args
        chosen = select_within_budget(self.ranking, int(args.qlora_keep_budget_gb * GIB))
        self.edits.keep_dense(self.layers, chosen)
        k = args.resolved_adapter_layers()
        if k is not None:
            self.edits.train_top_blocks(k)

    def undo(self) -> None:
        """The user's QLoRA policy again (end of training): 4-bit bases back, adapters all trainable."""
        self.edits.undo()

    def redo(self) -> None:
        if not self.edits.kept and self.edits.trained_blocks is None:
            self._apply_edits()

    def summary(self) -> str:
        kept = [layer.get_base_layer().source for layer, _ in self.edits.kept]
        text = (f"{len(kept)} kept dense ({self.edits.kept_bytes / 2**20:.1f} MiB"
                f"{': ' + ', '.join(kept[:4]) + (' ...' if len(kept) > 4 else '') if kept else ''})")
        if self.edits.trained_blocks is not None:
            first, n = self.edits.trained_blocks
            text += f"; adapters train in blocks {first}..{n - 1} of {n}"
        return text

    def held_tensors(self) -> dict:
        """The dense copies of the kept layers (``fast_qlora/dense_copies``) and, under ``base``, the 4-bit modules
        they stand in for, kept aside to be put back after training (the rollout cache lives only during a
        generation call). See :mod:`trl_fp8.fast_qlora.memory`."""
        from ..memory import quant_state_tensors

        dense, aside = [], []
        for layer, four_bit in self.edits.kept:
            dense += list(layer.base_layer.parameters())
            for p in four_bit.parameters():
                aside += [p] + quant_state_tensors(p)
        return {"fast_qlora/dense_copies": dense, "base": aside}

    def kept_layers(self) -> list[str]:
        return [layer.get_base_layer().source for layer, _ in self.edits.kept]

    # -- generation ----------------------------------------------------------------------------------------------
    def cache_budget_bytes(self) -> int:
        gb = self.trainer.args.qlora_rollout_cache_gb
        return automatic_cache_bytes(self.device) if gb is None else int(gb * GIB)

    def generating(self, trainer):
        if trainer.sampling.kind != sampling.ROLLOUT_CACHE:
            return contextlib.nullcontext()  # another kind was decided (e.g. a dense twin generates): nothing dequantizes
        self.cache.budget_bytes = self.cache_budget_bytes()
        if self.cache.budget_bytes > 0 and not self._dropout_noted:
            self._dropout_noted = True
            if any(getattr(layer.lora_dropout[a], "p", 0) for layer in self.layers.values()
                   for a in layer.active_adapters if a in layer.lora_dropout):
                logger.info("fast QLoRA: LoRA dropout is not applied to rollouts decoded through the rollout cache "
                            "(as an inference engine decodes them); the loss forward applies it as usual.")
        return self._cached(trainer)

    @contextlib.contextmanager
    def _cached(self, trainer):
        with self.cache.active():
            yield
        _trl.record_metric(trainer, "qlora/cache_bytes", self.cache.bytes)

    # -- the sampler it offers -------------------------------------------------------------------------------------
    def offer(self, trainer) -> SamplerOffer | None:
        """In-process: the rollout cache (dense weights in ``cache_dtype``, rebuilt from the learner at each
        generation), a separate numerics path no sync feeds, which the logprob check compares. vLLM: the adapters
        as LoRA versions over the engine's base (``lora_serving`` adapters), or ``dequant(W) + ΔW`` of every layer
        in the engine's dtype (``'merged'``)."""
        from ..samplers import RolloutCacheSampler

        kind = trainer.sampling.kind
        if kind == sampling.ROLLOUT_CACHE:
            return SamplerOffer(sampler=RolloutCacheSampler(),
                                numerics=lambda: self._cache_numerics(self.cache_dtype, self.cache_budget_bytes()))
        if kind != sampling.DENSE_STREAM:
            raise RuntimeError(f"fast QLoRA was decided the owner of a {kind!r} sampler, which it does not serve")
        from .vllm import QLoRAVLLMExport

        dense = self.vllm_export = QLoRAVLLMExport(trainer.vllm_generation, self)  # its dtype: the engine's, read once
        return SamplerOffer(dense.stream, dense.dtype(), vllm_stream=dense,
                            numerics=lambda: self._cache_numerics(dense.dtype(), 1 << 62))

    @contextlib.contextmanager
    def _cache_numerics(self, dtype: torch.dtype, budget_bytes: int):
        cache = RolloutCache(list(self.layers.items()), budget_bytes, dtype)  # built now, from the learner's weights
        with torch.no_grad(), cache.active():
            yield self.model

    # -- vLLM and the checks: what a sampler is sent --------------------------------------------------------------
    @torch.no_grad()
    def export_stream(self, dtype: torch.dtype | None = None):
        """``(served name, tensor)`` of the merged model: ``dequant(W) + ΔW`` for each LoRA layer (never merged into
        the 4-bit weight), ``dequant(W)`` for a 4-bit linear without adapters, every other parameter as it is; cast
        to ``dtype`` when given. Names as ``merge_and_unload()`` names them (PEFT prefix and ``.base_layer``
        removed)."""
        from peft.tuners.lora import LoraLayer

        for module_name, module in self.model.named_modules():
            if isinstance(module, LoraLayer):
                base = module.get_base_layer()
                weight = fourbit.merged_weight(module)
                if fourbit.is_4bit(base):
                    self.counter.count_explicit()
                prefix = serving.merged_name(module_name)
                target = dtype or (fourbit.compute_dtype(base) if fourbit.is_4bit(base) else base.weight.dtype)
                yield prefix + ".weight", weight.to(target)
                if getattr(base, "bias", None) is not None:
                    yield prefix + ".bias", base.bias.detach().to(dtype or base.bias.dtype)
        lora_owned = {id(p) for m in self.model.modules() if isinstance(m, LoraLayer) for p in m.parameters()}
        # 4-bit linears without adapters (e.g. LoraConfig(target_modules=["q_proj", "v_proj"])): their parameter
        # holds packed 4-bit codes, meaningless to a 16-bit engine; they are sent dequantized.
        fourbit_weights = {id(m.weight): m for m in self.model.modules() if fourbit.is_4bit(m)}
        for name, param in self.model.named_parameters():
            if id(param) in lora_owned:
                continue
            if ".modules_to_save." in name or ".original_module." in name:
                raise ValueError(f"fast QLoRA with vLLM does not support PEFT modules_to_save (parameter '{name}').")
            module = fourbit_weights.get(id(param))
            if module is not None:
                self.counter.count_explicit()
                yield serving.merged_name(name), fourbit.dequantize(module).to(dtype or fourbit.compute_dtype(module))
                continue
            yield serving.merged_name(name), param.detach().to(dtype or param.dtype)

    # -- metrics -------------------------------------------------------------------------------------------------
    def record_step(self) -> None:
        counts = self.counter.reset()
        _trl.record_metric(self.trainer, "qlora/dequant_calls", counts["total"])
        _trl.record_metric(self.trainer, "qlora/kept_layers", len(self.edits.kept))

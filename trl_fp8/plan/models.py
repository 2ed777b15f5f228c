"""Model architectures as numbers: the parameter tensors of a decoder-only causal LM, from its ``config.json``.

Pure arithmetic (no torch, no transformers at import). A model is given as a name from :data:`MODELS` (a few public
configs, numbers only), a ``config.json`` path, a folder holding one, a ``transformers.PretrainedConfig`` or an
:class:`Arch`. The tensor list is what ``named_parameters()`` yields for the ``*ForCausalLM`` of each known type:
embeddings; per block the attention and MLP projections (q/k/v/o and gate/up/down; Phi-3 fuses them into ``qkv_proj``
and ``gate_up_proj``) with the biases the config asks for, the per-head q/k norms (Qwen3, Gemma 3) and two RMSNorm
weights (four: Gemma 2 and 3); the final norm; the LM head unless tied.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION = PROJECTIONS[:4]
MLP = PROJECTIONS[4:]
# Phi-3's fused projections, in the order its modules are built (o_proj before qkv_proj)
FUSED_PROJECTIONS = ("o_proj", "qkv_proj", "gate_up_proj", "down_proj")
# every block linear's name over the known types: what "all-linear" stands for before the model is known
LINEAR_NAMES = PROJECTIONS + ("qkv_proj", "gate_up_proj")


@dataclass(frozen=True)
class Arch:
    """The architecture numbers of a decoder-only LM (``config.json`` fields in brackets)."""

    name: str
    hidden: int  # hidden_size
    intermediate: int  # intermediate_size
    layers: int  # num_hidden_layers
    heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads
    head_dim: int  # head_dim (default hidden_size // num_attention_heads)
    vocab: int  # vocab_size
    tied: bool  # tie_word_embeddings
    qkv_bias: bool = False  # Qwen2: q/k/v projections have a bias; Llama: attention_bias
    o_bias: bool = False  # Llama attention_bias also puts one on o_proj
    mlp_bias: bool = False  # mlp_bias
    model_type: str = "llama"
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm over head_dim on q and on k (self_attn.q_norm / k_norm)
    norms: int = 2  # hidden-size norms per block (Gemma 2 and 3: pre/post feed-forward norms too)
    fused: bool = False  # Phi-3: qkv_proj and gate_up_proj
    gemma: bool = False  # Gemma: (1 + weight) norms in fp32, a scaled embedding (an embed_scale buffer), GELU
    rotary_kinds: int = 1  # Gemma 3: a rotary embedding per layer type (sliding and full attention)

    @property
    def projections(self) -> tuple[str, ...]:
        """The block's linear modules, in ``named_parameters()`` order."""
        return FUSED_PROJECTIONS if self.fused else PROJECTIONS

    @property
    def input_groups(self) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        """The projections reading one input: (the normed hidden states into attention, the attention output,
        the normed hidden states into the MLP, the MLP's product)."""
        if self.fused:
            return ("qkv_proj",), ("o_proj",), ("gate_up_proj",), ("down_proj",)
        return ATTENTION[:3], ("o_proj",), MLP[:2], ("down_proj",)

    def lora_targets(self, targets) -> tuple[str, ...]:
        """The block linears a LoRA ``target_modules`` list reaches on this model (as PEFT matches module names:
        the names the model has; none at all is refused by name)."""
        reached = tuple(p for p in self.projections if p in targets)
        if not reached:
            raise ValueError(f"LoRA target_modules {', '.join(targets)}: none is a module of this {self.model_type} "
                             f"model; its block linears are {', '.join(self.projections)} (or 'all-linear').")
        return reached

    # -- shapes --------------------------------------------------------------------------------------------------
    def linear_shape(self, projection: str) -> tuple[int, int]:
        """``(out_features, in_features)`` of one projection of a block."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "q_proj": (q, self.hidden), "k_proj": (kv, self.hidden), "v_proj": (kv, self.hidden),
            "o_proj": (self.hidden, q), "gate_proj": (self.intermediate, self.hidden),
            "up_proj": (self.intermediate, self.hidden), "down_proj": (self.hidden, self.intermediate),
            "qkv_proj": (q + 2 * kv, self.hidden), "gate_up_proj": (2 * self.intermediate, self.hidden),
        }[projection]

    def has_bias(self, projection: str) -> bool:
        if projection in ("q_proj", "k_proj", "v_proj", "qkv_proj"):
            return self.qkv_bias
        if projection == "o_proj":
            return self.o_bias
        return self.mlp_bias

    def tensors(self) -> list[Tensor]:
        """Every parameter tensor, in ``named_parameters()`` order (tied LM head: not listed again)."""
        out = [Tensor("model.embed_tokens.weight", self.vocab * self.hidden, "embedding")]
        norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm")[:self.norms]
        for i in range(self.layers):
            prefix = f"model.layers.{i}."
            for p in self.projections:
                group = "self_attn" if p in ATTENTION + ("qkv_proj",) else "mlp"
                o, n = self.linear_shape(p)
                out.append(Tensor(f"{prefix}{group}.{p}.weight", o * n, "linear", p, (o, n)))
                if self.has_bias(p):
                    out.append(Tensor(f"{prefix}{group}.{p}.bias", o, "bias", p))
                if self.qk_norm and p == "o_proj":  # built after the four projections
                    out.append(Tensor(f"{prefix}self_attn.q_norm.weight", self.head_dim, "norm"))
                    out.append(Tensor(f"{prefix}self_attn.k_norm.weight", self.head_dim, "norm"))
            out.extend(Tensor(f"{prefix}{n}.weight", self.hidden, "norm") for n in norms)
        out.append(Tensor("model.norm.weight", self.hidden, "norm"))
        if not self.tied:
            out.append(Tensor("lm_head.weight", self.vocab * self.hidden, "lm_head"))
        return out

    @property
    def params(self) -> int:
        return sum(t.numel for t in self.tensors())

    @property
    def linear_params(self) -> int:
        """Parameters of the block projections' weights (what bitsandbytes quantizes)."""
        return sum(t.numel for t in self.tensors() if t.role == "linear")

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        """Generation KV cache per token: K and V of every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * element_bytes

    def buffer_bytes(self) -> int:
        """The model's buffers: the rotary embedding's ``inv_freq`` and ``original_inv_freq`` (fp32, head_dim / 2
        each, per kind of layer; transformers 5) and Gemma's ``embed_scale`` (one fp32 scalar)."""
        return self.rotary_kinds * 2 * (self.head_dim // 2) * 4 + (4 if self.gemma else 0)


@dataclass(frozen=True)
class Tensor:
    """One parameter tensor: its name, element count, role (embedding / linear / bias / norm / lm_head) and, for a
    projection, which one and its ``(out, in)`` shape."""

    name: str
    numel: int
    role: str
    projection: str | None = None
    shape: tuple[int, int] | None = None


# The embedded configs: the numbers of each model's public config.json (Hugging Face Hub), nothing else.
MODELS: dict[str, Arch] = {
    # HuggingFaceTB/SmolLM2-135M(-Instruct) config.json: hidden_size 576, intermediate_size 1536,
    # num_hidden_layers 30, num_attention_heads 9, num_key_value_heads 3 (head_dim 64), vocab_size 49152,
    # tie_word_embeddings true, model_type llama (attention_bias false, mlp_bias false)
    "smollm2-135m": Arch("SmolLM2-135M", 576, 1536, 30, 9, 3, 64, 49152, True),
    # HuggingFaceTB/SmolLM2-360M: hidden_size 960, intermediate_size 2560, num_hidden_layers 32,
    # num_attention_heads 15, num_key_value_heads 5 (head_dim 64), vocab_size 49152, tie_word_embeddings true
    "smollm2-360m": Arch("SmolLM2-360M", 960, 2560, 32, 15, 5, 64, 49152, True),
    # HuggingFaceTB/SmolLM2-1.7B: hidden_size 2048, intermediate_size 8192, num_hidden_layers 24,
    # num_attention_heads 32, num_key_value_heads 32 (head_dim 64), vocab_size 49152, tie_word_embeddings true
    "smollm2-1.7b": Arch("SmolLM2-1.7B", 2048, 8192, 24, 32, 32, 64, 49152, True),
    # Qwen/Qwen2.5-0.5B(-Instruct): hidden_size 896, intermediate_size 4864, num_hidden_layers 24,
    # num_attention_heads 14, num_key_value_heads 2 (head_dim 64), vocab_size 151936, tie_word_embeddings true,
    # model_type qwen2 (bias on q/k/v)
    "qwen2.5-0.5b": Arch("Qwen2.5-0.5B", 896, 4864, 24, 14, 2, 64, 151936, True, qkv_bias=True,
                         model_type="qwen2"),
    # Qwen/Qwen2.5-1.5B: hidden_size 1536, intermediate_size 8960, num_hidden_layers 28, num_attention_heads 12,
    # num_key_value_heads 2 (head_dim 128), vocab_size 151936, tie_word_embeddings true
    "qwen2.5-1.5b": Arch("Qwen2.5-1.5B", 1536, 8960, 28, 12, 2, 128, 151936, True, qkv_bias=True,
                         model_type="qwen2"),
    # Qwen/Qwen2.5-3B: hidden_size 2048, intermediate_size 11008, num_hidden_layers 36, num_attention_heads 16,
    # num_key_value_heads 2 (head_dim 128), vocab_size 151936, tie_word_embeddings true
    "qwen2.5-3b": Arch("Qwen2.5-3B", 2048, 11008, 36, 16, 2, 128, 151936, True, qkv_bias=True, model_type="qwen2"),
    # Qwen/Qwen2.5-7B: hidden_size 3584, intermediate_size 18944, num_hidden_layers 28, num_attention_heads 28,
    # num_key_value_heads 4 (head_dim 128), vocab_size 152064, tie_word_embeddings false
    "qwen2.5-7b": Arch("Qwen2.5-7B", 3584, 18944, 28, 28, 4, 128, 152064, False, qkv_bias=True,
                       model_type="qwen2"),
    # meta-llama/Llama-3.1-8B: hidden_size 4096, intermediate_size 14336, num_hidden_layers 32,
    # num_attention_heads 32, num_key_value_heads 8 (head_dim 128), vocab_size 128256, tie_word_embeddings false,
    # attention_bias false, mlp_bias false
    "llama-3.1-8b": Arch("Llama-3.1-8B", 4096, 14336, 32, 32, 8, 128, 128256, False),
    # Qwen/Qwen3-0.6B: hidden_size 1024, intermediate_size 3072, num_hidden_layers 28, num_attention_heads 16,
    # num_key_value_heads 8, head_dim 128, vocab_size 151936, tie_word_embeddings true, attention_bias false
    "qwen3-0.6b": Arch("Qwen3-0.6B", 1024, 3072, 28, 16, 8, 128, 151936, True, model_type="qwen3", qk_norm=True),
    # Qwen/Qwen3-1.7B: hidden_size 2048, intermediate_size 6144, num_hidden_layers 28, num_attention_heads 16,
    # num_key_value_heads 8, head_dim 128, vocab_size 151936, tie_word_embeddings true
    "qwen3-1.7b": Arch("Qwen3-1.7B", 2048, 6144, 28, 16, 8, 128, 151936, True, model_type="qwen3", qk_norm=True),
    # Qwen/Qwen3-4B: hidden_size 2560, intermediate_size 9728, num_hidden_layers 36, num_attention_heads 32,
    # num_key_value_heads 8, head_dim 128, vocab_size 151936, tie_word_embeddings true
    "qwen3-4b": Arch("Qwen3-4B", 2560, 9728, 36, 32, 8, 128, 151936, True, model_type="qwen3", qk_norm=True),
    # Qwen/Qwen3-8B: hidden_size 4096, intermediate_size 12288, num_hidden_layers 36, num_attention_heads 32,
    # num_key_value_heads 8, head_dim 128, vocab_size 151936, tie_word_embeddings false
    "qwen3-8b": Arch("Qwen3-8B", 4096, 12288, 36, 32, 8, 128, 151936, False, model_type="qwen3", qk_norm=True),
    # microsoft/Phi-3-mini-4k-instruct: hidden_size 3072, intermediate_size 8192, num_hidden_layers 32,
    # num_attention_heads 32, num_key_value_heads 32, vocab_size 32064, tie_word_embeddings false (fused qkv_proj,
    # gate_up_proj; head_dim = hidden / heads = 96)
    "phi-3-mini-4k": Arch("Phi-3-mini-4k", 3072, 8192, 32, 32, 32, 96, 32064, False, model_type="phi3", fused=True),
    # google/gemma-2-2b: hidden_size 2304, intermediate_size 9216, num_hidden_layers 26, num_attention_heads 8,
    # num_key_value_heads 4, head_dim 256, vocab_size 256000, tie_word_embeddings true
    "gemma-2-2b": Arch("gemma-2-2b", 2304, 9216, 26, 8, 4, 256, 256000, True, model_type="gemma2", gemma=True,
                       norms=4),
    # google/gemma-3-1b-it: hidden_size 1152, intermediate_size 6912, num_hidden_layers 26, num_attention_heads 4,
    # num_key_value_heads 1, head_dim 256, vocab_size 262144, tie_word_embeddings true (model_type gemma3_text)
    "gemma-3-1b": Arch("gemma-3-1b", 1152, 6912, 26, 4, 1, 256, 262144, True, model_type="gemma3_text", gemma=True,
                       norms=4, qk_norm=True, rotary_kinds=2),
}

# transformers' defaults where a config.json leaves a field out
_TIED_DEFAULT = {"llama": False, "qwen2": False, "mistral": False, "qwen3": False, "phi3": False}
_HEAD_DIM_DEFAULT = {"qwen3": 128, "gemma": 256, "gemma2": 256, "gemma3_text": 256}  # the config classes' defaults
_QKV_BIAS = {"qwen2"}  # Qwen2 attention always has q/k/v biases (no config field)
# What each known type's modelling holds beyond the Llama layout (the Arch fields it sets)
_TYPE_FIELDS = {
    "llama": {}, "mistral": {}, "qwen2": {},
    "qwen3": {"qk_norm": True},
    "phi3": {"fused": True},
    "gemma": {"gemma": True},
    "gemma2": {"gemma": True, "norms": 4},
    "gemma3_text": {"gemma": True, "norms": 4, "qk_norm": True, "rotary_kinds": 2},
}
# The model types whose modelling the plan follows tensor by tensor; anything else is refused by name rather than
# planned as if it were one of them.
KNOWN_TYPES = tuple(_TYPE_FIELDS)
# config.json fields that make a model a mixture of experts (router + experts per block): not the dense layout above
MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size",
              "shared_expert_intermediate_size", "n_shared_experts", "num_experts_per_tok")
_LIMIT = 2**24  # no dimension of a real model is near this; a larger one is a typo (and overflows the byte counts)
# The plan lists every layer's tensors: a layer count far above any real decoder's (Llama-3.1-405B has 126) is a typo,
# refused by name instead of listed for minutes.
LAYER_LIMIT = 1024


def model_key(name: str) -> str:
    """``"Qwen/Qwen2.5-7B-Instruct"`` -> ``"qwen2.5-7b"``: the organisation, ``-Instruct`` and case dropped."""
    key = name.strip().lower().rsplit("/", 1)[-1]
    for suffix in ("-instruct", "-it", "-chat"):
        key = key.removesuffix(suffix)
    return key


def _count(get, key: str, default=None, limit: int = _LIMIT) -> int:
    value = get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < limit:
        raise ValueError(f"model config: {key} must be an integer from 1 to {limit - 1}, got {value!r}.")
    return value


def _language_model(config, get):
    """A multimodal config's ``text_config`` (one level: a ``text_config`` inside it is refused by name), or None."""
    text = get("text_config")
    if text is None:
        return None
    if not isinstance(text, dict) and not hasattr(text, "to_dict"):
        raise ValueError(f"model config: text_config must be a JSON object, got {type(text).__name__}.")
    inner = text.get("text_config") if isinstance(text, dict) else getattr(text, "text_config", None)
    if inner is not None:
        raise ValueError("model config: text_config holds another text_config; give the language model's own "
                         "config.json.")
    return text


def moe_fields(config) -> dict:
    """The mixture-of-experts fields a config sets (a positive number of experts / an expert width), by name."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    text = _language_model(config, get)
    if text is not None:
        return moe_fields(text)
    return {k: get(k) for k in MOE_FIELDS if isinstance(get(k), int) and not isinstance(get(k), bool) and get(k) > 0}


def arch_from_config(config, name: str | None = None) -> Arch:
    """An :class:`Arch` from a ``config.json`` dict or a ``transformers.PretrainedConfig``: a dense decoder of a
    type in :data:`KNOWN_TYPES`; a mixture of experts or another type is refused by name (a ``ValueError``)."""
    if not isinstance(config, dict) and not hasattr(config, "to_dict"):
        raise ValueError(f"model config must be a JSON object (a config.json), got {type(config).__name__}.")
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    text = _language_model(config, get)  # a multimodal config: its language model
    if text is not None:
        return arch_from_config(text, name)
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                           "vocab_size") if get(k) is None]
    if not get("model_type"):
        raise ValueError(f"model config lacks model_type: the plan counts the tensors of known types only "
                         f"({', '.join(KNOWN_TYPES)}) and does not guess one.")
    model_type = str(get("model_type"))
    experts = moe_fields(config)
    if experts:
        fields = ", ".join(f"{k}={v}" for k, v in experts.items())
        raise ValueError(f"model_type {model_type!r} is a mixture of experts ({fields}): the plan counts dense "
                         f"decoders only ({', '.join(KNOWN_TYPES)}), and planning its experts as one dense MLP "
                         "would under-count them many times over.")
    if model_type not in KNOWN_TYPES:
        raise ValueError(f"model_type {model_type!r} is not one the plan knows (its tensors, biases and norms are "
                         f"not counted here); known: {', '.join(KNOWN_TYPES)}.")
    if missing:
        raise ValueError(f"model config lacks {', '.join(missing)}: not a decoder-only LM config the plan knows.")
    hidden, heads = _count(get, "hidden_size"), _count(get, "num_attention_heads")
    kv_heads = _count(get, "num_key_value_heads", heads) if get("num_key_value_heads") is not None else heads
    if heads % kv_heads:
        raise ValueError(f"model config: num_attention_heads ({heads}) must be a multiple of num_key_value_heads "
                         f"({kv_heads}).")
    if get("head_dim") is not None and model_type != "phi3":  # Phi-3 reads no head_dim: hidden / heads
        head_dim = _count(get, "head_dim")
    elif model_type in _HEAD_DIM_DEFAULT:
        head_dim = _HEAD_DIM_DEFAULT[model_type]
    elif hidden % heads:
        raise ValueError(f"model config: hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads}); "
                         "give head_dim.")
    else:
        head_dim = hidden // heads
    attention_bias = get("attention_bias", False) if model_type != "phi3" else False  # Phi-3: no biases
    rope = get("rope_parameters") or get("rope_scaling") or {}
    partial = get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0) if isinstance(rope, dict) else 1.0)
    if partial not in (None, 1, 1.0):
        raise ValueError(f"model config: partial_rotary_factor={partial!r} (rotary on part of each head, as "
                         f"Phi-4-mini): the plan counts full-width rotary only; known: {', '.join(KNOWN_TYPES)} "
                         "with partial_rotary_factor 1.")
    fields = dict(_TYPE_FIELDS[model_type])
    if model_type == "gemma3_text":  # a rotary table per kind of layer the model has (sliding, full attention)
        layers = _count(get, "num_hidden_layers", limit=LAYER_LIMIT + 1)
        pattern = get("sliding_window_pattern", 6)
        kinds = get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                       for i in range(layers)]
        fields["rotary_kinds"] = len(set(kinds))
    tied = get("tie_word_embeddings")
    if tied is None:
        tied = _TIED_DEFAULT.get(model_type, True)
    for key, value in (("attention_bias", attention_bias), ("mlp_bias", get("mlp_bias", False)),
                       ("tie_word_embeddings", tied)):
        if not isinstance(value, bool):
            raise ValueError(f"model config: {key} must be true or false, got {value!r}.")
    return Arch(
        name=name or str(get("_name_or_path") or model_type),
        hidden=hidden, intermediate=_count(get, "intermediate_size"), layers=_count(get, "num_hidden_layers", limit=LAYER_LIMIT + 1),
        heads=heads, kv_heads=kv_heads, head_dim=head_dim, vocab=_count(get, "vocab_size"),
        tied=tied, qkv_bias=attention_bias or model_type in _QKV_BIAS, o_bias=attention_bias,
        mlp_bias=bool(get("mlp_bias", False)) and model_type != "phi3", model_type=model_type,
        **fields,
    )


def resolve_model(model) -> Arch:
    """An :class:`Arch` from a name in :data:`MODELS`, a ``config.json`` path, a folder holding one, a config dict,
    a ``PretrainedConfig`` or an :class:`Arch`; a ``ValueError`` naming the known names otherwise."""
    if isinstance(model, Arch):
        return model
    if isinstance(model, dict) or hasattr(model, "to_dict"):
        return arch_from_config(model)
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model must be a name, a config.json path, a folder or a PretrainedConfig, got "
                         f"{type(model).__name__}.")
    path = os.fspath(model)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"model folder {os.fspath(model)!r} has no config.json.")
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path!r} is not a readable config.json: {err}") from None
        # a folder's config.json: the folder's name; another file: its own name (qwen3-8b.json -> qwen3-8b)
        stem = os.path.basename(path)
        name = os.path.basename(os.path.dirname(os.path.abspath(path))) if stem == "config.json" else \
            stem.removesuffix(".json")
        return arch_from_config(config, name=name)
    key = model_key(path)
    if key in MODELS:
        return MODELS[key]
    hint = ""
    if path.count("/") == 1 and not path.startswith((".", "/")) and not path.endswith(".json"):
        hint = (f"; the plan reads no Hub: download its config.json (`hf download {path} config.json --local-dir "
                f"./{path.rsplit('/', 1)[-1]}`) and pass that folder or file")
    raise ValueError(f"unknown model {os.fspath(model)!r}: not a config.json or a folder holding one, nor a known "
                     f"name ({', '.join(MODELS)}){hint}.")


def with_layers(arch: Arch, layers: int) -> Arch:
    """The same architecture with another number of blocks (e.g. a shallow stand-in measured on CPU)."""
    return replace(arch, layers=layers, name=f"{arch.name} ({layers} layers)")

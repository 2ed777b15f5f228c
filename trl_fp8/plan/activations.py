"""The tensors a loss forward saves for backward, counted per block of a Llama / Qwen2 decoder, as transformers 5 and
TRL 1.16 run it (sdpa attention, autocast, TRL's fused chunked LM head, PEFT LoRA, bitsandbytes 4-bit).

What each op saves (checked on CPU with ``torch.autograd.graph.saved_tensors_hooks``, tests/plan/test_activations.py):

- RMSNorm (``x.to(float32)``, ``x * rsqrt(mean(x²) + eps)``, ``weight * h.to(input_dtype)``): the fp32 input (4 B × H
  per token: a copy, or the residual itself when it is fp32), the rsqrt (4 B per token) and, when the norm's weight
  trains, the normalized value in the residual dtype;
- a linear under autocast saves its input cast to the compute dtype when its weight trains (one copy per projection
  when the residual dtype differs from the compute dtype, else the shared input), and its weight cast (a copy when
  the weight is fp32: cached by autocast for trainable weights, made per op for frozen ones; none for a 4-bit base,
  which bitsandbytes dequantizes again in backward);
- a LoRA layer: the input of ``lora_A`` (PEFT casts it to the factors' dtype, autocast to the compute dtype: a copy
  per layer unless input, factors and compute share one dtype — bf16 factors under fp16 autocast do not) and
  ``lora_A``'s output (r per token) for ``lora_B``; with ``lora_dropout`` > 0 also the dropout's scaled Bernoulli
  noise (in the factors' dtype) and ``lora_A``'s own input, per layer;
- attention (sdpa with a padding mask: no GQA fast path, K and V repeated to every head): q, k, v, the output (4 ×
  heads × head_dim per token, compute dtype), the log-sum-exp (fp32 per head) and the mask in the compute dtype
  (seq per token); rotary ``cos``/``sin`` once per forward;
- SwiGLU: the gate output (for SiLU), SiLU's output and the up output (for the product), and the product (for
  ``down_proj``, when it trains or carries LoRA): intermediate per token each;
- TRL's fused LM head (``add_fused_lm_head``): the final hidden states of the scored positions (a copy: the valid
  completion positions on CUDA, ``hidden[:, :-1]`` on CPU), the targets (int64), ``log_z`` and entropy (fp32), the
  label mask; never the ``[tokens, vocab]`` logits (those are tiles: see :func:`logits_rows`).

With gradient checkpointing (transformers' non-reentrant ``GradientCheckpointingLayer``) a block saves its input
hidden states only; backward recomputes one block at a time (that block's set above is alive then).
"""

from __future__ import annotations

from dataclasses import dataclass

from .models import Arch
from .spec import FP32, PlanSpec

INT64, BOOL = 8, 1
# TRL 1.16 kernels/chunked_logprob.py: tokens per projection tile and the vocabulary width trainer/utils.py passes
TOKEN_CHUNK = 4096
VOCAB_CHUNK = 32768


@dataclass(frozen=True)
class Shape:
    """One loss forward: ``rows`` sequences of ``seq`` tokens, ``scored`` of them scored by the LM head
    (completion positions; with ``compact_head=False``, every position but the last, as TRL does off CUDA)."""

    arch: Arch
    rows: int
    seq: int
    scored: int
    residual_bytes: int  # the hidden states' dtype: the embeddings' (fp32 for a full fp32 model)
    compute_bytes: int  # autocast's dtype (= residual_bytes without autocast)
    full: bool  # every parameter trains
    lora_r: int = 0
    lora_targets: tuple[str, ...] = ()
    adapter_bytes: int = FP32
    base_weight_bytes: float = FP32  # 0.5: a bitsandbytes 4-bit base (nothing saved for its weights)
    compact_head: bool = True  # CUDA (Triton): the head scores the valid positions only
    lora_dropout: bool = False  # PEFT's lora_dropout > 0: a noise tensor and lora_A's own input per LoRA layer
    # False: the factors' dtype is not the compute dtype although both are 16-bit (TRL's bf16 QLoRA factors under
    # fp16 autocast): a copy of each input and of each factor per op, as for fp32 factors
    adapter_is_compute: bool = True

    @property
    def tokens(self) -> int:
        return self.rows * self.seq


def _linear_input_saves(s: Shape, group: tuple[str, ...], width: int, dtype: int) -> tuple[int, int]:
    """(bytes per token saved for the inputs of the projections in ``group``, all sharing one input of ``width``
    elements in ``dtype`` bytes): (base linears' saves, LoRA inputs' saves)."""
    cb, ad = s.compute_bytes, s.adapter_bytes
    base, lora = 0, 0
    shared = False  # the shared input itself is saved (counted once)
    for p in group:
        if s.full:
            if dtype == cb:
                shared = True
            else:
                base += width * cb
        if p in s.lora_targets:
            if s.lora_dropout:  # dropout (on CPU and CUDA alike: input × scaled Bernoulli noise) saves the noise, in
                # the dtype PEFT cast the input to (the factors'); lora_A saves its output cast to the compute dtype
                lora += width * ad + width * cb
            elif dtype == ad == cb and s.adapter_is_compute:
                shared = True
            else:
                lora += width * cb
    return base + (width * dtype if shared else 0), lora


def block_saved_per_token(s: Shape) -> dict[str, float]:
    """Bytes per token one block saves for backward (no checkpointing), by part."""
    a = s.arch
    h, inter, heads = a.hidden, a.intermediate, a.heads
    q_width = heads * a.head_dim
    rb, cb = s.residual_bytes, s.compute_bytes
    norm = 4 * h + 4 + (h * (FP32 if a.gemma else rb) if s.full else 0)  # Gemma: normalized in fp32
    attn_group, o_group, mlp_group, down_group = a.input_groups
    attn_in = _linear_input_saves(s, attn_group, h, rb)
    o_in = _linear_input_saves(s, o_group, q_width, cb)
    mlp_in = _linear_input_saves(s, mlp_group, h, rb)
    down_in = _linear_input_saves(s, down_group, inter, cb)
    # the attention output (o_proj's input) is saved by sdpa already: o_proj's own save of it is the same storage —
    # except after a fused qkv_proj: q is a strided slice, rotary makes it contiguous per head, sdpa's output comes
    # out head-major and `transpose(1, 2).contiguous()` copies it, so o_proj saves a storage of its own
    if not a.fused:
        o_in = (0, o_in[1])
    lora_out = s.lora_r * cb * len([p for p in a.projections if p in s.lora_targets])
    out = {
        "norms": a.norms * norm,
        "projection inputs": attn_in[0] + o_in[0] + mlp_in[0],
        "LoRA inputs": attn_in[1] + o_in[1] + mlp_in[1] + down_in[1],
        "LoRA A outputs": lora_out,
        "attention (q, k, v, out, lse, mask)": 4 * q_width * cb + heads * FP32 + s.seq * cb,
        "MLP (gate, SiLU, up, product)": 3 * inter * cb + down_in[0],
    }
    if a.qk_norm:  # q and k normalized per head: the fp32 input, the rsqrt per head, the normalized value (trained:
        # in q's dtype, Gemma's in fp32)
        kv_width = a.kv_heads * a.head_dim
        out["q/k norms"] = 4 * (q_width + kv_width) + 4 * (heads + a.kv_heads) + \
            ((q_width + kv_width) * (FP32 if a.gemma else cb) if s.full else 0)
    return out


def block_norm_scales(s: Shape) -> int:
    """Gemma's norms multiply by ``1 + weight`` computed in fp32 each forward, and that vector is saved (per norm, not
    per token): hidden × 4 B a norm, head_dim × 4 B a q/k norm. 0 for other types."""
    a = s.arch
    if not a.gemma:
        return 0
    return FP32 * (a.norms * a.hidden + (2 * a.head_dim if a.qk_norm else 0))


def block_weight_casts(s: Shape) -> int:
    """Bytes one block saves (or, checkpointed, autocast caches until the forward ends) for its weights: compute-dtype
    copies of fp32 weights (trainable base linears, frozen fp32 base linears, fp32 LoRA factors)."""
    a, cb = s.arch, s.compute_bytes
    if cb >= FP32:
        return 0
    linear = sum(o * n for o, n in (a.linear_shape(p) for p in a.projections))
    out = 0
    if s.base_weight_bytes == FP32:  # a 16-bit base is its own compute-dtype copy; a 4-bit one is dequantized again
        out += cb * linear
    if (s.adapter_bytes == FP32 or not s.adapter_is_compute) and s.lora_targets:
        out += cb * s.lora_r * sum(sum(a.linear_shape(p)) for p in s.lora_targets)
    return out


def head_saved(s: Shape) -> dict[str, int]:
    """Bytes saved outside the blocks: the final norm, the fused LM head's inputs and the embedding's indices."""
    a, rb = s.arch, s.residual_bytes
    t = s.tokens
    scored = s.scored if s.compact_head else s.rows * (s.seq - 1)
    out = {
        "final norm": t * (4 * a.hidden + 4 + (a.hidden * (FP32 if a.gemma else rb) if s.full else 0)) +
        (FP32 * a.hidden if a.gemma else 0),
        "LM head inputs (hidden of scored positions, targets, log_z, entropy, masks)":
            scored * (a.hidden * rb + INT64 + 2 * FP32) + 2 * BOOL * s.rows * (s.seq - 1) + INT64,
        "rotary cos/sin": 2 * s.seq * a.head_dim * rb,
    }
    if s.full:
        out["embedding indices"] = t * INT64
        if a.gemma:  # the embedding's output times sqrt(hidden): the scalar, in the weights' dtype
            out["embedding scale"] = rb
    return out


def saved_bytes(s: Shape, checkpointing: bool) -> dict[str, int]:
    """Bytes saved for backward by one loss forward, by part (what ``saved_tensors_hooks`` sees, parameters left
    out). Checkpointed, each block saves its input (``tokens × hidden`` in the residual dtype)."""
    a = s.arch
    out = dict(head_saved(s))
    if checkpointing:
        out["block inputs (checkpoints)"] = a.layers * s.tokens * a.hidden * s.residual_bytes
        # cos/sin reach the blocks as keyword arguments, which the checkpoint holds without saving them
        out.pop("rotary cos/sin")
    else:
        per_token = sum(block_saved_per_token(s).values())
        out["blocks (activations)"] = int(a.layers * s.tokens * per_token) + a.layers * block_norm_scales(s)
        out["weight casts"] = a.layers * block_weight_casts(s)
        if not s.full:
            out["blocks (activations)"] -= _first_block_untracked(s)
    return out


def _first_block_untracked(s: Shape) -> int:
    """A frozen embedding's output needs no gradient, so (without checkpointing, where PEFT's
    ``enable_input_require_grads`` is not set) the first block saves nothing for its first norm, and its q/k/v
    layers need no weight for an input gradient: their weight casts are not saved."""
    a, cb = s.arch, s.compute_bytes
    out = s.tokens * (4 * a.hidden + 4) + (FP32 * a.hidden if a.gemma else 0)
    if cb < FP32:
        if s.base_weight_bytes == FP32:
            out += cb * sum(o * n for o, n in (a.linear_shape(p) for p in a.input_groups[0]))
        if s.adapter_bytes == FP32 or not s.adapter_is_compute:
            out += cb * s.lora_r * a.hidden * len([p for p in a.input_groups[0] if p in s.lora_targets])
    if s.lora_dropout:  # dropout on an input that needs no gradient saves no noise
        out += s.tokens * a.hidden * s.adapter_bytes * len([p for p in a.input_groups[0] if p in s.lora_targets])
    return out


def recompute_bytes(s: Shape) -> int:
    """Checkpointed backward: one block's activations and weight casts, recomputed, plus the fp32 gradient of the
    block's output flowing back (``tokens × hidden × 4``)."""
    return int(s.tokens * sum(block_saved_per_token(s).values())) + block_norm_scales(s) + block_weight_casts(s) + \
        s.tokens * s.arch.hidden * FP32


def shape_of(spec: PlanSpec, compact_head: bool = True) -> Shape:
    """The loss forward of a plan: one micro-batch at the rollout's full length."""
    lora = spec.lora
    return Shape(
        arch=spec.arch, rows=spec.rollout.micro_batch, seq=spec.rollout.seq, scored=spec.completion_tokens,
        residual_bytes=spec.base_bytes, compute_bytes=spec.compute_bytes, full=spec.full,
        lora_r=lora.r if lora else 0, lora_targets=lora.targets if lora else (),
        adapter_bytes=spec.adapter_bytes, base_weight_bytes=0.5 if spec.quant is not None else spec.base_bytes,
        compact_head=compact_head, lora_dropout=bool(lora and lora.dropout),
        # TRL's QLoRA factors are bf16: under fp16 autocast (a T4) they are not the compute dtype
        adapter_is_compute=not (spec.adapter_bytes == 2 and spec.compute_bytes == 2 and
                                spec.extra.get("precision") == "fp16"),
    )

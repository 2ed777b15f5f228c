"""The model's and TRL's trainer's own rows of a memory plan: weights, optimizer state, gradients, saved activations,
autocast's copies and the LM head's logits (the capabilities state their own rows; the sampler's and the vLLM
engine's rows are in :mod:`trl_fp8.plan.plan`). Arithmetic on a :class:`~trl_fp8.plan.spec.PlanSpec`, no torch."""

from __future__ import annotations

from ..memory import PERSISTENT, TRAINING, Row, count_text, per
from .activations import TOKEN_CHUNK, VOCAB_CHUNK, recompute_bytes, saved_bytes, shape_of
from .spec import FP32, HALF, PlanSpec

# Within the training phase, when a row is alive (``Row.note``): "forward" (freed before backward starts), "backward"
# (made in backward), or both (no note). The phase's peak is the larger of the two sums (:func:`training_peak`).
FORWARD, BACKWARD = "forward", "backward"


def accumulation_steps(spec: PlanSpec) -> int:
    return max(1, int(getattr(spec.args, "gradient_accumulation_steps", 1) or 1))


def training_peak(rows: list[Row]) -> dict[str, int]:
    """The training phase's rows as two moments: the end of a forward (what it saved, autocast's weight copies, a
    logits tile; gradients only when they persist across micro-batches) and backward (the saved activations draining
    while the gradients fill: their sum bounds it from above; autocast's copies are gone). ``peak``: the larger."""
    forward = sum(r.bytes for r in rows if r.phase == TRAINING and r.note != BACKWARD)
    backward = sum(r.bytes for r in rows if r.phase == TRAINING and r.note != FORWARD)
    return {"forward": forward, "backward": backward, "peak": max(forward, backward)}


def _optimizer_rows(spec: PlanSpec) -> list[Row]:
    tensors = spec.trainable_tensors()
    n = sum(t.numel for t in tensors)
    if spec.optimizer == "adamw":
        tb = spec.trainable_bytes
        return [Row("AdamW state (exp_avg, exp_avg_sq, step)", 2 * tb * n + FP32 * len(tensors),
                    per(2 * tb, "trainable params", n) + f" + 4 B step × {len(tensors)} tensors", PERSISTENT,
                    "trainer", "optimizer")]
    big = [t.numel for t in tensors if t.numel >= 4096]  # bitsandbytes min_8bit_size
    small = n - sum(big)
    nbytes = sum(2 * m + 2 * FP32 * -(-m // 256) for m in big) + 2 * FP32 * small + (2 * 256 * FP32 if big else 0)
    return [Row("8-bit AdamW state (bitsandbytes, blockwise)", nbytes,
                f"2 B + 8 B/256 × trainable params ({count_text(n)}; tensors < 4096: 8 B)", PERSISTENT,
                "trainer", "optimizer")]


def _model_rows(spec: PlanSpec) -> list[Row]:
    a = spec.arch
    rows = []
    dtype = {4: "fp32", 2: "16-bit"}[spec.base_bytes]
    if spec.quant is None:
        rows.append(Row(f"base weights ({dtype})", spec.base_bytes * spec.base_params,
                        per(spec.base_bytes, "base params", spec.base_params), PERSISTENT, "model", "base"))
    else:
        q = [t for t in spec.base_tensors() if t.role == "linear"]
        qn = sum(t.numel for t in q)
        rows.append(Row(f"base weights, 4-bit ({spec.quant.label})", sum(spec.quant.weight_bytes(t.numel) for t in q),
                        f"1/2 B + absmax × linear params ({count_text(qn)})", PERSISTENT, "model", "base"))
        rest = spec.base_params - qn
        rows.append(Row(f"base weights kept {dtype} (embeddings, norms, biases, LM head)", spec.base_bytes * rest,
                        per(spec.base_bytes, "other base params", rest), PERSISTENT, "model", "base"))
    rows.append(Row("model buffers (rotary inv_freq)", a.buffer_bytes(), "4 B × head_dim (fp32)", PERSISTENT, "model",
                    "buffers"))
    if spec.lora is not None:
        rows.append(Row(f"LoRA adapters ({'fp32' if spec.adapter_bytes == FP32 else '16-bit'})",
                        spec.adapter_bytes * spec.adapter_params,
                        per(spec.adapter_bytes, "adapter params", spec.adapter_params), PERSISTENT, "model",
                        "adapters"))
    if float(getattr(spec.args, "beta", 0.0) or 0.0) > 0 and spec.full:
        rows.append(Row("reference model (beta > 0)", spec.base_bytes * spec.base_params + a.buffer_bytes(),
                        per(spec.base_bytes, "base params", spec.base_params), PERSISTENT, "trainer",
                        "reference_model"))
    rows += _optimizer_rows(spec)
    tb, n = spec.trainable_bytes, spec.trainable_params
    steps = accumulation_steps(spec)
    # TRL zeroes gradients to None after each optimizer step: with one micro-batch a step they exist only in backward;
    # accumulated over several, they are alive through the next micro-batches' forwards too
    rows.append(Row("gradients" + (f" (accumulated over {steps} micro-batches)" if steps > 1 else ""), tb * n,
                    per(tb, "trainable params", n), TRAINING, "trainer", "gradients",
                    note="" if steps > 1 else BACKWARD))
    return rows


def _activation_rows(spec: PlanSpec) -> list[Row]:
    shape = shape_of(spec)
    rows = []
    saved = sum(saved_bytes(shape, spec.gradient_checkpointing).values())
    tokens = f"{spec.rollout.micro_batch} × {spec.rollout.seq} tokens"
    if spec.gradient_checkpointing:
        rows.append(Row("activations: block inputs saved (gradient checkpointing) + LM head inputs", saved,
                        f"{spec.base_bytes} B × hidden × layers per token ({tokens})", TRAINING, "trainer"))
        rows.append(Row("activations: one block recomputed in backward", recompute_bytes(shape),
                        f"one block's saved tensors + fp32 output gradient ({tokens})", TRAINING, "trainer",
                        note=BACKWARD))
        cached = _autocast_cache(spec)
        if cached:
            rows.append(Row("autocast's 16-bit copies of fp32 trained weights (until the forward ends)", cached,
                            per(spec.compute_bytes, "trained linear params", cached // spec.compute_bytes),
                            TRAINING, "trainer", note=FORWARD))
    else:
        rows.append(Row("activations saved for backward (no gradient checkpointing)", saved,
                        f"every block's saved tensors ({tokens})", TRAINING, "trainer"))
    if spec.quant is not None:
        largest = spec.largest_linear()
        rows.append(Row("4-bit dequantization scratch (one projection)", HALF * largest,
                        per(HALF, "params of the largest projection", largest), TRAINING, "trainer"))
    return rows


def _autocast_cache(spec: PlanSpec) -> int:
    """Checkpointed forward under autocast: the compute-dtype casts of trained fp32 leaf weights stay in autocast's
    cache until the forward's autocast ends (not saved; freed before backward)."""
    if spec.compute_bytes >= FP32:
        return 0
    if spec.full and spec.base_bytes == FP32:
        return spec.compute_bytes * sum(t.numel for t in spec.base_tensors() if t.role in ("linear", "bias"))
    if spec.lora is not None and spec.adapter_bytes == FP32:
        return spec.compute_bytes * spec.adapter_params
    return 0


def _logits_rows(spec: PlanSpec) -> list[Row]:
    a = spec.arch
    n = spec.completion_tokens
    cb = spec.compute_bytes
    if not spec.chunked_logits:
        return [Row("completion logits, not chunked (logits, fp32 log-softmax and its gradient)", n * a.vocab *
                    (cb + 2 * FP32), per(cb + 2 * FP32, "completion tokens × vocab", n * a.vocab), TRAINING,
                    "trainer")]
    tile = min(n, TOKEN_CHUNK) * min(a.vocab, VOCAB_CHUNK)
    rows = [Row("completion logits: one tile (TRL 1.16's chunked LM head)", cb * tile,
                per(cb, f"min(tokens, {TOKEN_CHUNK}) × min(vocab, {VOCAB_CHUNK})", tile), TRAINING, "trainer")]
    head_bytes = spec.base_bytes
    extra = 0 if head_bytes == cb else cb * min(a.vocab, VOCAB_CHUNK) * a.hidden  # weight[start:end].to(compute)
    grad = FP32 * n * a.hidden + (0 if spec.base_bytes == FP32 else spec.base_bytes * n * a.hidden)
    what = "fp32 gradient of the scored hidden states"
    if spec.full:  # the head (or the tied embedding) trains: an fp32 accumulator of its gradient
        grad += FP32 * a.vocab * a.hidden + (0 if spec.base_bytes == FP32 else spec.base_bytes * a.vocab * a.hidden)
        what += " and of the LM head weight"
    rows.append(Row(f"LM head backward: {what}", grad + extra,
                    f"4 B × completion tokens × hidden ({count_text(n * a.hidden)})"
                    + (f" + 4 B × vocab × hidden ({count_text(a.vocab * a.hidden)})" if spec.full else ""),
                    TRAINING, "trainer", note=BACKWARD))
    return rows

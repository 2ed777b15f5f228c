"""What fast QLoRA allocates, per parameter of what: its rows of the memory plan (``trl-fp8 plan``).

A pure function of the plan's :class:`~trl_fp8.plan.spec.PlanSpec` (no torch, no TRL):

- kept layers (``qlora_keep_budget_gb``): dense copies, in the layers' 16-bit dtype, of the 4-bit layers with the
  highest estimated NF4 error, chosen greedily within the budget (which layers depends on the weights: the plan
  counts the budget, or every layer if that is less); the 4-bit modules stay aside to be put back after training;
- the rollout cache (in-process generation, when no twin generates): one dense ``dequant(W) + ΔW`` per LoRA layer in
  the cache dtype, for the duration of each generation call, within ``qlora_rollout_cache_gb`` or, by default, the
  free memory less a margin (a quarter of it, at least 2 GiB), at most 8 GiB: it takes what is free and cannot make
  a run not fit;
- with vLLM (and Fair Cast off): the dense stream ``dequant(W) + ΔW`` one layer at a time in the engine's dtype.
"""

from __future__ import annotations

from ..memory import GENERATION, GIB, PERSISTENT, Row, bytes_text, per

CACHE_CAP_BYTES = 8 * GIB  # the automatic rollout-cache budget never exceeds this
CACHE_MARGIN_FRACTION = 0.25  # ... and leaves this fraction of the free memory (at least CACHE_MARGIN_BYTES) free
CACHE_MARGIN_BYTES = 2 * GIB
HALF = 2


def automatic_cache_bytes(free: int) -> int:
    """The automatic rollout-cache budget for ``free`` bytes: the free memory minus a margin (a quarter of it, at
    least 2 GiB), at most :data:`CACHE_CAP_BYTES` (the trainer's rule, ``FastQLoRA.cache_budget_bytes``, and the
    memory plan's)."""
    margin = max(CACHE_MARGIN_BYTES, int(free * CACHE_MARGIN_FRACTION))
    return max(0, min(CACHE_CAP_BYTES, free - margin))


def _dense_bytes(spec) -> int:
    """Every LoRA layer's base as a dense weight (and bias) in the dtype the model was loaded in: bitsandbytes
    dequantizes to the dtype it quantized from (16-bit as usual; 4 B for an fp32-loaded 4-bit model)."""
    targets = spec.lora.targets
    return sum(spec.base_bytes * t.numel for t in spec.base_tensors()
               if t.role in ("linear", "bias") and t.projection in targets)


def memory_rows(spec) -> list[Row]:
    if spec.quant is None or spec.lora is None:
        return []  # fast QLoRA steps aside: no 4-bit LoRA layers
    args = spec.args
    rows = []
    dense = _dense_bytes(spec)
    keep = int(float(getattr(args, "qlora_keep_budget_gb", 0.25)) * GIB)
    if keep > 0:
        rows.append(Row("fast QLoRA dense copies of kept layers", min(keep, dense),
                        f"{spec.base_bytes} B × base params of the kept layers (at most the {bytes_text(keep)} budget)", PERSISTENT,
                        "fast_qlora", "fast_qlora/dense_copies", exact=False))
    from .. import sampling

    decision = spec.decision  # the trainer's own sampling decision for this run
    if spec.use_vllm:
        if decision.owner == "fast_qlora" and decision.kind == sampling.DENSE_STREAM:
            largest = max(t.numel for t in spec.base_tensors() if t.role == "linear")
            rows.append(Row("fast QLoRA dense stream to vLLM (one layer at a time)", HALF * largest,
                            per(HALF, "params of the largest projection", largest), GENERATION, "fast_qlora"))
        return rows
    if decision.kind != sampling.ROLLOUT_CACHE:
        return rows  # another kind was decided (e.g. Fair Cast's twin generates): no rollout cache
    budget = getattr(args, "qlora_rollout_cache_gb", None)
    ask = min(dense, CACHE_CAP_BYTES)
    if budget is not None:
        cache, elastic = min(dense, int(float(budget) * GIB)), False
        how = f"qlora_rollout_cache_gb={budget}"
    elif "free_bytes" in spec.extra:  # the plan's second pass: what is free while rollouts are generated
        cache, elastic = min(ask, automatic_cache_bytes(spec.extra["free_bytes"])), True
        how = "free memory less max(2 GiB, 25 %), at most 8 GiB"
    else:
        cache, elastic = ask, True
        how = "at most 8 GiB"
    rows.append(Row("fast QLoRA rollout cache (dense dequant(W) + ΔW)", cache,
                    f"2 B × base params of the LoRA layers that fit ({how})", GENERATION, "fast_qlora",
                    exact=not elastic, elastic=elastic))
    return rows

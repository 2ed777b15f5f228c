"""What Fair Cast allocates, per parameter of what: the rows of the memory plan (``trl-fp8 plan``).

A pure function of the plan's :class:`~trl_fp8.plan.spec.PlanSpec` (no torch, no TRL), read by the plan through
:meth:`trl_fp8.capability.Capability.memory_rows`. Categories are those :meth:`FairCast.held_tensors` reports, so
:func:`trl_fp8.plan.measure` checks each row against the live trainer's tensors:

- full fine-tuning: the fp32 master (``ParamUnit.master``: 4 B/param), the served buffer (``served_dtype``: 2 B/param),
  with ``error_feedback`` the fp32 residual (4 B/param), and the in-process twin (a deep copy of the policy in the
  served dtype: 2 B/param, plus its buffers; none with vLLM, where the engine holds its own copy);
- LoRA / QLoRA with ``lora_serving="adapters"``: per adapter parameter the fp32 master (4 B) and the served buffer
  (2 B), + the residual (4 B) with error feedback. No twin, no copy of the base;
- LoRA with ``lora_serving="merged"``: per base parameter of a LoRA layer, over a 16-bit/fp32 base the fp32 base kept
  aside (4 B); per other parameter (embeddings, norms, the head) its fp32 master (4 B);
  the merged twin (2 B) and the served buffer (2 B) (+ 4 B residual); over a 4-bit base the dense twin (2 B) and the
  served buffer (2 B) (+ 4 B residual);
- always: the fixed metric sample (``METRIC_ELEMENTS`` elements of the trained tensors: int64 indices on the device and
  three fp32 samples: the previous master, the previous served values, the update's running mean). The indices are
  their own small tensors (cloned from a permutation of each tensor, which is then freed).
"""

from __future__ import annotations

import math

from ..memory import PERSISTENT, Row, per

METRIC_ELEMENTS = 65536  # elements of the trained tensors sampled (a fixed subset) for Fair Cast's metrics
SERVED_BYTES = {"bfloat16": 2, "float16": 2}
FP32 = 4


def metric_subset_sizes(numels: list[int], budget: int = METRIC_ELEMENTS) -> list[int]:
    """Elements of the fixed metric sample per trained tensor (what ``ServedCopy`` samples): ``max(1, min(n,
    ceil(budget × n / total)))``."""
    total = max(1, sum(numels))  # (a process may hold empty shards)
    return [max(1, min(n, math.ceil(budget * n / total))) for n in numels]


def memory_rows(spec) -> list[Row]:
    """Fair Cast's rows for a run (none when ``fair_cast='off'``)."""
    mode = getattr(spec.args, "fair_cast", "off")
    if mode == "off":
        return []
    sb = SERVED_BYTES.get(getattr(spec.args, "served_dtype", "bfloat16"), 2)
    ef = mode == "error_feedback"
    rows: list[Row] = []

    def row(item, nbytes, text, category):
        rows.append(Row(item, nbytes, text, PERSISTENT, "fair_cast", f"fair_cast/{category}"))

    if spec.full:
        n = spec.base_params
        row("Fair Cast fp32 master", FP32 * n, per(FP32, "params", n), "master")
        row("Fair Cast served copy", sb * n, per(sb, "params", n), "served")
        if ef:
            row("Fair Cast error-feedback residual", FP32 * n, per(FP32, "params", n), "residual")
        if not spec.use_vllm:
            buffers = spec.arch.buffer_bytes()
            row("Fair Cast in-process twin (sampler)", sb * n + buffers,
                per(sb, "params", n) + f" + buffers ({buffers} B)", "twin")
        trained = [t.numel for t in spec.base_tensors()]
    elif spec.lora_serving == "adapters":  # as the run's sampling decision says
        n = spec.adapter_params
        row("Fair Cast fp32 adapter masters", FP32 * n, per(FP32, "adapter params", n), "master")
        row("Fair Cast served adapters", sb * n, per(sb, "adapter params", n), "served")
        if ef:
            row("Fair Cast error-feedback residual", FP32 * n, per(FP32, "adapter params", n), "residual")
        trained = [t.numel for t in spec.adapter_tensors()]
    else:  # merged: W + ΔW served per layer, a dense twin beside the learner
        n = spec.base_params
        lora_layers = sum(t.numel for t in spec.base_tensors()
                          if t.role == "linear" and t.projection in spec.lora.targets)
        rest = n - lora_layers  # embeddings, norms, biases, the head, untargeted linears: a ParamUnit master each
        if spec.quant is None:
            row("Fair Cast fp32 base kept aside (merged serving)", FP32 * lora_layers,
                per(FP32, "LoRA-layer base params", lora_layers), "base_copy")
        if rest:
            row("Fair Cast fp32 masters of the other tensors (merged serving)", FP32 * rest,
                per(FP32, "non-LoRA params", rest), "master")
        if not spec.use_vllm:
            row("Fair Cast merged twin (sampler)", sb * n + spec.arch.buffer_bytes(), per(sb, "base params", n),
                "twin")
        row("Fair Cast served merged copy", sb * n, per(sb, "base params", n), "served")
        if ef:
            row("Fair Cast error-feedback residual", FP32 * n, per(FP32, "base params", n), "residual")
        # the merged LoRA layers are the trained units: their dense sizes set the sample
        trained = [t.numel for t in spec.base_tensors() if t.role == "linear" and t.projection in spec.lora.targets]
    k = sum(metric_subset_sizes(trained, METRIC_ELEMENTS))
    row("Fair Cast metric sample", 8 * k + 3 * FP32 * k,
        f"{METRIC_ELEMENTS} sampled elements: int64 index + 3 fp32 samples each (20 B × {k})", "metrics")
    return rows

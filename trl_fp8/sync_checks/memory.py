"""What the weight-sync checks allocate: their rows of the memory plan (``trl-fp8 plan``). A pure function of the
plan's spec; the handler of the run's sampling decision (``spec.decision``, the one the trainer makes; its kind's
:meth:`trl_fp8.kinds.Kind.plan_sampler`) says which sampler the run generates with and what its sync streams.

- The learner side keeps the last streamed tensors (``LearnerSide._current``) for ``quant_parity``: references to
  tensors held anyway (TRL's parameters, Fair Cast's served copy: 0 B), or, where the stream derives them (fast
  QLoRA's ``dequant(W) + ΔW`` to vLLM), a dense copy in the engine's dtype for as long as the run lasts.
- ``logprob_agreement``'s reference forward (a few rows, no gradient) runs on the learner's weights the way the
  sampler computes: the twin with the export swapped in (0 B), a rollout cache built afresh after the generation's
  own is dropped (no extra peak), or, for a vLLM engine fed TRL's stream, the learner's fp32 tensors cast to the
  engine's dtype (a copy for the duration of that forward).
- ``freshness`` and ``quant_parity`` compare in batches: on a GPU, groups of up to :data:`COMPARE_GROUP_ELEMENTS`
  elements (the group's learner references, both sides concatenated, one side widened: at most 14 B an element);
  on the CPU, one call into the compiled kernels per :data:`HOST_BATCH_BYTES` of learner references, held until then.
  References to tensors held anyway add nothing; one the check computes (a cast to the engine's dtype, an MXFP8
  quantize-dequantize) is held that long. The plan counts the GPU bound, as a transient of the sync.
- The sampler's per-token logprobs travel with the batch (fp32, rows × completion length).
- ``differential_oracle`` (not in the default set) reloads the sampler from clones at the first sync: about four
  copies of what is streamed, once.
"""

from __future__ import annotations

from ..memory import GENERATION, PERSISTENT, TRAINING, Row, per
from .names import resolve_checks

# How much a bitwise comparison of many tensors holds at once (trl_fp8.sync_checks.compare.PairComparer), bounded so
# that it is counted here: off the host, groups of up to this many elements (one concatenation per side) ...
COMPARE_GROUP_ELEMENTS = 1 << 20
GROUP_BYTES_PER_ELEMENT = 14  # the reference (<= 4 B), both sides concatenated (4 + 2 B), one side widened (4 B)
# ... on the host, the learner references (first sides) waiting for one call into the compiled kernels.
HOST_BATCH_BYTES = 4 << 20


def memory_rows(spec) -> list[Row]:
    checks = resolve_checks(getattr(spec.args, "sync_checks", "default"))
    if not checks:
        return []
    from ..kinds import handler

    sampler = handler(spec.decision).plan_sampler(spec)
    if sampler["sampler"] == "learner":
        return [Row("weight-sync checks: nothing to check (the learner generates)", 0, "0 B", PERSISTENT,
                    "sync_checks", "sync_checks/learner")]
    rows = []
    fresh = sampler.get("fresh_stream_bytes", 0)
    rows.append(Row("weight-sync checks: learner-side reference of the stream", fresh,
                    sampler.get("fresh_stream_per", "0 B: references to tensors held anyway"), PERSISTENT,
                    "sync_checks", "sync_checks/learner"))
    if "quant_parity" in checks or "freshness" in checks:
        group = COMPARE_GROUP_ELEMENTS * GROUP_BYTES_PER_ELEMENT
        rows.append(Row("weight-sync checks: one group of tensors compared bit for bit (at most)", group,
                        per(GROUP_BYTES_PER_ELEMENT, "elements a group", COMPARE_GROUP_ELEMENTS), GENERATION,
                        "sync_checks", exact=False))
    if "logprob_agreement" in checks:
        cast = sampler.get("reference_cast_params", 0)
        if cast:
            rows.append(Row("logprob check: learner cast to the engine's dtype (reference forward)", 2 * cast,
                            per(2, "fp32 params", cast), GENERATION, "sync_checks"))
        rows.append(Row("logprob check: sampler logprobs with the batch", spec.rollout.generation_batch *
                        spec.rollout.completion_length * 4,
                        f"4 B × rows × completion length ({spec.rollout.generation_batch} × "
                        f"{spec.rollout.completion_length})", TRAINING, "sync_checks"))
    if "differential_oracle" in checks:
        streamed = sampler.get("stream_bytes", 0)
        rows.append(Row("differential oracle: clones of the sampler state (first sync)", 4 * streamed,
                        "4 × the streamed bytes", GENERATION, "sync_checks", exact=False))
    return rows

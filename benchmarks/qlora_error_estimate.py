"""Does fast QLoRA's data-free NF4 error estimate rank a real model's layers the way their true error does?

Fast QLoRA decides which 4-bit layers to keep dense from the 4-bit weights alone (``trl_fp8.fast_qlora.ranking``: a value
that quantized to code c lay uniformly in c's bin). On a pretrained model (default ``trl-fp8:smollm2``) the true
error is measurable: the model is loaded twice — in fp32 and with ``BitsAndBytesConfig(load_in_4bit=True, nf4)``
(bitsandbytes' blocksize 64, as a user's QLoRA load) — and for every 4-bit linear the true relative error is
‖dequant(W₄) − W‖ / ‖W‖ against the fp32 weight W. Printed: the Spearman rank correlation of estimated vs true
relative error over the layers, the overlap of the worst-k layers by each, the ratio estimate / true (is the estimate
calibrated, not only ordered?), and what ``qlora_keep_budget_gb`` keeps at the default 0.25 GiB under each ranking
(selection by error per byte of the dense copy, as the trainer does) with the true squared error it removes.

    python benchmarks/qlora_error_estimate.py [--model trl-fp8:smollm2] [--budget-gb 0.25] [--jsonl FILE]

Last line: ``nf4_estimate_spearman: <rho>``.
"""

from __future__ import annotations

import argparse
import json
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def ranks(values: list[float]) -> list[float]:
    """Average ranks (ties share the mean rank), 0-based."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    if var == 0:
        raise ValueError("a ranking with no spread has no rank correlation")
    return cov / var


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="trl-fp8:smollm2")
    parser.add_argument("--budget-gb", type=float, default=0.25)
    parser.add_argument("--top", type=int, default=10, help="k of the worst-k overlap")
    parser.add_argument("--jsonl", default=None)
    args = parser.parse_args()
    if args.budget_gb < 0:
        parser.error("--budget-gb must be >= 0")

    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from trl_fp8 import fourbit
    from trl_fp8.models import resolve_model
    from trl_fp8.fast_qlora.ranking import LayerCost, estimate_error, relative_error, select_within_budget

    path = resolve_model(args.model)
    dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    quant = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32))
    fourbit.guard_cpu_repack(quant)
    originals = dict(dense.named_modules())
    rows = []
    with torch.no_grad():
        for name, module in quant.named_modules():
            if not fourbit.is_4bit(module):
                continue
            state = module.weight.quant_state
            err2, norm2 = estimate_error(fourbit.codes(module).cpu(), fourbit.block_absmax(state).cpu(),
                                         fourbit.code_table(module), state.blocksize)
            w = originals[name].weight.float()
            deq = fourbit.dequantize(module, torch.float32).reshape(w.shape)
            true = float((deq - w).norm() / w.norm())
            rows.append({"layer": name, "estimate": relative_error(err2, norm2), "true": true,
                         "dense_bytes": w.numel() * 4, "params": w.numel()})
    est = [r["estimate"] for r in rows]
    tru = [r["true"] for r in rows]
    rho = spearman(est, tru)
    k = min(args.top, len(rows))
    worst_est = {r["layer"] for r in sorted(rows, key=lambda r: -r["estimate"])[:k]}
    worst_true = {r["layer"] for r in sorted(rows, key=lambda r: -r["true"])[:k]}
    ratio = sorted(r["estimate"] / r["true"] for r in rows if r["true"] > 0)
    budget = int(args.budget_gb * 2**30)
    by_est = select_within_budget([LayerCost(r["layer"], r["estimate"], r["dense_bytes"]) for r in rows], budget)
    by_true = select_within_budget([LayerCost(r["layer"], r["true"], r["dense_bytes"]) for r in rows], budget)
    sq = {r["layer"]: (r["true"] ** 2) * r["params"] for r in rows}  # ∝ squared error, per-element scale aside
    total = sum(sq.values())
    removed_est = sum(sq[c.name] for c in by_est) / total
    removed_true = sum(sq[c.name] for c in by_true) / total
    kinds: dict[str, list[int]] = {}
    for c in by_est:
        kinds.setdefault(c.name.rsplit(".", 1)[-1], []).append(1)
    print(f"model {args.model}: {len(rows)} 4-bit linears (NF4, blocksize {state.blocksize})")
    print(f"true relative error: min {min(tru):.4f}, median {sorted(tru)[len(tru) // 2]:.4f}, max {max(tru):.4f}")
    print(f"estimate / true: median {ratio[len(ratio) // 2]:.3f} (min {ratio[0]:.3f}, max {ratio[-1]:.3f})")
    print(f"worst-{k} layers: {len(worst_est & worst_true)} of {k} in both rankings")
    print(f"keep budget {args.budget_gb} GiB: the estimate keeps {len(by_est)} layers "
          f"({', '.join(f'{kind} x{len(v)}' for kind, v in sorted(kinds.items()))}), the true error would keep "
          f"{len(by_true)}; {len(set(c.name for c in by_est) & set(c.name for c in by_true))} in common; share of "
          f"the true (relative² × size) error removed: estimate's choice {removed_est:.3f}, true's {removed_true:.3f}")
    if args.jsonl:
        with open(args.jsonl, "a") as f:
            f.write(json.dumps({"model": args.model, "spearman": rho, "layers": rows, "budget_gb": args.budget_gb,
                                "kept_estimate": [c.name for c in by_est],
                                "kept_true": [c.name for c in by_true]}) + "\n")
    print(f"nf4_estimate_spearman: {rho:.3f}")


if __name__ == "__main__":
    main()

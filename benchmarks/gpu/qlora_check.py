"""Device check for fast QLoRA: one script, at most ~8 minutes on one H200.

What only a GPU can show. It prints:

1. the comparison of ``benchmarks/qlora_speed.py`` on CUDA with bf16 compute -- (a) 16-bit LoRA, (b) QLoRA as TRL
   runs it, (c) trl_fp8 fast QLoRA (and (c'), its cache dtype "auto", the same bf16 on a GPU): GRPO step and generation time, memory (``torch.cuda`` allocated bytes),
   dequantizations per step, and the equivalence figures -- on a random-weight Qwen2 shaped like Qwen2-0.5B (24
   blocks, hidden 896, MLP 4864, 14 heads of 64, 2 KV heads; the character tokenizer's 128-slot vocabulary instead
   of 151,936: 358M parameters, 716 MB in bf16). The budgets-0 comparison is reported, not asserted: CUDA kernels
   need not be bit-reproducible between two trainers;
2. bitsandbytes' own CUDA 4-bit path for small row counts -- ``bnb.matmul_4bit`` in inference (no grad), which runs
   its fused dequant+matmul kernels (``gemv_4bit`` at one row, ``gemm_4bit`` up to a heuristic row count) -- against
   the rollout cache's dense matmul (``F.linear`` on a bf16 ``dequant(W)``, the cost of ``dequant(W) + ΔW``) and
   against a dequantization plus ``F.linear`` per call, for each linear shape of the model and 1-64 rows (a decode
   step's batch). Times are medians of 7 batches of back-to-back calls (CUDA events); the per-step figure sums the
   model's linears (each shape times its count). A ratio above 1 means the cache's dense matmul is faster. It runs
   first (seconds), so that its figure stands when a time limit stops the longer comparison.

    python benchmarks/gpu/qlora_check.py            # on the GPU machine
    python benchmarks/gpu/qlora_check.py --quick    # smoke run anywhere: tiny shapes, CPU without CUDA (the test-suite)

Without CUDA (and without ``--quick``) it says so and exits 0 without measuring anything. Last line:
``qlora_device_check: done``; before it ``qlora_4bit_over_cached_dense_1row: <ratio>`` (a decode step at one row:
bitsandbytes' fused 4-bit / the cache's dense matmul); the comparison's own headline
``qlora_step_ratio_vs_lora16: <ratio>`` is printed with its table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

# Qwen2-0.5B's shape (vocabulary aside). Sized for ~6 minutes on one H200 (an estimate: never run there yet): 6
# trainer builds and ~80 GRPO steps of 8 × 64 tokens; --reps/--steps/--seeds trade figures for time.
DEVICE_SETUP = dict(device="cuda", dtype="bfloat16", layers=24, hidden=896, intermediate=4864, reps=5, steps=3,
                    seeds=1)
ROWS = (1, 2, 4, 8, 16, 32, 64)


def _timer(device):
    """``timed(fn, calls)``: median over 7 batches of ``calls`` back-to-back calls, seconds per call."""
    import torch

    def timed(fn, calls):
        fn()  # warm-up (kernel selection, caches)
        samples = []
        for _ in range(7):
            if device.startswith("cuda"):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(calls):
                    fn()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end) / 1e3 / calls)
            else:
                t = time.perf_counter()
                for _ in range(calls):
                    fn()
                samples.append((time.perf_counter() - t) / calls)
        return statistics.median(samples)

    return timed


def linear_shapes(setup) -> list[tuple[str, int, int, int]]:
    """``(name, out_features, in_features, count in the model)`` of each LoRA-targeted linear shape."""
    from qlora_speed import HEAD_DIM

    heads = setup.hidden // HEAD_DIM
    kv = (2 if heads % 2 == 0 else 1) * HEAD_DIM
    inter = setup.intermediate or 4 * setup.hidden
    n = setup.layers
    return [("q_proj/o_proj", setup.hidden, setup.hidden, 2 * n), ("k_proj/v_proj", kv, setup.hidden, 2 * n),
            ("gate_proj/up_proj", inter, setup.hidden, 2 * n), ("down_proj", setup.hidden, inter, n)]


def kernel_timing(setup, rows_list, calls) -> dict[int, float]:
    """Print the per-shape table; return {rows: (Σ fused 4-bit time) / (Σ cached dense time)} over the model."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F
    import torch

    device, dtype = setup.device, setup.torch_dtype
    timed = _timer(device)
    torch.manual_seed(setup.seed)
    print(f"\nbitsandbytes 4-bit matmul vs the rollout cache's dense matmul, {device}, {setup.dtype}, no grad "
          f"(NF4, blocksize 64); ms per call, median of 7 × {calls} calls"
          + ("; on CPU bitsandbytes has no fused kernel: its 4-bit path dequantizes, then multiplies"
             if not device.startswith("cuda") else ""))
    print(f"{'linear':>18} {'out×in':>11} | {'rows':>4} | {'4-bit fused':>11} | {'dequant+mm':>10} | "
          f"{'cached dense':>12} | {'4-bit/dense':>11} | {'max |Δ|/max|y|':>14}")
    totals = {rows: [0.0, 0.0] for rows in rows_list}
    with torch.no_grad():
        for name, out_f, in_f, count in linear_shapes(setup):
            weight = torch.randn(out_f, in_f, device=device, dtype=dtype) * 0.02
            packed, state = F.quantize_4bit(weight, blocksize=64, quant_type="nf4")
            dense = F.dequantize_4bit(packed, state).to(dtype)  # what the cache holds (ΔW added: same cost)
            for rows in rows_list:
                x = torch.randn(rows, in_f, device=device, dtype=dtype)

                def fused():
                    return bnb.matmul_4bit(x, packed.t(), quant_state=state)

                def cached():
                    return torch.nn.functional.linear(x, dense)

                def unfused():
                    return torch.nn.functional.linear(x, F.dequantize_4bit(packed, state).to(dtype))

                y_fused, y_dense = fused().float(), cached().float()
                scale = y_dense.abs().max().item()
                err = (y_fused - y_dense).abs().max().item() / scale if scale > 0 else float("nan")
                t_fused, t_unfused, t_dense = timed(fused, calls), timed(unfused, calls), timed(cached, calls)
                totals[rows][0] += count * t_fused
                totals[rows][1] += count * t_dense
                print(f"{name:>18} {f'{out_f}×{in_f}':>11} | {rows:>4} | {t_fused * 1e3:>11.4f} | "
                      f"{t_unfused * 1e3:>10.4f} | {t_dense * 1e3:>12.4f} | {t_fused / t_dense:>11.2f} | {err:>14.2g}")
    ratios = {}
    print(f"\nall {sum(c for *_, c in linear_shapes(setup))} linears of the model, one decode step (rows = sequences):")
    for rows, (fused_total, dense_total) in totals.items():
        ratios[rows] = fused_total / dense_total
        print(f"  rows {rows:>3}: bitsandbytes 4-bit {fused_total * 1e3:.3f} ms, cached dense "
              f"{dense_total * 1e3:.3f} ms, 4-bit / dense {ratios[rows]:.2f}")
    return ratios


def main() -> None:
    import torch

    import qlora_speed

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="the device (default: cuda when present; cpu only with --quick)")
    qlora_speed.add_arguments(parser, qlora_speed.Setup(**DEVICE_SETUP))
    args = parser.parse_args()
    if not args.device.startswith("cuda") and not args.quick:
        if torch.cuda.is_available():
            parser.error(f"--device {args.device}: the full check runs on CUDA; a CPU run is a smoke run (--quick)")
        print("qlora_device_check: no CUDA device here (torch.cuda.is_available() is False), so nothing was measured; "
              "this check needs one GPU. For a CPU smoke run of the script: --quick.")
        return
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available here")
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    setup = qlora_speed.setup_from_args(parser, args, qlora_speed.Setup(**dict(DEVICE_SETUP, device=args.device,
                                                                               dtype=dtype)))
    if args.device.startswith("cuda"):
        print(f"device: {torch.cuda.get_device_name()} (capability {torch.cuda.get_device_capability()}), "
              f"torch {torch.__version__}")
    else:
        print(f"device: {args.device} (smoke run), torch {torch.__version__}")
    import bitsandbytes

    print(f"bitsandbytes {bitsandbytes.__version__}")

    # The kernel timing first: it takes seconds, and its figure stands even if a time limit (run_all.sh) stops the
    # longer comparison after it.
    started = time.perf_counter()
    rows = (1, 8) if args.quick else ROWS
    ratios = kernel_timing(setup, rows, 5 if args.quick else 100)
    print(f"qlora_4bit_over_cached_dense_1row: {ratios[1]:.2f}", flush=True)
    timed = time.perf_counter()
    qlora_speed.report(qlora_speed.run_comparison(setup), strict=False)
    print(f"\nwall time: kernel timing {timed - started:.0f} s, comparison {time.perf_counter() - timed:.0f} s")
    print(f"qlora_4bit_over_cached_dense_1row: {ratios[1]:.2f}")
    print("qlora_device_check: done")


if __name__ == "__main__":
    main()

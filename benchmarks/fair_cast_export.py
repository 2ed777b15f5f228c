"""Export time of Fair Cast's stochastic rounding (SR) and error feedback (EF) relative to a plain RTN copy.

A plain round-to-nearest export is `dst.copy_(src)` (fp32 -> bf16). On >= 20M fp32 elements, the variants run
interleaved (copy, SR, EF, torchao SR, copy, ...) and each figure is the median over rounds of
(variant time / copy time in the same round). torchao's `_fp32_to_bf16_sr` (from its 8-bit optimizers) is a
peer: a generic `torch.randint` per element.

    python benchmarks/fair_cast_export.py [--numel 20000000] [--rounds 9] [--device cpu|cuda]

Last line: `sr_export_over_rtn: <number>` (goal <= 2 on CPU, <= 1.2 on CUDA).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _timer(device):
    if device == "cuda":
        def run(fn):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            return time.perf_counter() - t
    else:
        def run(fn):
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t
    return run


def main() -> None:
    from trl_fp8.fair_cast import _native
    from trl_fp8.fair_cast.rounding import error_feedback_round, stochastic_round

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=20_000_000)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--skip-torchao", action="store_true", help="do not time torchao's SR (slow)")
    args = parser.parse_args()
    if args.numel < 20_000_000:
        parser.error("--numel must be >= 20000000")
    if args.rounds < 5:
        parser.error("--rounds must be >= 5")

    dev = args.device
    src = torch.randn(args.numel, device=dev) * 0.05
    dst = torch.empty(args.numel, dtype=torch.bfloat16, device=dev)
    residual = torch.zeros(args.numel, device=dev)
    run = _timer(dev)
    peer = None
    if not args.skip_torchao:
        try:
            from torchao.optim.quant_utils import _fp32_to_bf16_sr as peer
        except ImportError:
            print("torchao _fp32_to_bf16_sr not importable: peer skipped")

    variants = {
        "sr": lambda step: stochastic_round(src, seed=0, step=step, index=0, out=dst),
        "ef": lambda step: error_feedback_round(src, residual, out=dst),
    }
    if peer is not None:
        variants["torchao_sr"] = lambda step: dst.copy_(peer(src))
    for fn in variants.values():  # warm-up (kernel build / compile, caches)
        fn(0)
    dst.copy_(src)

    ratios = {name: [] for name in variants}
    copies = []
    for r in range(1, args.rounds + 1):
        base = run(lambda: dst.copy_(src))
        copies.append(base)
        for name, fn in variants.items():
            ratios[name].append(run(lambda: fn(r)) / base)
    backend = "fused C kernel" if (dev == "cpu" and _native.load() is not None) else (
        "torch.compile (Triton)" if dev == "cuda" else "PyTorch ops")
    print(f"device {dev}, {args.numel / 1e6:.0f}M elements, {args.rounds} rounds, SR/EF backend: {backend}")
    print(f"plain RTN copy: median {statistics.median(copies) * 1e3:.2f} ms")
    for name, values in ratios.items():
        print(f"{name:>11} / copy: median {statistics.median(values):.2f}x (min {min(values):.2f}, max {max(values):.2f})")
    print(f"ef_export_over_rtn: {statistics.median(ratios['ef']):.2f}")
    print(f"sr_export_over_rtn: {statistics.median(ratios['sr']):.2f}")


if __name__ == "__main__":
    main()

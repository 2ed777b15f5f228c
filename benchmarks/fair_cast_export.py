"""Export time of Fair Cast's stochastic rounding (SR) and error feedback (EF) relative to a plain RTN copy.

A plain round-to-nearest export is `dst.copy_(src)` (fp32 -> bf16). On >= 20M fp32 elements, the variants run
interleaved (copy, SR, EF, torchao SR, copy, ...) and each figure is the median over rounds of
(variant time / copy time in the same round). torchao's `_fp32_to_bf16_sr` (from its 8-bit optimizers) is a
peer: a generic `torch.randint` per element.

    python benchmarks/fair_cast_export.py [--numel 20000000] [--rounds 9] [--device cpu|cuda]

The backend is observed, not assumed: every SR/EF implementation is counted during the timed rounds (fused C
kernel, torch.compile, plain PyTorch ops) and printed with the thread settings. The headline is printed only when
the timed calls all ran the backend this device is documented to use (CPU: the fused C kernel; CUDA: torch.compile);
otherwise the last line says which backend ran instead, without a number.

Last line: `sr_export_over_rtn: <number>` (goal <= 2 on CPU, <= 1.2 on CUDA).
"""

from __future__ import annotations

import argparse
import collections
import os
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


class BackendCounter:
    """Counts which implementation each SR/EF call reached (wrapping the module functions the dispatch calls)."""

    def __init__(self):
        from trl_fp8.fair_cast import _native, rounding

        self.counts = collections.Counter()
        self.patched = []
        for module, name, label in ((_native, "sr_bf16", "sr: fused C kernel"),
                                    (_native, "ef_bf16", "ef: fused C kernel"),
                                    (rounding, "_sr_bf16_bits_torch", "sr: PyTorch ops"),
                                    (rounding, "_error_feedback_torch", "ef: PyTorch ops"),
                                    (rounding, "_compiled_sr_bf16_bits", "sr: torch.compile")):
            self._wrap(module, name, label)

    def _wrap(self, module, name, label):
        real = getattr(module, name)

        def counted(*args, **kwargs):
            self.counts[label] += 1
            return real(*args, **kwargs)

        setattr(module, name, counted)
        self.patched.append((module, name, real))

    def restore(self):
        for module, name, real in self.patched:
            setattr(module, name, real)


def main() -> None:
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
    counter = BackendCounter()
    try:
        for r in range(1, args.rounds + 1):
            base = run(lambda: dst.copy_(src))
            copies.append(base)
            for name, fn in variants.items():
                ratios[name].append(run(lambda: fn(r)) / base)
    finally:
        counter.restore()
    threads = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "TRL_FP8_NO_NATIVE") if k in os.environ}
    print(f"device {dev}, {args.numel / 1e6:.0f}M elements, {args.rounds} rounds, torch threads "
          f"{torch.get_num_threads()}{', ' + str(threads) if threads else ''}")
    ran = ", ".join(f"{label} x{n}" for label, n in sorted(counter.counts.items()))
    print(f"backend that ran (timed calls): {ran}")
    print(f"plain RTN copy: median {statistics.median(copies) * 1e3:.2f} ms")
    for name, values in ratios.items():
        print(f"{name:>11} / copy: median {statistics.median(values):.2f}x "
              f"(min {min(values):.2f}, max {max(values):.2f})")
    documented = "fused C kernel" if dev == "cpu" else "torch.compile"
    expected = {f"sr: {documented}": args.rounds}
    if dev == "cpu":
        expected["ef: fused C kernel"] = args.rounds
    sr_only = {k: v for k, v in counter.counts.items() if k.startswith("sr:")}
    if dev == "cpu" and dict(counter.counts) != expected or dev != "cpu" and sr_only != expected:
        print(f"sr_export_over_rtn: n/a (the {documented} did not run every timed call: {ran}; see the warnings "
              "above, TRL_FP8_NO_NATIVE, or a C compiler with OpenMP)")
        return
    print(f"ef_export_over_rtn: {statistics.median(ratios['ef']):.2f}")
    print(f"sr_export_over_rtn: {statistics.median(ratios['sr']):.2f}")


if __name__ == "__main__":
    main()

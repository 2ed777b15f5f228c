"""Export time of Fair Cast's stochastic rounding (SR) and error feedback (EF) relative to a plain RTN copy.

A plain round-to-nearest export is `dst.copy_(src)` (fp32 -> bf16). On >= 20M fp32 elements, the variants run
interleaved (copy, SR, EF, torchao SR, copy, ...) and each figure is the median over rounds of
(variant time / copy time in the same round). torchao's `_fp32_to_bf16_sr` (from its 8-bit optimizers) is a
peer: a generic `torch.randint` per element.

    python benchmarks/fair_cast_export.py [--numel 20000000] [--rounds 9] [--device cpu|cuda] [--isa both]
                                          [--jsonl benchmarks/results/fair_cast_export.jsonl]

On CPU it prints the CPU's vector extensions (from /proc/cpuinfo) beside the figure, and the instruction set the
fused kernel was built for (``native``: ``-march=native``). With ``--isa both`` (the default on an x86-64 CPU with
AVX-512) a second SR build, compiled for AVX2 only (``-march=native -mno-avx512f``, what an AVX2-only CPU builds), is
timed in the same rounds: ``sr_avx2_build``. That is the AVX2 *code* on this CPU (its memory system and clocks),
not a measurement on an AVX2-only CPU; run the script there for that. ``--isa avx2`` makes the AVX2 build the
dispatched one (as ``TRL_FP8_NATIVE_ISA=avx2`` does). Every run appends one raw record to ``--jsonl``.

The backend is observed, not assumed: every SR/EF implementation is counted during the timed rounds (fused C
kernel, torch.compile, plain PyTorch ops) and printed with the thread settings. The headline is printed only when
the timed calls all ran the backend this device is documented to use (CPU: the fused C kernel; CUDA: torch.compile);
otherwise the last line says which backend ran instead, without a number.

Last line: `sr_export_over_rtn: <number> (<isa> build; CPU: <vector extensions>)` (goal <= 1.2).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import platform
import statistics
import time

import torch


def _timer(device, clock="wall"):
    if clock == "cpu":  # this thread's CPU time: time spent descheduled on a busy machine is not counted
        def run(fn):
            t = time.thread_time()
            fn()
            return time.thread_time() - t
        return run
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
        from trl_fp8 import native as _native
        from trl_fp8.fair_cast import rounding

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


# the vector extensions worth naming on the headline (the full list is printed above it)
_HEADLINE_EXTENSIONS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "asimd",
                        "sve", "sve2")


def main() -> None:
    from trl_fp8 import native as _native
    from trl_fp8.fair_cast.rounding import derive_key, error_feedback_round, stochastic_round

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=20_000_000)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--skip-torchao", action="store_true", help="do not time torchao's SR (slow)")
    parser.add_argument("--isa", choices=("native", "avx2", "both"), default=None,
                        help="CPU kernel build(s) to time (default: both on an x86-64 CPU with AVX-512, else native)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: elapsed time (default); cpu: the calling thread's CPU time (CPU device, one "
                             "thread only), for a machine shared with other jobs")
    parser.add_argument("--jsonl", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                        "fair_cast_export.jsonl"), help="append the raw record here")
    args = parser.parse_args()
    if args.numel < 20_000_000:
        parser.error("--numel must be >= 20000000")
    if args.rounds < 5:
        parser.error("--rounds must be >= 5")

    dev = args.device
    if args.clock == "cpu" and (dev != "cpu" or torch.get_num_threads() != 1):
        parser.error("--clock cpu times the calling thread: it needs --device cpu and one thread (OMP_NUM_THREADS=1)")
    extensions = _native.vector_extensions()
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    isa = args.isa or ("both" if dev == "cpu" and x86 and "avx512f" in extensions else "native")
    if isa != "native" and not x86:
        parser.error(f"--isa {isa}: the avx2 build is for x86-64 CPUs; this is {platform.machine()}")
    dispatched = "avx2" if isa == "avx2" else "native"
    os.environ[_native.ISA_ENV] = dispatched  # what stochastic_round / error_feedback_round load
    src = torch.randn(args.numel, device=dev) * 0.05
    dst = torch.empty(args.numel, dtype=torch.bfloat16, device=dev)
    residual = torch.zeros(args.numel, device=dev)
    run = _timer(dev, args.clock)
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
    if dev == "cpu" and isa == "both":
        avx2_lib, direct = _native.load("avx2"), _native.sr_bf16  # called directly: not counted as the dispatch
        if avx2_lib is None:
            print("the avx2 build could not be loaded (see the warning above): sr_avx2_build skipped")
        else:
            variants["sr_avx2_build"] = lambda step: direct(avx2_lib, src, dst, derive_key(0, step, 0),
                                                            max(1, torch.get_num_threads()))
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
    print(f"device {dev}, {args.numel / 1e6:.0f}M elements, {args.rounds} rounds, {args.clock} clock, torch threads "
          f"{torch.get_num_threads()}{', ' + str(threads) if threads else ''}")
    cpu_name = next((line.partition(": ")[2] for line in _native._cpuinfo_identity()
                     if line.startswith("model name")), platform.processor() or platform.machine())
    print(f"cpu: {cpu_name}; vector extensions: {' '.join(extensions) or 'unknown (no /proc/cpuinfo flags)'}")
    if dev == "cpu":
        print(f"fused kernel build dispatched: {dispatched} ({' '.join(_native._flags(dispatched))})"
              + ("; sr_avx2_build: the same SR kernel compiled with -mno-avx512f, timed on this CPU"
                 if "sr_avx2_build" in variants else ""))
    ran = ", ".join(f"{label} x{n}" for label, n in sorted(counter.counts.items()))
    print(f"backend that ran (timed calls): {ran}")
    print(f"plain RTN copy: median {statistics.median(copies) * 1e3:.2f} ms")
    for name, values in ratios.items():
        print(f"{name:>11} / copy: median {statistics.median(values):.2f}x "
              f"(min {min(values):.2f}, max {max(values):.2f})")
    record = {"device": dev, "numel": args.numel, "rounds": args.rounds, "threads": torch.get_num_threads(),
              "cpu": cpu_name, "vector_extensions": extensions, "isa": isa, "dispatched": dispatched, "clock": args.clock,
              "kernel_source_sha256": hashlib.sha256(_native.C_SOURCE.encode()).hexdigest()[:16],
              "copy_seconds": copies, "ratios": ratios, "backends": dict(counter.counts),
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if args.jsonl:
        os.makedirs(os.path.dirname(os.path.abspath(args.jsonl)), exist_ok=True)
        with open(args.jsonl, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
    shown = [e for e in _HEADLINE_EXTENSIONS if e in extensions]
    tag = f"({dispatched} build; CPU: {' '.join(shown) if shown else 'vector extensions unknown'})"
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
    if "sr_avx2_build" in ratios:
        print(f"sr_avx2_build_over_rtn: {statistics.median(ratios['sr_avx2_build']):.2f} (the AVX2 build "
              f"(-mno-avx512f) on this AVX-512 CPU)")
    print(f"sr_export_over_rtn: {statistics.median(ratios['sr']):.2f} {tag}")


if __name__ == "__main__":
    main()

"""Device check for MXFP8 (and Fair Cast's CUDA export): one script, at most ~8 minutes on one H200.

What only a GPU can show. An H200/H100 (SM90) runs torchao's *emulated* MXFP8 only; real MXFP8 kernels need
Blackwell (SM100), which this script uses when present. It prints:

1. the sampler/learner logprob-consistency table of ``benchmarks/mxfp8_consistency.py`` on the device;
2. linear-layer timing, MXFP8 vs bf16 ``F.linear`` (forward + backward), for growing micro-batches — the source
   study saw FP8 gains only with large micro-batches; emulated MXFP8 is expected to be slower at every size;
3. Fair Cast's stochastic-rounding export on the device (the torch.compile/Triton path) vs a plain bf16 copy.

    python benchmarks/gpu/mxfp8_check.py             # on the GPU machine
    python benchmarks/gpu/mxfp8_check.py --device cpu --quick   # smoke run anywhere (the test-suite does this)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _timer(device):
    import torch

    if device.startswith("cuda"):
        def run(fn, repeats):
            times = []
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            return statistics.median(times)
    else:
        def run(fn, repeats):
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return statistics.median(times)
    return run


def linear_timing(device, sizes, dim, repeats):
    import torch
    from torch import nn

    from trl_fp8.mxfp8.convert import MXRecipe, convert_linears, resolve_kernel

    kernel = resolve_kernel("auto")
    timed = _timer(device)
    print(f"\nlinear {dim}×{dim}, forward+backward, MXFP8 kernel: {kernel}")
    print(f"{'tokens':>8} | {'bf16 ms':>9} | {'mxfp8 ms':>9} | {'mxfp8/bf16':>10}")
    for tokens in sizes:
        plain = nn.Linear(dim, dim, bias=False, device=device, dtype=torch.bfloat16)
        mx = nn.Linear(dim, dim, bias=False, device=device, dtype=torch.bfloat16)
        mx.load_state_dict(plain.state_dict())
        convert_linears(nn.Sequential(mx), MXRecipe(kernel=kernel))
        x = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16, requires_grad=True)

        def step(layer):
            def fn():
                layer(x).float().pow(2).mean().backward()
            return fn

        for layer in (plain, mx):  # warm-up
            step(layer)()
        a, b = timed(step(plain), repeats), timed(step(mx), repeats)
        print(f"{tokens:>8} | {a * 1e3:>9.3f} | {b * 1e3:>9.3f} | {b / a:>10.2f}")


def export_timing(device, numel, repeats):
    import torch

    from trl_fp8.fair_cast.rounding import stochastic_round

    timed = _timer(device)
    src = torch.randn(numel, device=device) * 1e-2
    dst = torch.empty(numel, device=device, dtype=torch.bfloat16)
    stochastic_round(src, torch.bfloat16, seed=1, step=0, index=0, out=dst)  # compile / warm-up
    base = timed(lambda: dst.copy_(src), repeats)
    sr = timed(lambda: stochastic_round(src, torch.bfloat16, seed=1, step=0, index=0, out=dst), repeats)
    print(f"\nFair Cast SR export, {numel / 1e6:.0f}M fp32 -> bf16 on {device}: copy {base * 1e3:.3f} ms, "
          f"SR {sr * 1e3:.3f} ms, ratio {sr / base:.2f}")


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    args = parser.parse_args()
    device = args.device
    if device.startswith("cuda"):
        print(f"device: {torch.cuda.get_device_name()} (capability {torch.cuda.get_device_capability()}), "
              f"torch {torch.__version__}")
    else:
        print(f"device: {device}, torch {torch.__version__}")

    from mxfp8_consistency import build_models, consistency, format_table, summarize

    prompts, rounds = (8, 1) if args.quick else (256, 5)
    models = build_models(device)
    results = [consistency(models, prompts, seed, device) for seed in range(rounds)]
    print(f"\nconsistency on {device}: mean/max |Δ logp| per token, {prompts} prompts × {rounds} rounds (median), "
          f"all pairings on the same rows; forced re-run check {max(r['rescore_check'] for r in results):.3g}")
    for line in format_table(summarize(results)):
        print(line)
    sizes, dim, repeats = ((64, 96), 64, 3) if args.quick else ((512, 4096, 16384, 65536), 4096, 20)
    linear_timing(device, sizes, dim, repeats)
    export_timing(device, 1 << (16 if args.quick else 26), 3 if args.quick else 20)
    print("\nmxfp8_device_check: done")


if __name__ == "__main__":
    main()

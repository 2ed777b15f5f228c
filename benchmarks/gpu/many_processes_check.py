"""Device check for trl_fp8 with DeepSpeed / FSDP2 (world size 1 on one GPU): at most a few minutes on one H200.

On a CPU-only machine the shard logic runs at world size 2 over gloo (tests/distributed); accelerate does not drive
FSDP on a CPU, and the GPU paths (NCCL, the compiled Triton SR kernel with shard offsets, FSDP2's bf16 all-gather,
DeepSpeed's CUDA engine) only run here. It runs, each in its own process:

1. engine level: a tiny model under ``fully_shard`` (FSDP2, ``MixedPrecisionPolicy(param_dtype=bf16)``) and under
   ``deepspeed.initialize`` ZeRO-1/2/3 (bf16), Fair Cast SR and EF over 4 steps: the served copy assembled from the
   shards, and the weights the engine hands the forward, equal the one-process export of the assembled master bit
   for bit (the reference on the CPU: CPU and CUDA kernels must agree), and a resume from step 2 serves the same bits;
2. trainer level: ``trl_fp8.GRPOTrainer`` under ZeRO-2 and ZeRO-3 (the environment ``accelerate launch --config_file
   zero2.yaml`` sets) with Fair Cast SR/EF and every weight-sync check, bf16 on the GPU; SR's served weights equal
   the reference export each step and a resume from checkpoint-2 serves step 3's bits (SR and EF);
3. guards: DUET asked for under ZeRO-3 and Fair Cast under FSDP2 (from the environment, with the trainer's real
   ``is_deepspeed_enabled`` / ``is_fsdp_enabled``) are refused, naming the engine.

    python benchmarks/gpu/many_processes_check.py                  # on the GPU machine
    python benchmarks/gpu/many_processes_check.py --device cpu --quick   # smoke run anywhere (the test-suite does this)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(ROOT, "tests", "distributed")

GUARD = r"""
import json, os, sys
import trl_fp8
from trl_fp8.app.demo.model import demo_model_path
from trl_fp8.app.tasks.arithmetic import correctness_reward, make_arithmetic_dataset

args = trl_fp8.GRPOConfig(output_dir=sys.argv[1], use_cpu=sys.argv[2] == "cpu", report_to="none", max_steps=1,
                          num_generations=4, per_device_train_batch_size=4, max_completion_length=4,
                          sync_checks="off", **json.loads(sys.argv[4]))
for key, value in json.loads(sys.argv[3]).items():  # the engine appears after the config: the trainer must refuse
    os.environ[key] = value
try:
    t = trl_fp8.GRPOTrainer(model=demo_model_path(), reward_funcs=[correctness_reward], args=args,
                            train_dataset=make_arithmetic_dataset(8, seed=1))
    print(json.dumps({"result": "ran: " + ",".join(t.capabilities)}))
except ValueError as err:
    print(json.dumps({"result": str(err)}))
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(device: str, **extra) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", **extra}
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    for name in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_DEEPSPEED_ZERO_STAGE"):
        if name not in extra:
            env.pop(name, None)
    return env


def _torchrun(script, args, env, timeout):
    t = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_addr",
                             "127.0.0.1", "--master_port", str(_port()), script, *args], capture_output=True,
                            text=True, env=env, timeout=timeout, cwd=ROOT)
    return result, time.perf_counter() - t


def engine_level(out, device, engines, timeout) -> bool:
    result, seconds = _torchrun(os.path.join(TESTS, "shard_worker.py"), [out, ",".join(engines),
                                "stochastic,error_feedback"], _env(device, SHARD_DEVICE=device), timeout)
    print(f"\n1. engine level ({', '.join(engines)}; {seconds:.0f} s)")
    if result.returncode != 0:
        print(result.stdout[-3000:] + result.stderr[-5000:])
        return False
    ok = True
    print(f"{'engine':>7} | {'mode':>14} | {'steps == reference':>18} | {'resume exact':>12}")
    for engine in engines:
        for mode in ("stochastic", "error_feedback"):
            r = json.load(open(os.path.join(out, f"{engine}-{mode}.rank0.json")))
            good, resumed = not r["errors"], r["resumed"] == r["straight"]
            ok &= good and resumed
            print(f"{engine:>7} | {mode:>14} | {str(good):>18} | {str(resumed):>12}")
            for error in r["errors"][:3]:
                print("   ", error)
    return ok


def trainer_level(out, device, timeout, stage) -> bool:
    env = _env(device, ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_ZERO_STAGE=str(stage),
               TRL_FP8_TEST_DEVICE=device)
    names = [f"zero{stage}_sr", f"zero{stage}_ef"]
    result, seconds = _torchrun(os.path.join(TESTS, "ddp_worker.py"), [out, ",".join(names)], env, timeout)
    print(f"\n2. trainer under ZeRO-{stage}, world size 1 ({seconds:.0f} s)")
    if result.returncode != 0:
        print(result.stdout[-3000:] + result.stderr[-5000:])
        return False
    ok = True
    for name in names:
        r = json.load(open(os.path.join(out, f"{name}.rank0.json")))
        checks = r["checks"] or {}
        line = (f"{name}: deepspeed={r['deepspeed']} capabilities={r['capabilities']} steps={len(r['served'])} "
                f"checks compared={checks.get('compared')} failed={checks.get('failed')}")
        good = r["deepspeed"] and r["error"] is None and not checks.get("failed") and len(set(r["served"])) == 3
        resumed = r.get("resumed") or {}
        good &= resumed.get("served") == [r["served"][2]]
        line += f" resume_exact={resumed.get('served') == [r['served'][2]]}"
        if name.endswith("_sr"):
            good &= r["reference_ok"] == [True] * 3
            line += f" reference={r['reference_ok']}"
        ok &= bool(good)
        print(line)
    return ok


def guards(out, device, timeout) -> bool:
    print("\n3. guards at trainer start (the engine from the environment)")
    ok = True
    cases = {"ZeRO-3": ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"},
                        {"duet": True}, "duet"),
             "FSDP2": ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}, {"fair_cast": "stochastic"}, "fair_cast")}
    if device == "cpu":
        cases.pop("ZeRO-3")  # needs DeepSpeed's process group: the 2-rank CPU tests cover it
    for label, (env, fields, capability) in cases.items():
        result = subprocess.run([sys.executable, "-c", GUARD, out, device, json.dumps(env), json.dumps(fields)],
                                capture_output=True,
                                text=True, env=_env(device, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()),
                                                    RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"), timeout=timeout,
                                cwd=ROOT)
        text = json.loads(result.stdout.strip().splitlines()[-1])["result"] if result.returncode == 0 else \
            result.stderr[-2000:]
        good = text.startswith(f"{capability} is not supported with") and label.replace("-", "") in \
            text.replace("-", "")
        ok &= good
        print(f"{label}: {capability} {'refused' if good else 'NOT REFUSED'}: {text[:200]}")
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--quick", action="store_true", help="FSDP2 engine check and one guard only (CPU smoke run)")
    p.add_argument("--timeout", type=int, default=420, help="seconds per launched process")
    args = p.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("many_processes_device_check: no CUDA device; nothing to check")
            return 0
        print(f"device: {torch.cuda.get_device_name(0)}")
    try:
        import deepspeed  # noqa: F401

        have_deepspeed = True
    except ImportError:
        have_deepspeed = False
        print("deepspeed is not installed: the ZeRO parts are skipped (pip install 'trl-fp8[deepspeed]')")
    engines = ["fsdp2"] + (["zero1", "zero2", "zero3"] if have_deepspeed and not args.quick else [])
    ok = True
    with tempfile.TemporaryDirectory(prefix="trl_fp8_many_") as out:
        ok &= engine_level(out, args.device, engines, args.timeout)
        if have_deepspeed and not args.quick:
            for stage in (2, 3):
                ok &= trainer_level(out, args.device, args.timeout, stage)
        ok &= guards(out, args.device, args.timeout)
    print("many_processes_device_check: done" if ok else "many_processes_device_check: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

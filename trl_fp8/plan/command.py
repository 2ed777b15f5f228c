"""``trl-fp8 plan``: the command line of the memory plan (:mod:`trl_fp8.app.cli` hands it its arguments).

Every option's value is checked here, before a plan is made: a bad one is one line naming the option and what it
allows (the caller's usage error: exit status 2, no traceback). Nothing on this path imports TRL, transformers or
torch: the capability list and the config defaults are read from the capabilities' declarations
(:mod:`.capabilities`), so a plan is answered in about a second.
"""

from __future__ import annotations

import argparse
import math

from ..fair_cast.declaration import FAIR_CAST_MODES as FAIR_CAST  # GRPOConfig.fair_cast's choices
from ..fast_qlora.declaration import FAST_QLORA_MODES as FAST_QLORA  # GRPOConfig.fast_qlora's choices
# Upper bounds of the integer options: far above any run, low enough that the byte counts stay finite.
LIMITS = {"--lora-r": 2**16, "--generations": 2**16, "--batch-size": 2**16, "--steps-per-generation": 2**16,
          "--gradient-accumulation-steps": 2**16, "--completion-length": 2**22, "--prompt-length": 2**22,
          "--vllm-max-model-length": 2**22}


def utilization(args) -> dict:
    """``--vllm-gpu-memory-utilization`` as the run's field: TRL's ``vllm_gpu_memory_utilization`` for a colocated
    engine, the server's own (``vllm_server_gpu_memory_utilization``, what ``trl-fp8 vllm-serve`` is started with) for
    a server; nothing when not given (the defaults: 0.3 and 0.9)."""
    value = args.vllm_gpu_memory_utilization
    if value is None:
        return {}
    return {"vllm_server_gpu_memory_utilization" if args.vllm == "server" else "vllm_gpu_memory_utilization": value}


def build_parser(error) -> argparse.ArgumentParser:
    from .devices import DEVICES
    from .models import MODELS

    p = argparse.ArgumentParser(
        prog="trl-fp8 plan",
        description="Will it fit? The memory of a GRPO run, per component and per parameter of what, for a model "
        "config and a device, before anything is loaded. Defaults: the free-tier recipe with every trl_fp8 "
        "capability that applies switched on (Fair Cast stochastic with adapter serving, the default weight-sync "
        "checks, DUET, fast QLoRA with --qlora, gradient checkpointing).")
    p.add_argument("--model", required=True,
                   help=f"a known name ({', '.join(MODELS)}; Hub ids such as Qwen/Qwen2.5-7B-Instruct work too), a "
                   "config.json or a folder holding one (for any other Hub model, download its config.json). Dense "
                   "Llama / Mistral / Qwen2 decoders; mixtures of experts and other model types are refused")
    method = p.add_mutually_exclusive_group()
    method.add_argument("--full", action="store_true", help="full fine-tuning (the default without --qlora/--lora-r)")
    method.add_argument("--qlora", action="store_true", help="QLoRA: a 4-bit NF4 base (double quant) + LoRA")
    p.add_argument("--lora-r", type=int, default=None, metavar="R",
                   help="LoRA rank (alone: LoRA over a 16-bit base; with --qlora: its rank, default 16)")
    p.add_argument("--lora-dropout", type=float, default=0.0,
                   help="LoRA dropout (PEFT's default 0; `trl-fp8 grpo`'s --lora_dropout defaults to TRL's 0.05): "
                        "above 0 each LoRA layer keeps a dropout mask and its own input for backward")
    p.add_argument("--targets", default="all-linear",
                   help="LoRA target modules, comma-separated (default: all-linear = every block linear: seven projections, four on Phi-3)")
    p.add_argument("--fair-cast", default="stochastic", choices=FAIR_CAST,
                   help="Fair Cast export rule (default: %(default)s)")
    p.add_argument("--lora-serving", default="auto", choices=["auto", "adapters", "merged"],
                   help="how a LoRA policy is served: auto = adapters (base + adapter versions, a server too), "
                   "merged = one dense W + ΔW per layer (default: %(default)s)")
    p.add_argument("--fast-qlora", default="auto", choices=FAST_QLORA,
                   help="fast QLoRA (with --qlora): off, auto or on (default: %(default)s)")
    p.add_argument("--sync-checks", default="default",
                   help="weight-sync checks: default, all, off or comma-separated names")
    p.add_argument("--duet", action=argparse.BooleanOptionalAction, default=True, help="DUET token budget (on)")
    p.add_argument("--beta", type=float, default=0.0,
                   help="KL coefficient; > 0 keeps a reference model (full fine-tuning: a second copy of the "
                   "weights) (default: %(default)s)")
    p.add_argument("--device", default="t4",
                   help=f"{', '.join(DEVICES)}, or the bytes of one card: GB / MB are powers of ten (24GB = 24 × "
                   "10^9 bytes, 22.4 GiB), GiB / MiB powers of two (22.5GiB). A card sold as '80 GB' offers less: "
                   "h100-80 is 79.1 GiB usable (default: %(default)s)")
    p.add_argument("--generations", type=int, default=8, help="completions per prompt, num_generations (8)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="rows per micro-batch, per_device_train_batch_size (default: --generations)")
    p.add_argument("--gradient-accumulation-steps", type=int, default=1,
                   help="micro-batches per optimizer step; > 1 keeps the gradients through the next forwards "
                   "(default: %(default)s)")
    p.add_argument("--steps-per-generation", type=int, default=None,
                   help="micro-batches generated at once (default: --gradient-accumulation-steps, as TRL)")
    p.add_argument("--completion-length", type=int, default=512, help="max_completion_length (default: 512)")
    p.add_argument("--prompt-length", type=int, default=256, help="longest prompt in tokens (default: 256)")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                   help="gradient checkpointing (on)")
    p.add_argument("--vllm", default="off", choices=["off", "colocate", "server"],
                   help="vLLM sampler: off (in-process generate), colocate, or server (on a second GPU)")
    p.add_argument("--vllm-gpu-memory-utilization", type=float, default=None,
                   help="the vLLM engine's share of its card, in (0, 1]: default 0.3 for a colocated engine (TRL's), "
                        "0.9 for a server (trl-fp8 vllm-serve's --gpu_memory_utilization)")
    p.add_argument("--vllm-max-model-length", type=int, default=None,
                   help="the vLLM engine's context (TRL's vllm_max_model_length; default: prompt + completion)")
    p.add_argument("--optim", default="adamw", choices=["adamw", "adamw_8bit"], help="optimizer state (adamw)")
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                   help="auto: bf16 where the card has it natively, else fp16 (T4)")
    p.add_argument("--base-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="dtype the weights are loaded in (default: float32 for full fine-tuning, 16-bit for LoRA)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the plan as JSON")
    out.add_argument("--markdown", action="store_true", help="print the plan as a Markdown table (for docs)")
    p.error = error
    return p


def _check(args, fail) -> None:
    """Each option's value on its own (``fail(message)`` raises), then the combinations the command decides."""
    from ..sync_checks.names import CHECKS as ALL
    from .models import LINEAR_NAMES

    for flag, limit in LIMITS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and not 1 <= value <= limit:
            fail(f"{flag} must be an integer from 1 to {limit}, got {value}.")
    if not (math.isfinite(args.beta) and 0 <= args.beta <= 1e6):
        fail(f"--beta must be a number from 0 to 1e6, got {args.beta}.")
    if args.vllm_gpu_memory_utilization is not None and not 0 < args.vllm_gpu_memory_utilization <= 1:  # nan, inf
        fail(f"--vllm-gpu-memory-utilization must be in (0, 1], got {args.vllm_gpu_memory_utilization}.")
    if not (math.isfinite(args.lora_dropout) and 0 <= args.lora_dropout < 1):
        fail(f"--lora-dropout must be a number in [0, 1), got {args.lora_dropout}.")
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if args.targets.strip() not in ("all-linear", "all") and (not targets or set(targets) - set(LINEAR_NAMES)):
        bad = ", ".join(t for t in targets if t not in LINEAR_NAMES) or repr(args.targets)
        fail(f"--targets: {bad} unknown; allowed: all-linear, or comma-separated {', '.join(LINEAR_NAMES)}.")
    checks = [c.strip() for c in args.sync_checks.split(",") if c.strip()]
    if args.sync_checks.strip() not in ("default", "all", "off") and (not checks or set(checks) - set(ALL)):
        bad = ", ".join(c for c in checks if c not in ALL) or repr(args.sync_checks)
        fail(f"--sync-checks: {bad} unknown; allowed: default, all, off, or comma-separated {', '.join(ALL)}.")
    if args.full and args.lora_r is not None:
        fail("--full and --lora-r: choose full fine-tuning or LoRA.")
    batch = args.batch_size or args.generations
    steps = args.steps_per_generation or args.gradient_accumulation_steps
    if (batch * steps) % args.generations:
        fail(f"--batch-size × --steps-per-generation ({batch * steps} rows) must be a multiple of --generations "
             f"({args.generations}), as GRPOConfig requires.")


def run(argv: list[str], usage_error: type[Exception]) -> int:
    """Parse, check, plan and print; a bad value raises ``usage_error`` with one line naming the option."""

    def fail(message: str):
        raise usage_error(message)

    args = build_parser(fail).parse_args(argv)
    _check(args, fail)
    from .devices import resolve_device
    from .models import resolve_model

    try:
        model = resolve_model(args.model)
    except ValueError as err:
        fail(f"--model: {err}")
    try:
        device = resolve_device(args.device)
    except ValueError as err:
        fail(f"--device: {err}")
    from .plan import FREE_TIER, plan_args
    from .suggest import memory_plan
    from .render import as_json, markdown, print_rich

    lora = args.qlora or args.lora_r is not None
    batch = args.batch_size or args.generations
    run_args = plan_args(**dict(
        FREE_TIER, fair_cast=args.fair_cast, lora_serving=args.lora_serving, sync_checks=args.sync_checks,
        duet=args.duet, fast_qlora=args.fast_qlora, beta=args.beta, num_generations=args.generations,
        per_device_train_batch_size=batch, gradient_accumulation_steps=args.gradient_accumulation_steps,
        steps_per_generation=args.steps_per_generation or args.gradient_accumulation_steps,
        max_completion_length=args.completion_length,
        precision=args.precision, vllm_max_model_length=args.vllm_max_model_length, **utilization(args)))
    try:
        plan = memory_plan(
            model, run_args, peft={"r": args.lora_r or 16, "target_modules": args.targets,
                                   "lora_dropout": args.lora_dropout} if lora else None,
            quantization="nf4" if args.qlora else None, device=device, prompt_length=args.prompt_length,
            base_dtype=args.base_dtype, vllm=args.vllm, gradient_checkpointing=args.gradient_checkpointing,
            optimizer=args.optim)
    except ValueError as err:
        fail(_flagged(str(err)))
    if args.json:
        print(as_json(plan))
    elif args.markdown:
        print(markdown(plan), end="")
    else:
        print_rich(plan)
    return 0


# The plan's own errors name its keyword arguments; on the command line, the options
_FLAGS = {"precision=": "--precision", "base_dtype=": "--base-dtype", "lora_serving=": "--lora-serving",
          "vllm=": "--vllm", "fair_cast with": "--fair-cast with", "optimizer=": "--optim"}


def _flagged(message: str) -> str:
    for name, flag in _FLAGS.items():
        if name in message:
            return message.replace(name, flag + (" " if name.endswith("=") else ""), 1)
    return message

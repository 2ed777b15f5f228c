"""``precision``: the mixed precision a run uses, decided for the GPU it actually got.

``precision="auto"`` picks bf16 on GPUs with native bf16 (compute capability >= 8.0: A100, L4, H100, RTX 30xx and
later), fp16 autocast over fp32 master weights on older ones (T4, V100: sm_75, sm_70) and fp32 on CPU. It reads the
compute capability, never ``torch.cuda.is_bf16_supported()``, which answers True on a T4 through emulation (slow, and
a vLLM engine refuses bf16 below 8.0). With fp16 it also starts a colocated vLLM engine with ``dtype="half"`` (TRL
passes no dtype, so vLLM would take the checkpoint's bf16) and makes Fair Cast's served copy float16.

It is resolved in :meth:`trl_fp8.GRPOConfig.__post_init__` *before* TRL's and transformers' own ``__post_init__``
(TRL turns an unset ``bf16`` into True; transformers then checks it against the device and derives
``mixed_precision``), by setting ``bf16``/``fp16``. ``precision=None`` (the default) leaves both as given: TRL's
behaviour.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from .sampling import vllm_dtype, vllm_mode  # noqa: F401 (vllm_dtype: the dtype a colocated engine is started with)

logger = logging.getLogger("trl_fp8.precision")
PRECISIONS = ("auto", "bf16", "fp16", "fp32")
NATIVE_BF16 = (8, 0)  # the lowest CUDA compute capability with native bf16 (Ampere)
_logged: set[str] = set()


@dataclass
class PrecisionArgs:
    precision: str | None = field(
        default=None,
        metadata={"help": "trl_fp8: mixed precision: 'auto' (bf16 where the GPU has native bf16, compute capability "
                  ">= 8.0; fp16 autocast over fp32 master weights on older GPUs such as T4/V100, with a float16 vLLM "
                  "engine and Fair Cast copy; fp32 on CPU), 'bf16', 'fp16' or 'fp32'. None (default): `bf16`/`fp16` "
                  "as given (TRL's behaviour)."},
    )


def cuda_devices() -> list[tuple[str, tuple[int, int]]]:
    """(name, compute capability) of each visible CUDA device; empty without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [(torch.cuda.get_device_name(i), tuple(torch.cuda.get_device_capability(i)))
            for i in range(torch.cuda.device_count())]


def _other_accelerator() -> str | None:
    import torch

    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return "xpu"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return None


def _use_cpu(args) -> bool:
    env = os.environ.get("ACCELERATE_USE_CPU", "").strip().lower() in ("1", "true", "yes", "on")
    return bool(getattr(args, "use_cpu", False)) or env


def decide(args) -> tuple[str | None, str]:
    """What ``precision='auto'`` means on this machine: ``("bf16" | "fp16" | "fp32" | None, why)``; None: a non-CUDA
    accelerator, where TRL's own default is kept."""
    if _use_cpu(args):
        return "fp32", "use_cpu=True"
    gpus = cuda_devices()
    if not gpus:
        other = _other_accelerator()
        if other is not None:
            return None, f"it decides for CUDA GPUs and CPUs only; on {other} TRL's bf16/fp16 fields apply"
        return "fp32", "no CUDA GPU"
    name, cc = min(gpus, key=lambda g: g[1])  # every rank of a mixed node must decide alike: the weakest GPU
    text = f"{name} (compute capability {cc[0]}.{cc[1]})"
    if cc >= NATIVE_BF16:
        return "bf16", f"{text} has native bf16"
    return "fp16", f"{text} has no native bf16 (it needs 8.0)"


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info(message)


# The x86-64 CPU features with which torch computes bf16 natively (AVX512-BF16, AMX); without one it emulates bf16
# through fp32 conversions.
CPU_BF16_FEATURES = ("avx512_bf16", "amx_bf16")


def cpu_has_native_bf16() -> bool | None:
    """Whether this CPU computes bf16 natively (None: not known — its features cannot be read, or it is not x86-64,
    whose bf16 feature names this does not read)."""
    import platform

    from .native import vector_extensions

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    features = set(vector_extensions())
    if not features:
        return None
    return any(f in features for f in CPU_BF16_FEATURES)


def _warn_emulated_cpu_bf16(args) -> None:
    """bf16 autocast on a CPU run (TRL's default ``bf16=True``, or asked) where the CPU has no native bf16: said once,
    with the way out. Measured on an AVX2-only CPU (AMD EPYC, 2 threads): SmolLM2-135M with LoRA r=16, 4 sequences of
    112 tokens, backward 88 s in bf16 against 2 s in fp32 (forward 7.7 s against 1.6 s)."""
    if args.bf16 is False or cpu_has_native_bf16() is not False:
        return
    if not (_use_cpu(args) or (not cuda_devices() and _other_accelerator() is None)):
        return
    message = ("bf16 autocast on a CPU without native bf16 (no AVX512-BF16 or AMX here): torch emulates it, and a "
               "step is many times slower than in fp32 (a LoRA backward on SmolLM2-135M measured 40x slower on an "
               "AVX2 CPU). precision='auto' (or bf16=False) trains in fp32 on a CPU.")
    if message not in _logged:
        _logged.add(message)
        logger.warning(message)


def resolve_precision(args, capabilities=()) -> str | None:
    """Resolve ``args.precision`` into ``args.bf16`` / ``args.fp16`` (and what ``capabilities`` adapt to it through
    :meth:`~trl_fp8.capability.Capability.adapt_precision`, e.g. Fair Cast's ``served_dtype``), before TRL's
    ``__post_init__``. Returns the precision used, or None where TRL's fields apply unchanged. A ``bf16`` or ``fp16``
    given explicitly that contradicts it raises a ``ValueError`` naming both fields."""
    asked = args.precision
    if asked is None:  # TRL's behaviour: an unset bf16 becomes True, on a CPU too
        _warn_emulated_cpu_bf16(args)
        return None
    from .capability import check_choice  # here: the plan reads PrecisionArgs without torch

    check_choice("precision", asked, PRECISIONS)
    if asked == "auto":
        resolved, why = decide(args)
    else:
        resolved, why = asked, "as asked"
    if resolved is None:
        _log_once(f"precision='auto': {why}.")
        return None
    bf16, fp16 = resolved == "bf16", resolved == "fp16"
    where = f"precision={asked!r} means {resolved} here ({why})"
    if args.bf16 is not None and bool(args.bf16) != bf16:
        raise ValueError(f"{where}, but bf16={args.bf16!r} was given: drop bf16 (precision sets it), or set "
                         "precision=None to use bf16/fp16 as given.")
    if args.fp16 and not fp16:
        raise ValueError(f"{where}, but fp16=True was given: drop fp16 (precision sets it), or set precision=None "
                         "to use bf16/fp16 as given.")
    args.bf16, args.fp16 = bf16, fp16
    if bf16:
        _warn_emulated_cpu_bf16(args)
    notes = {"bf16": "bf16 autocast (bf16=True)", "fp16": "fp16 autocast over fp32 master weights (fp16=True)",
             "fp32": "fp32 (bf16=False, fp16=False)"}[resolved]
    for capability in capabilities:  # declared per capability (e.g. Fair Cast serves fp16 under fp16)
        note = capability.adapt_precision(args, resolved)
        if note:
            notes += f", {note}"
    if fp16:
        vllm = vllm_mode(args)
        if vllm != "off":
            notes += (", a colocated vLLM engine in dtype 'half'" if vllm == "colocate"
                      else "; start the vLLM server with `trl vllm-serve --dtype half`")
    if asked == "bf16" and not _use_cpu(args):
        slow = [name for name, cc in cuda_devices() if cc < NATIVE_BF16]
        if slow:
            logger.warning("precision='bf16' on %s, which has no native bf16 (compute capability < 8.0): torch "
                           "emulates it (slowly) and vLLM refuses it; precision='auto' would use fp16.", slow[0])
    _log_once(f"precision={asked!r}: {why} -> {notes}.")
    return resolved



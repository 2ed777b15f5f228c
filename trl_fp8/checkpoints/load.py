"""Loading a checkpoint's trl_fp8 parts: each capability's state, the data order of the resumed epoch and TRL's
generation buffer (transformers loads the model, optimizer, scheduler and RNG)."""

from __future__ import annotations

import logging
import math
import os

import torch

from .. import _trl
from .layout import generation_state_file
from .settings import missing_message

logger = logging.getLogger("trl_fp8.checkpoints")


def _to_device(obj, device):
    if torch.is_tensor(obj):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


def _load(path: str, checkpoint: str, what: str):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - truncated, corrupt, or not a weights-only pickle: say which file
        raise ValueError(f"Cannot resume from {checkpoint}: {what} ({os.path.basename(path)}) does not load "
                         f"({type(err).__name__}: {err}). Resume from another checkpoint.") from err


def load_states(trainer, checkpoint: str) -> None:
    """Restore each running capability's state, the data order of the resumed epoch and TRL's generation buffer from
    ``checkpoint``."""
    for capability in trainer.capabilities.values():
        if capability.state_file is None:
            continue
        path = os.path.join(checkpoint, capability.state_file)
        if not os.path.isfile(path):
            if not capability.state_required:
                logger.warning("%s: %s has no %s; it starts afresh.", capability.name, checkpoint,
                               capability.state_file)
                continue
            raise ValueError(missing_message(capability.name, capability.state_file, checkpoint))
        capability.load_state_dict(_load(path, checkpoint, f"the {capability.name} state"))
    for capability in trainer.capabilities.values():  # every process: files it wrote itself (e.g. a rank's shard)
        capability.load_process_files(trainer, checkpoint)
    # the data order of the resumed epoch (trainer.state is the checkpoint's by now; transformers' epochs_trained)
    _trl.advance_train_sampler(getattr(trainer, "_train_sampler", None), math.floor(trainer.state.epoch or 0))
    path = os.path.join(checkpoint, generation_state_file(trainer.args))
    if os.path.isfile(path):
        state = _load(path, checkpoint, "TRL's generation buffer")
        device = trainer.accelerator.device
        _trl.restore_generation_buffer(trainer, state if device.type == "cpu" else _to_device(state, device))

"""The names of what a run folder and a checkpoint folder hold (no I/O here)."""

from __future__ import annotations

import os
import re

MARKER = "trl_fp8_complete.json"  # written last: the folder is complete
SETTINGS = "trl_fp8_settings.json"  # the trl_fp8 settings a resume must match
GENERATION_STATE = "grpo_generation_state.pt"  # TRL's generation buffer between two generations (per process)
TRAINER_STATE = "trainer_state.json"
OWNER = "trl_fp8_owner.json"  # in a staging folder while a process writes it (see trl_fp8.checkpoints.staging)
# Transient folders (being written, replaced or deleted): same filesystem as the checkpoints, for atomic renames; the
# leading underscore keeps them out of transformers' background Hub upload of output_dir (it ignores "_*").
TMP_PREFIX = "_tmp-"
FORMAT = 1
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
TMP_CHECKPOINT = re.compile(r"^_tmp-checkpoint-(\d+)$")
TMP_REPLACED_CHECKPOINT = re.compile(r"^_tmp-replaced-checkpoint-(\d+)$")  # the previous copy, during a commit
TMP_CLAIM = TMP_PREFIX + "claim-"  # a staging folder being created with its owner file (renamed at once)
MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
               "adapter_model.safetensors", "adapter_model.bin")


def step_of(path: str) -> int | None:
    """N of a ``checkpoint-N`` folder, else None."""
    m = CHECKPOINT.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def generation_state_file(args) -> str:
    """This process's file for TRL's generation buffer (one per process with several)."""
    if args.world_size <= 1:
        return GENERATION_STATE
    stem, ext = os.path.splitext(GENERATION_STATE)
    return f"{stem}_{args.process_index}{ext}"


def generation_files(checkpoint: str) -> list[str]:
    """The generation-buffer files in ``checkpoint`` (one per process that wrote one)."""
    stem, ext = os.path.splitext(GENERATION_STATE)
    pattern = re.compile(rf"^{re.escape(stem)}(_\d+)?{re.escape(ext)}$")
    return sorted(name for name in os.listdir(checkpoint) if pattern.match(name))

"""Completeness: whether a folder is a checkpoint a run can resume from, and the checkpoints of a run folder."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from .layout import CHECKPOINT, MARKER, MODEL_FILES, TRAINER_STATE, step_of


@dataclass(frozen=True)
class Verdict:
    complete: bool
    reason: str = ""  # why not (or, complete, how it was judged)
    marked: bool = False  # written by trl_fp8 with a completion marker


def check_complete(folder: str) -> Verdict:
    """Whether ``folder`` is a complete checkpoint (see :mod:`trl_fp8.checkpoints` for the rule)."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        return Verdict(False, "it is not a folder")
    marker = os.path.join(folder, MARKER)
    if os.path.isfile(marker):
        try:
            with open(marker, encoding="utf-8") as f:
                listed = json.load(f)["files"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            return Verdict(False, f"its completion marker {MARKER} is unreadable ({err})", marked=True)
        if not isinstance(listed, dict) or not all(isinstance(k, str) and type(v) is int for k, v in listed.items()):
            return Verdict(False, f"its completion marker {MARKER} does not list files with their sizes", marked=True)
        for rel, size in listed.items():
            path = os.path.join(folder, *rel.split("/"))
            if not os.path.isfile(path):
                return Verdict(False, f"{rel} is missing", marked=True)
            if os.path.getsize(path) != size:
                return Verdict(False, f"{rel} has {os.path.getsize(path)} bytes, {size} were written", marked=True)
        return Verdict(True, "completion marker", marked=True)
    # written without a marker (plain TRL/transformers): trainer_state.json is written after the other files
    state = os.path.join(folder, TRAINER_STATE)
    if not os.path.isfile(state):
        return Verdict(False, f"no {TRAINER_STATE} (it was being written when the run stopped)")
    try:
        with open(state, encoding="utf-8") as f:
            global_step = json.load(f).get("global_step")
    except (OSError, ValueError, AttributeError, TypeError) as err:
        return Verdict(False, f"{TRAINER_STATE} is unreadable ({err})")
    step = step_of(folder)
    if step is not None and global_step != step:
        return Verdict(False, f"{TRAINER_STATE} is for step {global_step}")
    entries = os.listdir(folder)
    if not any(name in entries for name in MODEL_FILES) and not any(
            os.path.isdir(os.path.join(folder, name)) for name in entries):
        return Verdict(False, "no model or adapter weights")
    return Verdict(True, f"no {MARKER} (not written by trl_fp8): judged by {TRAINER_STATE} and the weights")


def checkpoints_in(run_dir: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every ``checkpoint-N`` folder in ``run_dir``, newest (highest step) first."""
    if not os.path.isdir(run_dir):
        return []
    found = []
    for name in os.listdir(run_dir):
        m = CHECKPOINT.match(name)
        if m and os.path.isdir(os.path.join(run_dir, name)):
            found.append((int(m.group(1)), os.path.join(run_dir, name)))
    return sorted(found, reverse=True)

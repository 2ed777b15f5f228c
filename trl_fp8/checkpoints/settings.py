"""The settings a resume must match: the trl_fp8 fields that shape a run's state (each capability's
``resume_fields``), and the number of processes when a checkpoint holds TRL's per-process generation buffer."""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, fields

from .layout import GENERATION_STATE, SETTINGS, generation_files


def _capability_classes():
    from ..registry import CAPABILITIES

    return CAPABILITIES


def _jsonable(value):
    return json.loads(json.dumps(value, default=str))


def settings_of(args) -> dict:
    """The trl_fp8 settings that shape a run's state (each capability's ``resume_fields``), as JSON values."""
    out = {}
    for cls in _capability_classes():
        for name in cls.resume_fields:
            if hasattr(args, name):
                out[name] = _jsonable(getattr(args, name))
    return out


def _field_defaults() -> dict:
    defaults = {}
    for cls in _capability_classes():
        for f in fields(cls.Args) if cls.Args is not None else ():
            if f.default is not MISSING:
                defaults[f.name] = _jsonable(f.default)
            elif f.default_factory is not MISSING:
                defaults[f.name] = _jsonable(f.default_factory())
    return defaults


def settings_differences(saved: dict, args) -> list[str]:
    """What differs between a checkpoint's :data:`SETTINGS` fields and this run's, one line per field, for each
    capability on in either. A field the checkpoint has no record of (written before the field existed) is compared
    with its default."""
    from types import SimpleNamespace

    defaults = _field_defaults()
    out = []
    for cls in _capability_classes():
        names = [n for n in cls.resume_fields if hasattr(args, n) and (n in saved or n in defaults)]
        before = {n: saved[n] if n in saved else defaults[n] for n in names}
        now = {n: _jsonable(getattr(args, n)) for n in names}
        if not cls.wanted(args) and not cls.wanted(SimpleNamespace(**before)):
            continue
        out += [f"{n}={before[n]!r} in the checkpoint, {n}={now[n]!r} in this run" for n in names
                if before[n] != now[n]]
    return out


def check_world_size(saved_world_size: int | None, checkpoint: str, world_size: int) -> None:
    """Refuse a checkpoint saved between two generations by another number of processes: TRL's generation buffer is
    per process (each rank's own micro-batches), so more processes would have ranks generate (collectives) while the
    others replay their buffer — a hang — and fewer would train on another rank's batches without a word. A
    checkpoint at a generation boundary holds no buffer and resumes with any number of processes."""
    buffers = generation_files(checkpoint)
    if not buffers:
        return
    if saved_world_size is None:  # written before the world size was recorded: the buffer files tell
        saved_world_size = 1 if buffers == [GENERATION_STATE] else len(buffers)
    if saved_world_size != world_size:
        raise ValueError(
            f"Cannot resume from {checkpoint} with {world_size} process(es): it was saved by {saved_world_size} "
            f"between two generations, and TRL's generation buffer ({', '.join(buffers)}) belongs to each of those "
            f"processes. Resume with {saved_world_size} process(es), or from a checkpoint saved at a generation "
            "boundary (one with no grpo_generation_state file)."
        )


def _read_settings(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"Cannot resume from {os.path.dirname(path)}: its {SETTINGS} is unreadable ({err}). Resume "
                         "from another checkpoint, or train into a new output_dir.") from err
    if not isinstance(saved, dict) or not isinstance(saved.get("fields", {}), dict):
        raise ValueError(f"Cannot resume from {os.path.dirname(path)}: its {SETTINGS} is not a trl_fp8 settings "
                         "record (a JSON object with 'fields').")
    return saved


def check_settings(trainer, checkpoint: str) -> None:
    """Refuse (``ValueError`` naming each field) a checkpoint written with other state-shaping trl_fp8 settings or,
    between two generations, by another number of processes; for one without :data:`SETTINGS`, refuse when a running
    capability's state file is missing."""
    path = os.path.join(checkpoint, SETTINGS)
    settings = _read_settings(path) if os.path.isfile(path) else None
    check_world_size(None if settings is None else settings.get("world_size"), checkpoint, trainer.args.world_size)
    if settings is not None:
        saved = settings.get("fields", {})
        differences = settings_differences(saved, trainer.args)
        if differences:
            raise ValueError(
                f"Cannot resume from {checkpoint}: it was written with other trl_fp8 settings ("
                + "; ".join(differences) + "). Resume with the checkpoint's settings, or train into a new output_dir."
            )
        return
    missing = missing_state_files(trainer, checkpoint)
    if missing:
        capability, state_file = missing[0]
        raise ValueError(missing_message(capability, state_file, checkpoint))


def missing_message(capability: str, state_file: str, checkpoint: str) -> str:
    return (f"Resuming with {capability} on from {checkpoint}, which has no {state_file} (written without "
            f"{capability}, or its save was interrupted): its state cannot be restored. Resume with the {capability} "
            "settings the checkpoint was written with, or from a complete checkpoint.")


def missing_state_files(trainer, checkpoint: str) -> list[tuple[str, str]]:
    """``(capability, state_file)`` of each running capability whose required state file ``checkpoint`` lacks."""
    return [(c.name, c.state_file) for c in trainer.capabilities.values()
            if c.state_file is not None and c.state_required
            and not os.path.isfile(os.path.join(checkpoint, c.state_file))]

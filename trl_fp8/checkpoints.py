"""Checkpoints that are never half-written, and resuming from the newest complete one.

**Writing** (:func:`save_checkpoint`, what :meth:`trl_fp8.GRPOTrainer._save_checkpoint` runs). Everything of a
checkpoint — what TRL and transformers write (model or adapter, optimizer, scheduler, scaler, RNG, trainer state
with its stateful callbacks, TRL's model card and entropy controller), each running capability's ``state_file``,
TRL's generation buffer when the checkpoint falls between two generations, and :data:`SETTINGS` (the trl_fp8
settings a resume must match) — is written into ``<run_dir>/_tmp-checkpoint-N`` (same filesystem). Every file and
folder in it is fsync'd, then the completion marker :data:`MARKER` (every file with its size) is written and
fsync'd last, then the folder is renamed to ``checkpoint-N`` (an existing ``checkpoint-N`` is first renamed aside and
removed after) and the run folder is fsync'd. Only then does the Hub push start and older checkpoints rotate out;
rotation counts complete checkpoints only, never removes the one just written, and renames a folder aside before
deleting it, so a kill during rotation never leaves a checkpoint that looks complete but is not.

A kill at any moment therefore leaves either the previous checkpoints untouched plus a ``_tmp-*`` folder, or the new
checkpoint complete. At the next :meth:`~trl_fp8.GRPOTrainer.train`, ``_tmp-*`` folders are removed — except a
``_tmp-checkpoint-N`` whose marker is complete while ``checkpoint-N`` is missing (killed between marker and rename):
that one is renamed into place.

**Reading** (:func:`prepare_resume`, what :meth:`trl_fp8.GRPOTrainer.train` runs first).
``resume_from_checkpoint="auto"`` (also read from ``args.resume_from_checkpoint`` when ``train()`` gets no argument)
takes the newest complete checkpoint, else the one before (with a warning naming what was skipped and why), else
starts fresh. ``True`` does the same but, as in transformers, raises when there is none. A path is used as given,
but refused when incomplete. Any checkpoint is refused (``ValueError`` naming the field) when trl_fp8 settings that
shape the run's state differ from this run's (each capability lists them in ``resume_fields``).

**Completeness.** A folder with :data:`MARKER` is complete when every file it lists is there with its size. A folder
without one (written by plain TRL/transformers, or by an earlier trl_fp8) is taken as complete when its
``trainer_state.json`` reads back with the folder's step and a model/adapter file (or a DeepSpeed/FSDP state folder)
is there — transformers writes ``trainer_state.json`` after the model, optimizer, scheduler and RNG files — and, for
``"auto"``/``True``, when it holds the state file of every capability this run needs (trl_fp8 wrote those after
``trainer_state.json``).
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import shutil
import sys
from dataclasses import MISSING, dataclass, fields

import torch

from . import _trl

logger = logging.getLogger("trl_fp8.checkpoints")

MARKER = "trl_fp8_complete.json"  # written last: the folder is complete
SETTINGS = "trl_fp8_settings.json"  # the trl_fp8 settings a resume must match
GENERATION_STATE = "grpo_generation_state.pt"  # TRL's generation buffer between two generations (per process)
TRAINER_STATE = "trainer_state.json"
# Transient folders (being written, replaced or deleted): same filesystem as the checkpoints, for atomic renames; the
# leading underscore keeps them out of transformers' background Hub upload of output_dir (it ignores "_*").
TMP_PREFIX = "_tmp-"
FORMAT = 1
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_TMP_CHECKPOINT = re.compile(r"^_tmp-checkpoint-(\d+)$")
_MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
                "adapter_model.safetensors", "adapter_model.bin")


# -- durable writes -----------------------------------------------------------------------------------------------
def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# What a filesystem answers when it cannot fsync a folder at all (not a failed write): skipped, like Windows.
_FSYNC_UNSUPPORTED = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EISDIR}


def _fsync_dir(path: str) -> None:
    """fsync a folder (its entries: new, renamed and removed names). A no-op where folders cannot be opened or the
    filesystem does not support it; any other error (EIO: the entries may not be on disk) is raised, naming it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. Windows
        return
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in _FSYNC_UNSUPPORTED:
            raise OSError(err.errno, f"fsync of the folder {path} failed ({err.strerror}): what was written or "
                          "renamed in it may not be on disk") from err
    finally:
        os.close(fd)


def _remove_tree(path: str, why: str) -> bool:
    """``shutil.rmtree`` that says so when it fails (a warning naming the folder and the error: the disk would
    otherwise fill silently with checkpoints that were meant to be gone). Returns whether it is gone."""
    if not os.path.lexists(path):
        return True
    failures = []
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=lambda _fn, where, exc: failures.append(f"{where}: {exc}"))
    else:
        shutil.rmtree(path, onerror=lambda _fn, where, info: failures.append(f"{where}: {info[1]}"))
    if failures or os.path.lexists(path):
        logger.warning("trl_fp8: could not remove %s (%s): %s. It takes disk space until it is deleted by hand.",
                       path, why, "; ".join(failures[:3]) or "still there")
        return False
    return True


def _listing(folder: str) -> dict[str, int]:
    """Every file under ``folder`` (relative POSIX path -> size), the marker excepted."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder).replace(os.sep, "/")
            if rel != MARKER:
                out[rel] = os.path.getsize(path)
    return dict(sorted(out.items()))


def _sync_tree(folder: str) -> None:
    for root, dirs, files in os.walk(folder, topdown=False):
        for name in files:
            _fsync_file(os.path.join(root, name))
        _fsync_dir(root)


def _write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def commit(tmp: str, final: str) -> None:
    """Make ``tmp`` the complete checkpoint ``final``: fsync every file and folder, write the marker last, rename."""
    _sync_tree(tmp)
    step = _step_of(final)
    _write_json(os.path.join(tmp, MARKER), {"format": FORMAT, "global_step": step, "files": _listing(tmp)})
    _fsync_dir(tmp)
    run_dir = os.path.dirname(final)
    aside = None
    if os.path.lexists(final):  # the same step saved again (e.g. a save on a stop signal after a scheduled one)
        aside = os.path.join(run_dir, f"{TMP_PREFIX}replaced-{os.path.basename(final)}")
        if os.path.lexists(aside):
            shutil.rmtree(aside)
        os.rename(final, aside)
    os.rename(tmp, final)
    _fsync_dir(run_dir)
    if aside is not None:
        _remove_tree(aside, f"the replaced copy of {os.path.basename(final)}")
        _fsync_dir(run_dir)


def remove_checkpoint(path: str) -> None:
    """Delete a checkpoint folder without ever leaving a complete-looking partial one: rename it aside, then delete."""
    aside = os.path.join(os.path.dirname(path), f"{TMP_PREFIX}deleting-{os.path.basename(path)}")
    try:
        if os.path.lexists(aside):
            shutil.rmtree(aside)
        os.rename(path, aside)
        _fsync_dir(os.path.dirname(path))
    except OSError:
        aside = path
    _remove_tree(aside, f"rotating out {os.path.basename(path)}")


# -- completeness -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Verdict:
    complete: bool
    reason: str = ""  # why not (or, complete, how it was judged)
    marked: bool = False  # written by trl_fp8 with a completion marker


def _step_of(path: str) -> int | None:
    m = _CHECKPOINT.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def check_complete(folder: str) -> Verdict:
    """Whether ``folder`` is a complete checkpoint (see the module docstring for the rule)."""
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
    step = _step_of(folder)
    if step is not None and global_step != step:
        return Verdict(False, f"{TRAINER_STATE} is for step {global_step}")
    entries = os.listdir(folder)
    if not any(name in entries for name in _MODEL_FILES) and not any(
            os.path.isdir(os.path.join(folder, name)) for name in entries):
        return Verdict(False, "no model or adapter weights")
    return Verdict(True, f"no {MARKER} (not written by trl_fp8): judged by {TRAINER_STATE} and the weights")


def checkpoints_in(run_dir: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every ``checkpoint-N`` folder in ``run_dir``, newest (highest step) first."""
    if not os.path.isdir(run_dir):
        return []
    found = []
    for name in os.listdir(run_dir):
        m = _CHECKPOINT.match(name)
        if m and os.path.isdir(os.path.join(run_dir, name)):
            found.append((int(m.group(1)), os.path.join(run_dir, name)))
    return sorted(found, reverse=True)


def clean_stale(run_dir: str) -> list[str]:
    """Remove the ``_tmp-*`` folders a killed save or rotation left in ``run_dir``; a ``_tmp-checkpoint-N`` that is
    complete while ``checkpoint-N`` is missing (killed between the marker and the rename) is renamed into place.
    Returns what was done, one line each."""
    done = []
    if not os.path.isdir(run_dir):
        return done
    for name in sorted(os.listdir(run_dir)):
        path = os.path.join(run_dir, name)
        if not name.startswith(TMP_PREFIX) or not os.path.isdir(path):
            continue
        m = _TMP_CHECKPOINT.match(name)
        final = os.path.join(run_dir, f"checkpoint-{m.group(1)}") if m else None
        verdict = check_complete(path) if final is not None and not os.path.lexists(final) else None
        if verdict is not None and verdict.complete and verdict.marked:
            os.rename(path, final)
            _fsync_dir(run_dir)
            done.append(f"completed the interrupted save of {os.path.basename(final)}")
            continue
        if _remove_tree(path, "left by an interrupted save or rotation"):
            done.append(f"removed {name}, left by an interrupted save or rotation")
    if done:
        _fsync_dir(run_dir)
    return done


# -- settings a resume must match ---------------------------------------------------------------------------------
def _capability_classes():
    from .registry import CAPABILITIES

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


def _generation_files(checkpoint: str) -> list[str]:
    stem, ext = os.path.splitext(GENERATION_STATE)
    pattern = re.compile(rf"^{re.escape(stem)}(_\d+)?{re.escape(ext)}$")
    return sorted(name for name in os.listdir(checkpoint) if pattern.match(name))


def check_world_size(saved_world_size: int | None, checkpoint: str, world_size: int) -> None:
    """Refuse a checkpoint saved between two generations by another number of processes: TRL's generation buffer is
    per process (each rank's own micro-batches), so more processes would have ranks generate (collectives) while the
    others replay their buffer — a hang — and fewer would train on another rank's batches without a word. A
    checkpoint at a generation boundary holds no buffer and resumes with any number of processes."""
    buffers = _generation_files(checkpoint)
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
    missing = _missing_state_files(trainer, checkpoint)
    if missing:
        capability, state_file = missing[0]
        raise ValueError(_missing_message(capability, state_file, checkpoint))


def _missing_message(capability: str, state_file: str, checkpoint: str) -> str:
    return (f"Resuming with {capability} on from {checkpoint}, which has no {state_file} (written without "
            f"{capability}, or its save was interrupted): its state cannot be restored. Resume with the {capability} "
            "settings the checkpoint was written with, or from a complete checkpoint.")


def _missing_state_files(trainer, checkpoint: str) -> list[tuple[str, str]]:
    return [(c.name, c.state_file) for c in trainer.capabilities.values()
            if c.state_file is not None and c.state_required
            and not os.path.isfile(os.path.join(checkpoint, c.state_file))]


# -- resume -------------------------------------------------------------------------------------------------------
def newest_complete(trainer, run_dir: str) -> tuple[str | None, list[str]]:
    """The newest complete checkpoint in ``run_dir`` this run can resume from, and a line for each newer one skipped.

    A checkpoint without :data:`MARKER` and :data:`SETTINGS` that lacks a running capability's state file is skipped
    too (trl_fp8 before atomic checkpoints wrote those after ``trainer_state.json``)."""
    skipped = []
    for _, path in checkpoints_in(run_dir):
        verdict = check_complete(path)
        if verdict.complete and not verdict.marked and not os.path.isfile(os.path.join(path, SETTINGS)):
            missing = _missing_state_files(trainer, path)
            if missing:
                verdict = Verdict(False, f"no {missing[0][1]} (incomplete, or written without {missing[0][0]})")
        if verdict.complete:
            return path, skipped
        skipped.append(f"{os.path.basename(path)} ({verdict.reason})")
    return None, skipped


def prepare_resume(trainer, resume_from_checkpoint, trial=None):
    """What ``Trainer.train`` should resume from: None (fresh) or a complete checkpoint's path.

    Removes what interrupted saves left (see :func:`clean_stale`) on the saving process(es) first."""
    args = trainer.args
    if resume_from_checkpoint is None and getattr(args, "resume_from_checkpoint", None) == "auto":
        resume_from_checkpoint = "auto"
    run_dir = _trl.run_dir(trainer, trial)
    if args.should_save:
        for line in clean_stale(run_dir):
            logger.warning("%s: %s", run_dir, line)
    trainer.accelerator.wait_for_everyone()
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True or resume_from_checkpoint == "auto":
        how = "True" if resume_from_checkpoint is True else "'auto'"
        path, skipped = newest_complete(trainer, run_dir)
        if path is None:
            why = f" (skipped: {'; '.join(skipped)})" if skipped else ""
            if resume_from_checkpoint is True:
                raise ValueError(f"No valid checkpoint found in output directory ({run_dir}){why}")
            (logger.warning if skipped else logger.info)(
                "resume_from_checkpoint='auto': no complete checkpoint in %s%s; starting fresh.", run_dir, why)
            return None
        if skipped:
            logger.warning("resume_from_checkpoint=%s: skipping %s; resuming from %s.", how, "; ".join(skipped),
                           os.path.basename(path))
        else:
            logger.info("resume_from_checkpoint=%s: resuming from %s.", how, path)
    else:
        path = os.fspath(resume_from_checkpoint)
        verdict = check_complete(path)
        if not verdict.complete:
            raise ValueError(
                f"Cannot resume from {path}: it is not a complete checkpoint ({verdict.reason}). Use "
                "resume_from_checkpoint='auto' to take the newest complete checkpoint of output_dir."
            )
    check_settings(trainer, path)
    return path


def finished_run(trainer, checkpoint: str | None):
    """When ``checkpoint`` is already at ``max_steps`` (a finished run started again, e.g. "Run all" once more):
    load it (weights, trainer state, capability states) and return a ``TrainOutput`` without training; else None.

    transformers resumes such a checkpoint by training one step past ``max_steps`` (its loop checks the limit only
    after a step) — each new session would add a step. With DeepSpeed or FSDP (whose weights load after
    ``accelerator.prepare``) that is left to transformers, with a warning."""
    args = trainer.args
    if checkpoint is None or args.max_steps is None or args.max_steps <= 0:
        return None
    from transformers.trainer_callback import TrainerState
    from transformers.trainer_utils import TrainOutput

    state = TrainerState.load_from_json(os.path.join(checkpoint, TRAINER_STATE))
    if state.global_step < args.max_steps:
        return None
    if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        logger.warning("%s is at step %d of max_steps=%d: training is complete; with DeepSpeed/FSDP transformers "
                       "trains one more step when resuming it.", checkpoint, state.global_step, args.max_steps)
        return None
    logger.warning("%s is at step %d of max_steps=%d: training is complete, nothing to train; the trainer holds its "
                   "weights.", checkpoint, state.global_step, args.max_steps)
    _trl.load_model_from_checkpoint(trainer, checkpoint)
    trainer.state = state
    load_states(trainer, checkpoint)
    return TrainOutput(state.global_step, float("nan"), {})


# -- save ---------------------------------------------------------------------------------------------------------
def _generation_state_file(args) -> str:
    if args.world_size <= 1:
        return GENERATION_STATE
    stem, ext = os.path.splitext(GENERATION_STATE)
    return f"{stem}_{args.process_index}{ext}"


def save_checkpoint(trainer, trial) -> str:
    """Write ``checkpoint-<global_step>`` atomically (see the module docstring); push and rotate after. Every process
    calls it. Returns the checkpoint's path."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    args = trainer.args
    run_dir = _trl.run_dir(trainer, trial)
    name = f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    final = os.path.join(run_dir, name)
    tmp = os.path.join(run_dir, TMP_PREFIX + name)
    committer = args.should_save and not _storage_shared_with_main(trainer, run_dir)
    if committer:
        os.makedirs(run_dir, exist_ok=True)
        if os.path.lexists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    trainer.accelerator.wait_for_everyone()
    _trl.write_checkpoint_files(trainer, tmp, run_dir, trial)
    buffer = _trl.generation_buffer(trainer)
    if buffer is not None:  # every process holds its own
        os.makedirs(tmp, exist_ok=True)
        torch.save(buffer, os.path.join(tmp, _generation_state_file(args)))
    for capability in trainer.capabilities.values():  # per-process files (e.g. a rank's shard state), staged too
        capability.save_process_files(trainer, tmp)
    if committer:
        for capability in trainer.capabilities.values():
            state = capability.state_dict()
            if state is not None and capability.state_file is not None:
                torch.save(state, os.path.join(tmp, capability.state_file))
        from . import __version__

        _write_json(os.path.join(tmp, SETTINGS), {"format": FORMAT, "trl_fp8": __version__,
                                                  "capabilities": sorted(trainer.capabilities),
                                                  "world_size": args.world_size, "fields": settings_of(args)})
    trainer.accelerator.wait_for_everyone()  # every process has written its files
    if committer:
        commit(tmp, final)
    trainer.accelerator.wait_for_everyone()
    if args.push_to_hub:
        _trl.push_checkpoint(trainer, final)
    if committer:
        rotate(run_dir, args.save_total_limit, trainer.state.best_model_checkpoint, final)
    return final


def _storage_shared_with_main(trainer, run_dir: str) -> bool:
    """With ``save_on_each_node=True`` each node's first process saves — right for node-local disks, but on storage
    every node shares it would stage, commit and rotate the same checkpoint once per node (the second commit finds
    its staging folder renamed away). The main process leaves a token file in ``run_dir``; a node's saver that sees
    it shares the main process's storage and leaves the commit to it. False without ``save_on_each_node``, on the
    main process, and with one process."""
    args = trainer.args
    if not getattr(args, "save_on_each_node", False) or args.world_size <= 1:
        return False
    import uuid

    from accelerate.utils import broadcast_object_list

    main = args.process_index == 0
    token = [uuid.uuid4().hex if main else None]
    broadcast_object_list(token, from_process=0)
    probe = os.path.join(run_dir, f"{TMP_PREFIX}storage-{token[0]}")
    if main:
        os.makedirs(run_dir, exist_ok=True)
        with open(probe, "w", encoding="utf-8") as f:
            f.write("written by the main process to tell which savers share its storage\n")
    trainer.accelerator.wait_for_everyone()
    shared = not main and args.should_save and os.path.isfile(probe)
    trainer.accelerator.wait_for_everyone()
    if main:
        os.remove(probe)
    if shared:
        logger.info("save_on_each_node=True, but %s is the main process's storage too: its checkpoints are committed "
                    "once, by the main process.", run_dir)
    return shared


def save_final_model(trainer, output_dir: str) -> None:
    """``trainer.save_model(output_dir)``, never half-written: every process saves into
    ``<output_dir>/_tmp-final-model`` (DeepSpeed/FSDP gather there as usual), every file is fsync'd, then each is
    renamed into ``output_dir`` — the weights first, ``config.json`` and weight indexes last — and the folder is
    fsync'd. A kill during the (long) write leaves the previous final model untouched; the renames take
    milliseconds."""
    args = trainer.args
    tmp = os.path.join(output_dir, TMP_PREFIX + "final-model")
    if args.should_save:
        os.makedirs(output_dir, exist_ok=True)
        if os.path.lexists(tmp):
            _remove_tree(tmp, "left by an interrupted final save")
    trainer.accelerator.wait_for_everyone()
    trainer.save_model(tmp)
    trainer.accelerator.wait_for_everyone()
    if args.should_save:
        _sync_tree(tmp)
        names = sorted(os.listdir(tmp), key=lambda n: (n == "config.json" or n.endswith(".index.json"), n))
        for name in names:
            src, dst = os.path.join(tmp, name), os.path.join(output_dir, name)
            if os.path.isdir(dst) and not os.path.islink(dst):  # a folder (e.g. FSDP's sharded state): swap whole
                aside = os.path.join(output_dir, f"{TMP_PREFIX}replaced-{name}")
                if os.path.lexists(aside):
                    _remove_tree(aside, "left by an interrupted final save")
                os.rename(dst, aside)
                os.rename(src, dst)
                _remove_tree(aside, f"the previous final {name}")
            else:
                os.replace(src, dst)
        _fsync_dir(output_dir)
        _remove_tree(tmp, "the emptied staging folder of the final save")
    trainer.accelerator.wait_for_everyone()


def save_stopped_run(trainer, trial):
    """After :class:`~trl_fp8.capability.StopNow` cut an optimizer step short: the weights, optimizer and scheduler are
    still those of the last complete step (its gradients were never applied), so that step's checkpoint is written
    — with TRL's generation buffer as it was at that step's end — unless it exists already (saved at that step, or
    the one resumed from). Then the callbacks' ``on_train_end`` runs (trackers flush) and ``train()`` returns."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput

    state, args = trainer.state, trainer.args
    boundary = getattr(trainer, "_step_boundary", None)
    if boundary is not None:
        trainer._step, trainer._buffered_inputs = boundary
    else:  # cut inside the first step of this session: no buffer from it (a resume generates afresh, as TRL does)
        trainer._buffered_inputs = None
    if trainer.optimizer is not None:
        trainer.optimizer.zero_grad(set_to_none=True)  # the cut step's partial gradients
    step = state.global_step
    existing = os.path.join(_trl.run_dir(trainer, trial), f"{PREFIX_CHECKPOINT_DIR}-{step}")
    saved = None
    if step > 0 and not check_complete(existing).complete:
        saved = save_checkpoint(trainer, trial)
    if state.is_world_process_zero:
        logger.warning("trl_fp8: the step in flight (%d) was stopped at a micro-batch/generation boundary; %s. Resume "
                       "with resume_from_checkpoint='auto'.", step + 1,
                       f"saved {saved} (step {step})" if saved else
                       (f"{existing} (step {step}) is already saved" if step > 0 else "no step had completed"))
    trainer.control = trainer.callback_handler.on_train_end(args, state, trainer.control)
    return TrainOutput(step, float("nan"), {"stopped_in_step": step + 1})


def rotate(run_dir: str, save_total_limit: int | None, best_model_checkpoint: str | None, newest: str) -> list[str]:
    """transformers' rotation (oldest first by modification time, numeric order where mtimes are unreliable; the best
    checkpoint kept), over *complete* checkpoints only, never removing ``newest``. Returns the removed paths."""
    if save_total_limit is None or save_total_limit <= 0:
        return []
    from pathlib import Path

    from transformers.trainer_utils import sort_checkpoints

    ordered = [c for c in sort_checkpoints(run_dir, use_mtime=True) if check_complete(c).complete]
    if len(ordered) <= save_total_limit:
        return []
    protected = {str(Path(newest))}
    if best_model_checkpoint is not None:
        protected.add(str(Path(best_model_checkpoint)))
    keep = max(save_total_limit, len(protected))
    remaining, removed = len(ordered), []
    for path in ordered:
        if remaining <= keep:
            break
        if path not in protected:
            remove_checkpoint(path)
            removed.append(path)
            remaining -= 1
    return removed


# -- load ---------------------------------------------------------------------------------------------------------
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
            raise ValueError(_missing_message(capability.name, capability.state_file, checkpoint))
        capability.load_state_dict(_load(path, checkpoint, f"the {capability.name} state"))
    for capability in trainer.capabilities.values():  # every process: files it wrote itself (e.g. a rank's shard)
        capability.load_process_files(trainer, checkpoint)
    # the data order of the resumed epoch (trainer.state is the checkpoint's by now; transformers' epochs_trained)
    _trl.advance_train_sampler(getattr(trainer, "_train_sampler", None), math.floor(trainer.state.epoch or 0))
    path = os.path.join(checkpoint, _generation_state_file(trainer.args))
    if os.path.isfile(path):
        state = _load(path, checkpoint, "TRL's generation buffer")
        device = trainer.accelerator.device
        _trl.restore_generation_buffer(trainer, state if device.type == "cpu" else _to_device(state, device))
    # the resumed step is a step boundary: a stop inside the first step of this session saves this buffer again
    trainer._step_boundary = (trainer._step, trainer._buffered_inputs)

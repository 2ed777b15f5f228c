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
checkpoint complete. At the next :meth:`~trl_fp8.GRPOTrainer.train`, stale ``_tmp-*`` folders are removed — except a
``_tmp-checkpoint-N`` whose marker is complete while ``checkpoint-N`` is missing (killed between marker and rename):
that one is renamed into place, as is a complete ``_tmp-replaced-checkpoint-N`` (the previous copy of step N, when a
commit over it was killed between its two renames), so no copy of a step is lost. A staging folder another process is still writing (its owner file and heartbeat say
so, see :mod:`~trl_fp8.checkpoints.staging`) is left alone.

**Reading** (:func:`prepare_resume`, what :meth:`trl_fp8.GRPOTrainer.train` runs first).
``resume_from_checkpoint="auto"`` (also read from ``args.resume_from_checkpoint`` when ``train()`` gets no argument)
takes the newest complete checkpoint, else the one before (with a warning naming what was skipped and why), else
starts fresh; with several processes rank 0 chooses, and every rank must see its choice complete. ``True`` does the same but, as in transformers, raises when there is none. A path is used as given,
but refused when incomplete. Any checkpoint is refused (``ValueError`` naming the field) when trl_fp8 settings that
shape the run's state differ from this run's (each capability lists them in ``resume_fields``).

**Completeness.** A folder with :data:`MARKER` is complete when every file it lists is there with its size. A folder
without one (written by plain TRL/transformers, or by an earlier trl_fp8) is taken as complete when its
``trainer_state.json`` reads back with the folder's step and a model/adapter file (or a DeepSpeed/FSDP state folder)
is there — transformers writes ``trainer_state.json`` after the model, optimizer, scheduler and RNG files — and, for
``"auto"``/``True``, when it holds the state file of every capability this run needs (trl_fp8 wrote those after
``trainer_state.json``).

The package, one idea a module: :mod:`~trl_fp8.checkpoints.layout` (the names in a run and a checkpoint folder),
:mod:`~trl_fp8.checkpoints.durable` (durable writes: fsync, marker, renames), :mod:`~trl_fp8.checkpoints.complete`
(completeness), :mod:`~trl_fp8.checkpoints.staging` (what interrupted saves leave, and which savers share storage),
:mod:`~trl_fp8.checkpoints.settings` (the settings a resume must match), :mod:`~trl_fp8.checkpoints.resume` (resume
policy), :mod:`~trl_fp8.checkpoints.save` and :mod:`~trl_fp8.checkpoints.load`, and
:mod:`~trl_fp8.checkpoints.boundary` (the end of the last complete step, which a stop inside the next one saves).
The names the rest of trl_fp8 uses are imported here: ``trl_fp8.checkpoints.<name>``.
"""

from __future__ import annotations

from .boundary import mark as mark_step_boundary
from .complete import Verdict, check_complete, checkpoints_in
from .durable import commit, remove_checkpoint
from .layout import GENERATION_STATE, MARKER, SETTINGS, TMP_PREFIX, TRAINER_STATE
from .load import load_states
from .resume import finished_run, newest_complete, prepare_resume
from .save import rotate, save_checkpoint, save_final_model, save_stopped_run
from .settings import check_settings, check_world_size, settings_differences, settings_of
from .staging import clean_stale

__all__ = [
    "GENERATION_STATE", "MARKER", "SETTINGS", "TMP_PREFIX", "TRAINER_STATE", "Verdict", "check_complete",
    "check_settings", "check_world_size", "checkpoints_in", "clean_stale", "commit", "finished_run", "load_states",
    "mark_step_boundary",
    "newest_complete", "prepare_resume", "remove_checkpoint", "rotate", "save_checkpoint", "save_final_model",
    "save_stopped_run", "settings_differences", "settings_of",
]

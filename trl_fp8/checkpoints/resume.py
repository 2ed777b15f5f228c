"""Resume policy: which checkpoint ``resume_from_checkpoint`` (``"auto"``, ``True`` or a path) means, what is
refused, and a finished run started again."""

from __future__ import annotations

import logging
import os

from .. import _trl
from .complete import Verdict, check_complete, checkpoints_in
from .layout import SETTINGS, TRAINER_STATE
from .load import load_states
from .settings import check_settings, missing_state_files
from .staging import clean_stale, storage_shared_with_main

logger = logging.getLogger("trl_fp8.checkpoints")


def newest_complete(trainer, run_dir: str) -> tuple[str | None, list[str]]:
    """The newest complete checkpoint in ``run_dir`` this run can resume from, and a line for each newer one skipped.

    A checkpoint without a completion marker and :data:`SETTINGS` that lacks a running capability's state file is
    skipped too (trl_fp8 before atomic checkpoints wrote those after ``trainer_state.json``)."""
    skipped = []
    for _, path in checkpoints_in(run_dir):
        verdict = check_complete(path)
        if verdict.complete and not verdict.marked and not os.path.isfile(os.path.join(path, SETTINGS)):
            missing = missing_state_files(trainer, path)
            if missing:
                verdict = Verdict(False, f"no {missing[0][1]} (incomplete, or written without {missing[0][0]})")
        if verdict.complete:
            return path, skipped
        skipped.append(f"{os.path.basename(path)} ({verdict.reason})")
    return None, skipped


def prepare_resume(trainer, resume_from_checkpoint, trial=None):
    """What ``Trainer.train`` should resume from: None (fresh) or a complete checkpoint's path.

    Removes what interrupted saves left (see :func:`~trl_fp8.checkpoints.staging.clean_stale`) on the saving
    process(es) first."""
    args = trainer.args
    if resume_from_checkpoint is None and getattr(args, "resume_from_checkpoint", None) == "auto":
        resume_from_checkpoint = "auto"
    run_dir = _trl.run_dir(trainer, trial)
    own_checkpoint(trainer, None, reset=True)  # none yet: an earlier run's checkpoint-N is not this run's
    shared = storage_shared_with_main(trainer, run_dir)  # collectives: every process takes part
    if args.should_save and not shared:  # once per storage: savers sharing the main's leave it the clean-up
        for line in clean_stale(run_dir):
            logger.warning("%s: %s", run_dir, line)
    trainer.accelerator.wait_for_everyone()
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True or resume_from_checkpoint == "auto":
        # rank 0 chooses and every rank takes its choice: each rank's own view (node-local disks, a lagging network
        # filesystem) could otherwise put the replicas at different steps
        choice = _choose(trainer, run_dir, resume_from_checkpoint) if args.process_index == 0 else (None, None)
        path, error = _agree(args, run_dir, choice)
        if error is not None:
            raise ValueError(error)
        if path is None:
            return None
    else:
        path = os.fspath(resume_from_checkpoint)
        verdict = check_complete(path)
        if not verdict.complete:
            raise ValueError(
                f"Cannot resume from {path}: it is not a complete checkpoint ({verdict.reason}). Use "
                "resume_from_checkpoint='auto' to take the newest complete checkpoint of output_dir."
            )
    check_settings(trainer, path)
    own_checkpoint(trainer, path)
    return path


def own_checkpoint(trainer, path: str | None, *, reset: bool = False) -> set[str]:
    """The checkpoints that belong to this run: the one it resumed from and those it saved since (``reset`` at each
    ``train()``: see :func:`prepare_resume`). A ``checkpoint-N`` an earlier run left in the same output_dir (one
    started afresh since, resume off) is not among them, so a stop at step N writes this run's step N over it."""
    own = set() if reset else getattr(trainer, "_trl_fp8_own_checkpoints", set())
    if path is not None:
        own.add(os.path.realpath(path))
    trainer._trl_fp8_own_checkpoints = own
    return own


def _choose(trainer, run_dir: str, resume_from_checkpoint) -> tuple[str | None, str | None]:
    """``"auto"`` / ``True``: (the newest complete checkpoint or None, the error to raise or None), logged."""
    how = "True" if resume_from_checkpoint is True else "'auto'"
    path, skipped = newest_complete(trainer, run_dir)
    if path is None:
        why = f" (skipped: {'; '.join(skipped)})" if skipped else ""
        if resume_from_checkpoint is True:
            return None, f"No valid checkpoint found in output directory ({run_dir}){why}"
        (logger.warning if skipped else logger.info)(
            "resume_from_checkpoint='auto': no complete checkpoint in %s%s; starting fresh.", run_dir, why)
        return None, None
    if skipped:
        logger.warning("resume_from_checkpoint=%s: skipping %s; resuming from %s.", how, "; ".join(skipped),
                       os.path.basename(path))
    else:
        logger.info("resume_from_checkpoint=%s: resuming from %s.", how, path)
    return path, None


def _agree(args, run_dir: str, choice: tuple[str | None, str | None]) -> tuple[str | None, str | None]:
    """Rank 0's ``choice`` on every rank (one broadcast of its folder name, found in each rank's own ``run_dir``),
    then every rank checks that it sees that checkpoint complete (one all-gather): when one does not, every rank gets
    the same error. One process: ``choice``, no collective."""
    import torch.distributed as dist

    if args.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return choice
    path, error = choice
    box = [(None if path is None else os.path.basename(os.path.normpath(path)), error)]
    dist.broadcast_object_list(box, src=0)
    name, error = box[0]
    path = None if name is None else os.path.join(run_dir, name)
    verdict = check_complete(path) if path is not None else None
    mine = None if verdict is None or verdict.complete else verdict.reason
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, mine)
    missing = [f"rank {rank}: {why}" for rank, why in enumerate(seen) if why is not None]
    if missing and error is None:
        error = (f"Cannot resume from {name} (rank 0's newest complete checkpoint in output_dir): not every process "
                 f"sees it complete ({'; '.join(missing)}). Every process must see the same checkpoints: a shared "
                 "output_dir, or the same checkpoint-N folders on every node's disk.")
    return path, error


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

"""Saving: a checkpoint staged and committed atomically (push and rotation after), the final model, and the save of
a run a capability stopped inside a step."""

from __future__ import annotations

import contextlib
import logging
import os
import re

import torch

from .. import _trl, distributed
from .._version import __version__
from .complete import check_complete
from .durable import commit, fsync_dir, remove_checkpoint, remove_tree, sync_tree, write_json
from .layout import FORMAT, OWNER, SETTINGS, TMP_PREFIX, generation_state_file
from .resume import own_checkpoint
from .settings import settings_of
from .staging import claim, storage_shared_with_main, take_over

logger = logging.getLogger("trl_fp8.checkpoints")


def save_checkpoint(trainer, trial, states: dict | None = None) -> str:
    """Write ``checkpoint-<global_step>`` atomically (see :mod:`trl_fp8.checkpoints`); push and rotate after. Every
    process calls it. ``states``: capability name -> the state to write instead of its ``state_dict()`` now (a
    stopped step's boundary). Returns the checkpoint's path."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    args = trainer.args
    run_dir = _trl.run_dir(trainer, trial)
    name = f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    final = os.path.join(run_dir, name)
    tmp = os.path.join(run_dir, TMP_PREFIX + name)
    shared = storage_shared_with_main(trainer, run_dir)  # collectives: every process takes part, saver or not
    committer = args.should_save and not shared
    # a job starting meanwhile (a replacement pod) leaves the claimed folder alone; a live one there is refused
    heartbeat = _claim_everywhere(committer, tmp, f"checkpoint {name}")
    try:
        with main_process_saves(args, shared):
            _stage(trainer, trial, args, run_dir, tmp, final, committer, states or {})
    finally:
        if heartbeat is not None:
            heartbeat.stop()
    own_checkpoint(trainer, final)
    if args.push_to_hub:
        _trl.push_checkpoint(trainer, final)
    if committer:
        rotate(run_dir, args.save_total_limit, trainer.state.best_model_checkpoint, final)
    return final


def _claim_everywhere(saver: bool, tmp: str, what: str):
    """On a saver: settle what an earlier save left in ``tmp`` (refused when another process still writes it, see
    :func:`~trl_fp8.checkpoints.staging.take_over`) and claim it. Every process calls it (a collective): a failure on
    any saver is raised on every process, with that saver's message, so no rank is left waiting in the save's next
    collective for one that raised. Returns the saver's heartbeat (None elsewhere)."""
    heartbeat, error = None, None
    if saver:
        try:
            os.makedirs(os.path.dirname(tmp), exist_ok=True)
            done = take_over(tmp, what)
            if done:
                logger.info("trl_fp8: %s.", done)
            heartbeat = claim(tmp)
        except (OSError, RuntimeError) as err:
            error = err
    messages = distributed.gather_objects(None if error is None else f"{type(error).__name__}: {error}")
    failed = [(rank, m) for rank, m in enumerate(messages) if m is not None]
    if failed:
        if heartbeat is not None:
            heartbeat.stop()  # ours, unwritten: stale now, removed by the next save or start
        if error is not None:
            raise error
        rank, message = failed[0]
        raise RuntimeError(f"trl_fp8: saving {what} failed on process {rank}, so this process stops too: {message}")
    return heartbeat


def _stage(trainer, trial, args, run_dir: str, tmp: str, final: str, committer: bool, states: dict) -> None:
    trainer.accelerator.wait_for_everyone()
    _trl.write_checkpoint_files(trainer, tmp, run_dir, trial)
    buffer = _trl.generation_buffer(trainer)
    if buffer is not None:  # every process holds its own
        os.makedirs(tmp, exist_ok=True)
        torch.save(buffer, os.path.join(tmp, generation_state_file(args)))
    for capability in trainer.capabilities.values():  # per-process files (e.g. a rank's shard state), staged too
        capability.save_process_files(trainer, tmp)
    if committer:
        for capability in trainer.capabilities.values():
            state = states[capability.name] if capability.name in states else capability.state_dict()
            if state is not None and capability.state_file is not None:
                torch.save(state, os.path.join(tmp, capability.state_file))
        write_json(os.path.join(tmp, SETTINGS), {"format": FORMAT, "trl_fp8": __version__,
                                                 "capabilities": sorted(trainer.capabilities),
                                                 "world_size": args.world_size, "fields": settings_of(args)})
    trainer.accelerator.wait_for_everyone()  # every process has written its files
    if committer:
        commit(tmp, final)
    trainer.accelerator.wait_for_everyone()


@contextlib.contextmanager
def main_process_saves(args, shared: bool):
    """With ``save_on_each_node=True`` on storage this process shares with the main process (``shared``): it is no
    saver for the duration — ``args.should_save`` is the main process's alone, as without ``save_on_each_node`` — so
    it writes only its per-process files (RNG state, generation buffer) into the main's staging folder, not a second
    copy of the model, optimizer and trainer state over the main's."""
    if not shared:
        yield
        return
    before = args.save_on_each_node
    args.save_on_each_node = False
    try:
        yield
    finally:
        args.save_on_each_node = before


def save_final_model(trainer, output_dir: str) -> None:
    """``trainer.save_model(output_dir)``, never half-written: every process saves into
    ``<output_dir>/_tmp-final-model`` (DeepSpeed/FSDP gather there as usual), every file is fsync'd, then each is
    renamed into ``output_dir`` — the weights first, ``config.json`` and weight indexes last — and the folder is
    fsync'd; then the earlier save's weight files of the other format (a single ``model.safetensors`` beside new
    shards, which transformers would load first, or old shards) are removed. A kill during the (long) write leaves
    the previous final model untouched; the renames take milliseconds."""
    args = trainer.args
    tmp = os.path.join(output_dir, TMP_PREFIX + "final-model")
    shared = storage_shared_with_main(trainer, output_dir)  # collectives: every process takes part
    saver = args.should_save and not shared
    heartbeat = _claim_everywhere(saver, tmp, "a final model")
    try:
        with main_process_saves(args, shared):
            _write_final_model(trainer, output_dir, tmp)
    finally:
        if heartbeat is not None:
            heartbeat.stop()


def _write_final_model(trainer, output_dir: str, tmp: str) -> None:
    args = trainer.args
    trainer.accelerator.wait_for_everyone()
    trainer.save_model(tmp)
    trainer.accelerator.wait_for_everyone()
    if args.should_save:
        if os.path.lexists(os.path.join(tmp, OWNER)):
            os.remove(os.path.join(tmp, OWNER))  # not part of the model
        sync_tree(tmp)
        names = sorted(os.listdir(tmp), key=lambda n: (n == "config.json" or n.endswith(".index.json"), n))
        for name in names:
            src, dst = os.path.join(tmp, name), os.path.join(output_dir, name)
            if os.path.isdir(dst) and not os.path.islink(dst):  # a folder (e.g. FSDP's sharded state): swap whole
                aside = os.path.join(output_dir, f"{TMP_PREFIX}replaced-{name}")
                if os.path.lexists(aside):
                    remove_tree(aside, "left by an interrupted final save")
                os.rename(dst, aside)
                os.rename(src, dst)
                remove_tree(aside, f"the previous final {name}")
            else:
                os.replace(src, dst)
        for name in stale_weight_files(os.listdir(output_dir), names):  # last: until now the old weights load whole
            os.remove(os.path.join(output_dir, name))
        fsync_dir(output_dir)
        remove_tree(tmp, "the emptied staging folder of the final save")
    trainer.accelerator.wait_for_everyone()


_WEIGHT_FILE = re.compile(r"^(model|pytorch_model|adapter_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$")


def stale_weight_files(present: list[str], written: list[str]) -> list[str]:
    """The weight files in ``present`` that a save writing ``written`` leaves from an earlier save of the same kind
    (full model or adapter), e.g. a single ``model.safetensors`` beside new shards and their index (transformers
    loads the single file first) or old shards beside a new single file."""
    kinds = {m.group(1).replace("pytorch_", "") for m in map(_WEIGHT_FILE.match, written) if m}
    return sorted(name for name in present if name not in written and (m := _WEIGHT_FILE.match(name))
                  and m.group(1).replace("pytorch_", "") in kinds)


def save_stopped_run(trainer, trial):
    """After :class:`~trl_fp8.capability.StopNow` cut an optimizer step short: the weights, optimizer and scheduler are
    still those of the last complete step (its gradients were never applied), so that step's checkpoint is written
    — with TRL's generation buffer, the RNG states and the capabilities' states as they were at that step's end
    (:mod:`trl_fp8.checkpoints.boundary`) — unless this run has it already (saved at that step, or the one resumed
    from; a ``checkpoint-N`` an earlier run left in the same output_dir is written over).
    Then the callbacks' ``on_train_end`` runs (trackers flush) and ``train()`` returns."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput

    state, args = trainer.state, trainer.args
    boundary = getattr(trainer, "_step_boundary", None)
    states = None
    if boundary is not None:
        trainer._step, trainer._buffered_inputs = boundary.step, boundary.buffered_inputs
        boundary.restore_rng()
        states = boundary.state_dicts()
    else:  # stopped before any step of this session began: no buffer from it (a resume generates afresh, as TRL does)
        trainer._buffered_inputs = None
    if trainer.optimizer is not None:
        trainer.optimizer.zero_grad(set_to_none=True)  # the cut step's partial gradients
    step = state.global_step
    existing = os.path.join(_trl.run_dir(trainer, trial), f"{PREFIX_CHECKPOINT_DIR}-{step}")
    saved = None
    mine = os.path.realpath(existing) in getattr(trainer, "_trl_fp8_own_checkpoints", ())  # not an earlier run's
    if any_process(step > 0 and not (mine and check_complete(existing).complete)):
        saved = save_checkpoint(trainer, trial, states)
    if state.is_world_process_zero:
        logger.warning("trl_fp8: the step in flight (%d) was stopped at a micro-batch/generation boundary; %s. Resume "
                       "with resume_from_checkpoint='auto'.", step + 1,
                       f"saved {saved} (step {step})" if saved else
                       (f"{existing} (step {step}) is already saved" if step > 0 else "no step had completed"))
    trainer.control = trainer.callback_handler.on_train_end(args, state, trainer.control)
    return TrainOutput(step, float("nan"), {"stopped_in_step": step + 1})


def any_process(flag: bool) -> bool:
    """Whether ``flag`` holds on any process (a collective; ``flag`` itself on one process): one decision every
    rank takes together, where each rank's own view (of its disk, of what it saved) could differ and leave some
    ranks in a save's collectives that the others never enter."""
    return any(distributed.gather_objects(bool(flag)))


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

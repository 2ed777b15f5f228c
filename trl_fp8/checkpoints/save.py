"""Saving: a checkpoint staged and committed atomically (push and rotation after), the final model, and the save of
a run a capability stopped inside a step."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import uuid

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
            _stage(trainer, trial, args, run_dir, tmp, final, committer, states or {}, f"checkpoint {name}")
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
    try:
        settle(error, what)
    except BaseException:
        if heartbeat is not None:
            heartbeat.stop()  # ours, unwritten: stale now, removed by the next save or start
        raise
    return heartbeat


def settle(error: BaseException | None, what: str) -> None:
    """A barrier that carries failures: every process calls it (a collective) with the exception its part of the save
    raised, or None. If any process failed, every process raises — the failed one its own exception, the others a
    RuntimeError naming the process and its message — so no rank waits in the save's next barrier (until a launcher
    timeout) for one that raised (a full disk, an ``fsync`` EIO). Collectives inside the writers themselves
    (DeepSpeed's and FSDP's gathers) stay theirs: a process that fails before one of them still leaves the others
    there."""
    messages = distributed.gather_objects(None if error is None else f"{type(error).__name__}: {error}")
    failed = [(rank, m) for rank, m in enumerate(messages) if m is not None]
    if not failed:
        return
    if error is not None:
        raise error
    rank, message = failed[0]
    raise RuntimeError(f"trl_fp8: saving {what} failed on process {rank}, so this process stops too: {message}")


def _stage(trainer, trial, args, run_dir: str, tmp: str, final: str, committer: bool, states: dict,
           what: str) -> None:
    trainer.accelerator.wait_for_everyone()
    error = None
    try:
        _write_staged(trainer, trial, args, run_dir, tmp, committer, states)
    except Exception as err:  # noqa: BLE001 - carried to every process, re-raised on this one
        error = err
    settle(error, what)  # every process has written its files
    if committer:
        try:
            commit(tmp, final)
        except Exception as err:  # noqa: BLE001 - carried to every process, re-raised on this one
            error = err
    settle(error, what)


def _write_staged(trainer, trial, args, run_dir: str, tmp: str, committer: bool, states: dict) -> None:
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
    fsync'd; then the earlier save's weight files (a single ``model.safetensors`` beside new shards, which
    transformers would load first, or old shards) are removed. A kill during the (long) write leaves the previous
    final model untouched. The set is atomic too: shards are renamed to names unique to this save
    (``model-00001-of-00002-<id>.safetensors``, the index rewritten to them), so until the index's own rename the old
    index still names the old shards, whole; a kill between two renames never loads shard 1 new and shard 2 old.
    A failure on the saving process (a full disk) is raised on every process (:func:`settle`)."""
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
    error = None
    try:
        trainer.save_model(tmp)
    except Exception as err:  # noqa: BLE001 - carried to every process, re-raised on this one
        error = err
    settle(error, "a final model")
    if args.should_save:
        try:
            _move_final_model(output_dir, tmp)
        except Exception as err:  # noqa: BLE001 - carried to every process, re-raised on this one
            error = err
    settle(error, "a final model")


def unique_shard_names(folder: str, tag: str) -> dict[str, str]:
    """Renames the shards of every weight index in ``folder`` to names carrying ``tag`` and rewrites the index to
    them (written to a temporary name, fsync'd, renamed). Returns {old name: new name}."""
    renamed = {}
    for index in sorted(n for n in os.listdir(folder) if n.endswith(".index.json")):
        path = os.path.join(folder, index)
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict):
            continue
        names = {}
        for shard in sorted(set(weight_map.values())):
            m = _WEIGHT_FILE.match(shard)
            if not m or not m.group(2):  # not a numbered shard of ours to rename
                continue
            stem, ext = shard.rsplit(".", 1)
            names[shard] = f"{stem}-{tag}.{ext}"
        for old, new in names.items():
            os.rename(os.path.join(folder, old), os.path.join(folder, new))
        data["weight_map"] = {k: names.get(v, v) for k, v in weight_map.items()}
        write_json(path, data)
        renamed.update(names)
    return renamed


def _move_final_model(output_dir: str, tmp: str) -> None:
    if os.path.lexists(os.path.join(tmp, OWNER)):
        os.remove(os.path.join(tmp, OWNER))  # not part of the model
    unique_shard_names(tmp, uuid.uuid4().hex[:8])
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


# a weight file: a single file, a numbered shard (with this package's save id, see unique_shard_names), an index
_WEIGHT_FILE = re.compile(r"^(model|pytorch_model|adapter_model)(-\d+-of-\d+(?:-[0-9a-f]{8})?)?\.(safetensors|bin)"
                          r"(\.index\.json)?$")


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

"""What interrupted saves leave in a run folder (``_tmp-*``) and who may clean it up; which savers share storage."""

from __future__ import annotations

import logging
import os

from .complete import check_complete
from .durable import fsync_dir, remove_tree
from .layout import TMP_CHECKPOINT, TMP_PREFIX

logger = logging.getLogger("trl_fp8.checkpoints")


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
        m = TMP_CHECKPOINT.match(name)
        final = os.path.join(run_dir, f"checkpoint-{m.group(1)}") if m else None
        verdict = check_complete(path) if final is not None and not os.path.lexists(final) else None
        if verdict is not None and verdict.complete and verdict.marked:
            os.rename(path, final)
            fsync_dir(run_dir)
            done.append(f"completed the interrupted save of {os.path.basename(final)}")
            continue
        if remove_tree(path, "left by an interrupted save or rotation"):
            done.append(f"removed {name}, left by an interrupted save or rotation")
    if done:
        fsync_dir(run_dir)
    return done


def storage_shared_with_main(trainer, run_dir: str) -> bool:
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

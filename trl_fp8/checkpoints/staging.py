"""What interrupted saves leave in a run folder (``_tmp-*``) and who may clean it up; which savers share storage.

**Owned staging folders.** A save stages into ``_tmp-checkpoint-N`` (or ``_tmp-final-model``) holding an owner file,
:data:`OWNER` (the process id, the host name and the process's start time), whose modification time a heartbeat
thread refreshes every :data:`HEARTBEAT_S` seconds while the save runs. :func:`clean_stale`, run when a job starts,
removes only stale ``_tmp-*`` folders: one whose owner is a process of this host that no longer runs (or whose pid
now names another process), one this very process owns but is no longer writing (a ``train()`` that raised), one
owned on another host whose heartbeat is older than :data:`STALE_AFTER_S`, and one without an owner file (folders
renamed aside for deletion, or left by trl_fp8 before owner files). A live one — a terminating pod still writing its
SIGTERM save while its replacement starts — is left alone.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time

from .complete import check_complete
from .durable import fsync_dir, remove_tree
from .layout import OWNER, TMP_CHECKPOINT, TMP_PREFIX

logger = logging.getLogger("trl_fp8.checkpoints")

HEARTBEAT_S = 30.0  # how often a save in progress refreshes its owner file
STALE_AFTER_S = 600.0  # another host's staging folder without a heartbeat for this long is stale (documented)
_ACTIVE: set[str] = set()  # the staging folders this process is writing now


def _process_started(pid: int) -> float | None:
    try:
        import psutil

        return round(psutil.Process(pid).create_time(), 3)
    except Exception:  # noqa: BLE001 - psutil missing, or no such process
        return None


def _pid_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it runs
        return True
    except OSError:
        return False
    return True


class Heartbeat:
    """Ownership of a staging folder while this process writes it: the owner file, refreshed by a daemon thread."""

    def __init__(self, folder: str, interval_s: float = HEARTBEAT_S):
        self.folder = os.path.abspath(folder)
        self.path = os.path.join(self.folder, OWNER)
        self._stop = threading.Event()
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": _process_started(os.getpid()),
                  "since": time.time()}
        with open(self.path, "w", encoding="utf-8") as f:
            json.dump(record, f)
            f.write("\n")
        _ACTIVE.add(self.folder)
        self._thread = threading.Thread(target=self._beat, args=(interval_s,), name="trl_fp8-staging-heartbeat",
                                        daemon=True)
        self._thread.start()

    def _beat(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                os.utime(self.path)
            except OSError:  # committed (renamed) or removed: nothing left to refresh
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        _ACTIVE.discard(self.folder)


def claim(folder: str) -> Heartbeat:
    """Mark ``folder`` (just created) as being written by this process until the returned heartbeat is stopped."""
    return Heartbeat(folder)


def staleness(folder: str, now: float | None = None) -> str | None:
    """Why ``folder`` (a ``_tmp-*`` folder) is stale and may be removed, or None while its owner still writes it."""
    path = os.path.join(folder, OWNER)
    try:
        with open(path, encoding="utf-8") as f:
            owner = json.load(f)
        age = (time.time() if now is None else now) - os.path.getmtime(path)
        pid, host = int(owner["pid"]), str(owner["host"])
    except FileNotFoundError:
        return "no owner file"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"unreadable owner file ({err})"
    if host == socket.gethostname():
        if pid == os.getpid() and owner.get("started") == _process_started(pid):
            return None if os.path.abspath(folder) in _ACTIVE else "this process no longer writes it"
        if not _pid_runs(pid):
            return f"its owner, process {pid} on this host, has ended"
        started = owner.get("started")
        if started is not None and _process_started(pid) not in (None, started):
            return f"its owner, process {pid} on this host, has ended (the pid is another process's now)"
        return None
    if age > STALE_AFTER_S:
        return f"its owner, process {pid} on {host}, has not refreshed it for {age:.0f} s (> {STALE_AFTER_S:.0f} s)"
    return None


def clean_stale(run_dir: str) -> list[str]:
    """Remove the stale ``_tmp-*`` folders (see :func:`staleness`) a killed save or rotation left in ``run_dir``; a
    stale ``_tmp-checkpoint-N`` that is complete while ``checkpoint-N`` is missing (killed between the marker and the
    rename) is renamed into place. Live ones are left alone. Returns what was done, one line each."""
    done = []
    if not os.path.isdir(run_dir):
        return done
    for name in sorted(os.listdir(run_dir)):
        path = os.path.join(run_dir, name)
        if not name.startswith(TMP_PREFIX) or not os.path.isdir(path):
            continue
        why = staleness(path)
        if why is None:  # a save in progress (e.g. a terminating job's last checkpoint): not ours to touch
            logger.info("%s: %s is being written by another process; left alone.", run_dir, name)
            continue
        m = TMP_CHECKPOINT.match(name)
        final = os.path.join(run_dir, f"checkpoint-{m.group(1)}") if m else None
        verdict = check_complete(path) if final is not None and not os.path.lexists(final) else None
        if verdict is not None and verdict.complete and verdict.marked:
            os.rename(path, final)
            fsync_dir(run_dir)
            if os.path.lexists(os.path.join(final, OWNER)):
                os.remove(os.path.join(final, OWNER))
            done.append(f"completed the interrupted save of {os.path.basename(final)}")
            continue
        if remove_tree(path, f"left by an interrupted save or rotation: {why}"):
            done.append(f"removed {name}, left by an interrupted save or rotation ({why})")
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

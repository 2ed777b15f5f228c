"""What interrupted saves leave in a run folder (``_tmp-*``) and who may clean it up; which savers share storage.

**Owned staging folders.** A save stages into ``_tmp-checkpoint-N`` (or ``_tmp-final-model``) holding an owner file,
:data:`OWNER` (the process id, the host name, the process's start time, its PID namespace and the kernel's boot id),
whose modification time a heartbeat thread refreshes every :data:`HEARTBEAT_S` seconds while the save runs. The
folder is created with its owner file already in it (built as ``_tmp-claim-*`` and renamed), and the owner file is
written whole (a temporary file renamed), so no other job ever sees a staging folder without its owner.

:func:`clean_stale`, run when a job starts, removes only stale ``_tmp-*`` folders: one whose owner is a process of
this host, PID namespace and boot that no longer runs (or whose pid now names another process), one this very
process owns but is no longer writing (a ``train()`` that raised), one whose owner runs elsewhere — another host, or
the same host name in another PID namespace or boot (containers, where a pid means nothing across namespaces), or an
owner file that does not say — with a heartbeat older than :data:`STALE_AFTER_S`, a ``_tmp-claim-*`` folder older
than that, and one without an owner file (folders renamed aside for deletion, or left by trl_fp8 before owner
files). A live one — a terminating pod still writing its SIGTERM save while its replacement starts — is left alone.
A save that finds its staging folder already there applies the same rule (:func:`take_over`): it refuses a live one.

**No copy of a step is lost.** A stale ``_tmp-checkpoint-N`` that is complete while ``checkpoint-N`` is missing
(killed between the marker and the rename) is renamed into place, and so is a complete ``_tmp-replaced-checkpoint-N``
(the previous copy of step N, renamed aside by a commit that was killed before its second rename): a complete copy of
step N is removed only when a complete ``checkpoint-N`` exists.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid

from .complete import check_complete
from .durable import fsync_dir, remove_tree
from .layout import OWNER, TMP_CHECKPOINT, TMP_CLAIM, TMP_PREFIX, TMP_REPLACED_CHECKPOINT

logger = logging.getLogger("trl_fp8.checkpoints")

HEARTBEAT_S = 30.0  # how often a save in progress refreshes its owner file
STALE_AFTER_S = 600.0  # another host's staging folder without a heartbeat for this long is stale (documented)
# A save that finds its staging folder owned by another host (or PID namespace, or boot) with a fresh heartbeat
# watches that heartbeat for two of its intervals: a live save refreshes it, a dead one (the run this one resumes,
# killed mid-save on another VM) does not. Only the owner file's own timestamps are compared: no clock skew.
WATCH_S = 2 * HEARTBEAT_S + 5.0
_ACTIVE: set[str] = set()  # the staging folders this process is writing now


def _process_started(pid: int) -> float | None:
    try:
        import psutil

        return round(psutil.Process(pid).create_time(), 3)
    except Exception:  # noqa: BLE001 - psutil missing, or no such process
        return None


def _pid_namespace() -> str | None:
    """This process's PID namespace (``pid:[inode]``), or None where there is no ``/proc`` (a pid is then host-wide)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _boot_id() -> str | None:
    """The running kernel's boot id (a new one at every boot), or None where there is no ``/proc``."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _owner_record() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": _process_started(os.getpid()),
            "pid_ns": _pid_namespace(), "boot_id": _boot_id(), "since": time.time()}


def _write_owner(folder: str) -> str:
    """Write this process's owner file into ``folder`` whole: a temporary file, fsync'd, renamed over :data:`OWNER`
    (a reader sees the previous content or the complete new one, never an empty or partial file)."""
    path = os.path.join(folder, OWNER)
    part = os.path.join(folder, f".{OWNER}.{os.getpid()}.{uuid.uuid4().hex[:8]}.part")
    try:
        with open(part, "w", encoding="utf-8") as f:
            json.dump(_owner_record(), f)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
    finally:
        if os.path.lexists(part):
            os.remove(part)
    return path


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
        if not os.path.isfile(self.path):  # claim() wrote it before the folder got its name
            _write_owner(self.folder)
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
    """Create ``folder`` owned by this process until the returned heartbeat is stopped: it is built as a
    ``_tmp-claim-*`` sibling holding the owner file, then renamed to ``folder`` — which never exists without its
    owner file. A ``folder`` that exists already is refused (:class:`StagingBusy`): another job claimed it since the
    caller's :func:`take_over`, and two jobs must never write one folder."""
    folder = os.path.abspath(folder)
    parent = os.path.dirname(folder)
    busy = StagingBusy(f"{folder} was claimed by another process just now: two runs are saving into {parent} at "
                       "once. Give each run its own output_dir.")
    if os.path.lexists(folder):
        raise busy
    draft = os.path.join(parent, f"{TMP_CLAIM}{uuid.uuid4().hex}")
    os.makedirs(draft)
    try:
        _write_owner(draft)
        if os.path.lexists(folder):
            raise busy
        os.rename(draft, folder)  # fails when another process claimed ``folder`` meanwhile (it is not empty)
    except OSError as err:
        remove_tree(draft, "a claim that did not complete")
        if os.path.lexists(folder):
            raise busy from err
        raise
    except BaseException:
        remove_tree(draft, "a claim that did not complete")
        raise
    fsync_dir(parent)
    return Heartbeat(folder)


def _same_kernel(owner: dict) -> bool:
    """Whether the owner file's process ran on this host, in this PID namespace, since this boot: only then does
    its pid name a process here. An owner file without the namespace and boot (older trl_fp8) does not say so."""
    return (str(owner.get("host")) == socket.gethostname() and owner.get("pid_ns") == _pid_namespace()
            and owner.get("boot_id") == _boot_id())


def staleness(folder: str, now: float | None = None) -> str | None:
    """Why ``folder`` (a ``_tmp-*`` folder) is stale and may be removed, or None while its owner still writes it."""
    path = os.path.join(folder, OWNER)
    now = time.time() if now is None else now
    if os.path.basename(os.path.normpath(folder)).startswith(TMP_CLAIM) and not os.path.isfile(path):
        try:  # a claim being built (its owner file comes next): live while young
            age = now - os.path.getmtime(folder)
        except OSError:
            return None
        return f"an unfinished claim, {age:.0f} s old" if age > STALE_AFTER_S else None
    try:
        with open(path, encoding="utf-8") as f:
            owner = json.load(f)
        age = now - os.path.getmtime(path)
        pid, host = int(owner["pid"]), str(owner["host"])
    except FileNotFoundError:
        return "no owner file"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"unreadable owner file ({err})"
    if _same_kernel(owner):
        if pid == os.getpid() and owner.get("started") == _process_started(pid):
            return None if os.path.abspath(folder) in _ACTIVE else "this process no longer writes it"
        if not _pid_runs(pid):
            return f"its owner, process {pid} on this host, has ended"
        started = owner.get("started")
        if started is not None and _process_started(pid) not in (None, started):
            return f"its owner, process {pid} on this host, has ended (the pid is another process's now)"
        return None
    if age > STALE_AFTER_S:  # another host, or this host name in another PID namespace or boot: the heartbeat says
        where = host if host != socket.gethostname() else f"{host} (another PID namespace or boot)"
        return f"its owner, process {pid} on {where}, has not refreshed it for {age:.0f} s (> {STALE_AFTER_S:.0f} s)"
    return None


def settle(path: str, why: str) -> str | None:
    """Deal with the stale ``_tmp-*`` folder ``path`` (``why``: :func:`staleness`'s verdict): a complete, marked
    ``_tmp-checkpoint-N`` or ``_tmp-replaced-checkpoint-N`` while ``checkpoint-N`` is missing is renamed into place
    (the step's only copy); anything else is removed. Returns what was done, or None when it could not be removed."""
    run_dir, name = os.path.split(os.path.normpath(path))
    m = TMP_CHECKPOINT.match(name) or TMP_REPLACED_CHECKPOINT.match(name)
    final = os.path.join(run_dir, f"checkpoint-{m.group(1)}") if m else None
    verdict = check_complete(path) if final is not None and not os.path.lexists(final) else None
    if verdict is not None and verdict.complete and verdict.marked:
        os.rename(path, final)
        fsync_dir(run_dir)
        if os.path.lexists(os.path.join(final, OWNER)):
            os.remove(os.path.join(final, OWNER))
        what = "save" if TMP_CHECKPOINT.match(name) else "commit (the previous copy put back)"
        return f"completed the interrupted {what} of {os.path.basename(final)}"
    if remove_tree(path, f"left by an interrupted save or rotation: {why}"):
        return f"removed {name}, left by an interrupted save or rotation ({why})"
    return None


class StagingBusy(RuntimeError):
    """A save's staging folder is being written by another live process."""


def _foreign_owner(folder: str) -> dict | None:
    """The owner record of ``folder`` when its process ran on another host, PID namespace or boot (its pid says
    nothing here), else None."""
    try:
        with open(os.path.join(folder, OWNER), encoding="utf-8") as f:
            owner = json.load(f)
    except (OSError, ValueError):
        return None
    return None if not isinstance(owner, dict) or _same_kernel(owner) else owner


def _heartbeat_moves(folder: str, window_s: float) -> bool:
    """Whether ``folder``'s owner file is refreshed (or the folder committed or removed by its owner) within
    ``window_s`` seconds of watching."""
    path = os.path.join(folder, OWNER)

    def stamp():
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    first, deadline = stamp(), time.monotonic() + window_s
    while time.monotonic() < deadline:
        time.sleep(min(1.0, window_s / 10))
        if not os.path.lexists(folder) or stamp() != first:
            return True
    return False


def take_over(path: str, what: str) -> str | None:
    """Before a save stages into ``path``: nothing when it does not exist; :class:`StagingBusy` when another process
    still writes it (:func:`staleness`; an owner on another host, PID namespace or boot whose heartbeat is younger
    than :data:`STALE_AFTER_S` is watched for :data:`WATCH_S` seconds, and is stale if it did not refresh it: the run
    this one resumes, killed mid-save on another machine); else it is settled (:func:`settle`: put into place when it
    is a step's only complete copy, removed otherwise). ``what``: the save, for the message. Returns what was done."""
    if not os.path.lexists(path):
        return None
    why = staleness(path)
    owner = _foreign_owner(path) if why is None else None
    if owner is not None:
        where = f"process {owner.get('pid')} on {owner.get('host')}"
        logger.warning("trl_fp8: %s is owned by %s, written less than %.0f s ago; watching its heartbeat for %.0f s "
                       "before %s (a save in progress refreshes it every %.0f s).", path, where, STALE_AFTER_S,
                       WATCH_S, what, HEARTBEAT_S)
        if not _heartbeat_moves(path, WATCH_S):
            why = f"its owner, {where}, did not refresh it in {WATCH_S:.0f} s of watching"
        elif not os.path.lexists(path):
            return None  # its owner committed or removed it meanwhile
    if why is None:
        raise StagingBusy(f"{path} is being written by another process (its {OWNER} names it): two runs are "
                          f"saving {what} into {os.path.dirname(path)} at once. Give each run its own output_dir.")
    done = settle(path, why)
    if os.path.lexists(path):
        raise OSError(f"could not clear {path} ({why}) before {what}: remove it by hand")
    return done


def clean_stale(run_dir: str) -> list[str]:
    """Remove the stale ``_tmp-*`` folders (see :func:`staleness`) a killed save or rotation left in ``run_dir``; a
    stale ``_tmp-checkpoint-N`` that is complete while ``checkpoint-N`` is missing (killed between the marker and the
    rename) is renamed into place, and so is a complete ``_tmp-replaced-checkpoint-N`` while ``checkpoint-N`` is missing
    (killed between a commit's two renames). Live ones are left alone. Returns what was done, one line each."""
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
        line = settle(path, why)
        if line is not None:
            done.append(line)
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

"""Durable writes: every file and folder fsync'd, the completion marker written last, folders renamed into place
and renamed aside before they are deleted, so a kill at any moment leaves no checkpoint that looks complete but is
not."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import sys

from .layout import FORMAT, MARKER, OWNER, TMP_PREFIX, step_of

logger = logging.getLogger("trl_fp8.checkpoints")


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# What a filesystem answers when it cannot fsync a folder at all (not a failed write): skipped, like Windows.
_FSYNC_UNSUPPORTED = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EISDIR}


def fsync_dir(path: str) -> None:
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


def remove_tree(path: str, why: str) -> bool:
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


def listing(folder: str, leave_out: tuple[str, ...] = (MARKER,)) -> dict[str, int]:
    """Every file under ``folder`` (relative POSIX path -> size), ``leave_out`` (the marker) excepted."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder).replace(os.sep, "/")
            if rel not in leave_out:
                out[rel] = os.path.getsize(path)
    return dict(sorted(out.items()))


def sync_tree(folder: str) -> None:
    """fsync every file and folder under ``folder``, deepest first."""
    for root, dirs, files in os.walk(folder, topdown=False):
        for name in files:
            fsync_file(os.path.join(root, name))
        fsync_dir(root)


def write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def commit(tmp: str, final: str) -> None:
    """Make ``tmp`` the complete checkpoint ``final``: fsync every file and folder, write the marker last, rename."""
    sync_tree(tmp)
    files = listing(tmp, leave_out=(MARKER, OWNER))  # the owner file is removed once the folder is in place
    write_json(os.path.join(tmp, MARKER), {"format": FORMAT, "global_step": step_of(final), "files": files})
    fsync_dir(tmp)
    run_dir = os.path.dirname(final)
    aside = None
    if os.path.lexists(final):  # the same step saved again (e.g. a save on a stop signal after a scheduled one)
        aside = os.path.join(run_dir, f"{TMP_PREFIX}replaced-{os.path.basename(final)}")
        if os.path.lexists(aside):
            shutil.rmtree(aside)
        os.rename(final, aside)
    os.rename(tmp, final)
    fsync_dir(run_dir)
    if os.path.lexists(os.path.join(final, OWNER)):
        os.remove(os.path.join(final, OWNER))
    if aside is not None:
        remove_tree(aside, f"the replaced copy of {os.path.basename(final)}")
        fsync_dir(run_dir)


def remove_checkpoint(path: str) -> None:
    """Delete a checkpoint folder without ever leaving a complete-looking partial one: rename it aside, then delete."""
    aside = os.path.join(os.path.dirname(path), f"{TMP_PREFIX}deleting-{os.path.basename(path)}")
    try:
        if os.path.lexists(aside):
            shutil.rmtree(aside)
        os.rename(path, aside)
        fsync_dir(os.path.dirname(path))
    except OSError:
        aside = path
    remove_tree(aside, f"rotating out {os.path.basename(path)}")

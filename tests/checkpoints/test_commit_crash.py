"""A commit of ``checkpoint-N`` over an existing ``checkpoint-N`` (the same step saved again, e.g. on a stop signal
after a scheduled save) renames the old copy aside, then the new one into place. Killed at any point of it — in
particular between those two renames — and repaired by a replacement job on another host (which sees the killed
job's staging folder with a fresh heartbeat, so leaves it alone), no copy of step N is lost: a complete copy exists
at every moment, and after the repair ``checkpoint-N`` is complete, so the replacement resumes from step N."""

import json
import os
import shutil
import socket
import time

import pytest

from trl_fp8.checkpoints import check_complete, clean_stale, commit, durable, staging

OWNER = "trl_fp8_owner.json"


class Killed(BaseException):
    pass


def _copy_of_step(run_dir, name, payload):
    folder = os.path.join(run_dir, name)
    os.makedirs(folder)
    with open(os.path.join(folder, "model.safetensors"), "w") as f:
        f.write(payload)
    return folder


def _content(folder):
    with open(os.path.join(folder, "model.safetensors")) as f:
        return f.read()


def _complete_copies(run_dir):
    """The complete copies of step 3 anywhere in the run folder, by content."""
    out = []
    for name in sorted(os.listdir(run_dir)):
        path = os.path.join(run_dir, name)
        if name.endswith("checkpoint-3") and check_complete(path).complete and check_complete(path).marked:
            out.append(_content(path))
    return out


def _mutations():
    """How many filesystem mutations a commit over an existing checkpoint makes (the kill points)."""
    import tempfile

    run_dir = tempfile.mkdtemp()
    try:
        return len(_run_commit(None, run_dir, count_only=True))
    finally:
        shutil.rmtree(run_dir)


def _run_commit(kill_at, run_dir, count_only=False):
    calls = []
    real = {"rename": os.rename, "remove": os.remove, "rmtree": shutil.rmtree, "remove_tree": durable.remove_tree}

    def hook(name):
        def call(*a, **kw):
            if not count_only and len(calls) == kill_at:
                raise Killed(f"killed before {name}{a}")
            calls.append(name)
            return real[name](*a, **kw)
        return call

    if not os.path.isdir(os.path.join(run_dir, "checkpoint-3")):
        commit(_copy_of_step(run_dir, "_tmp-checkpoint-3", "old"), os.path.join(run_dir, "checkpoint-3"))
    tmp = _copy_of_step(run_dir, "_tmp-checkpoint-3", "new")
    with open(os.path.join(tmp, OWNER), "w") as f:  # written by job A, on another host, heartbeat fresh
        json.dump({"pid": 1, "host": socket.gethostname() + "-pod-a", "started": None}, f)
    patches = [(durable.os, "rename"), (durable.os, "remove"), (durable.shutil, "rmtree"), (durable, "remove_tree")]
    saved = [(mod, attr, getattr(mod, attr)) for mod, attr in patches]
    try:
        for mod, attr in patches:
            setattr(mod, attr, hook(attr))
        try:
            commit(tmp, os.path.join(run_dir, "checkpoint-3"))
        except Killed:
            pass
    finally:
        for mod, attr, value in saved:
            setattr(mod, attr, value)
    return calls


@pytest.mark.parametrize("heartbeat", ["fresh", "silent"])
def test_no_copy_of_a_step_is_lost_when_a_commit_is_killed_and_repaired_elsewhere(tmp_path, heartbeat):
    kill_points = _mutations()
    assert kill_points >= 2  # at least: the old copy aside, the new one in place
    for kill_at in range(kill_points + 1):
        run_dir = tmp_path / f"kill{kill_at}"
        run_dir.mkdir()
        _run_commit(kill_at, str(run_dir))
        assert _complete_copies(str(run_dir)), f"killed at {kill_at}: no complete copy of step 3 left"
        tmp = run_dir / "_tmp-checkpoint-3"
        if heartbeat == "silent" and (tmp / OWNER).exists():
            past = time.time() - 2 * staging.STALE_AFTER_S
            os.utime(tmp / OWNER, (past, past))
        clean_stale(str(run_dir))  # job B starts on another host
        final = run_dir / "checkpoint-3"
        assert check_complete(str(final)).complete, f"killed at {kill_at}: {sorted(os.listdir(run_dir))}"
        assert _content(str(final)) in ("old", "new")
        # later, job A's staging folder goes silent too, and a further start cleans up: step 3 is still there
        if (tmp / OWNER).exists():
            past = time.time() - 2 * staging.STALE_AFTER_S
            os.utime(tmp / OWNER, (past, past))
        clean_stale(str(run_dir))
        assert check_complete(str(final)).complete and _complete_copies(str(run_dir))
        assert not [n for n in os.listdir(run_dir) if n.startswith("_tmp-")]

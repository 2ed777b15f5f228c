"""trl_fp8.checkpoints.staging: a job that starts on a run folder removes only the staging folders nobody writes any
more; a save in progress in another process (a terminating pod's SIGTERM save while its replacement starts) is left
alone."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from trl_fp8.checkpoints import check_complete, clean_stale
from trl_fp8.checkpoints import staging

HERE = os.path.dirname(os.path.abspath(__file__))
OWNER = "trl_fp8_owner.json"


def _staging(run_dir, name, owner=None, age_s=0.0):
    folder = os.path.join(run_dir, name)
    os.makedirs(folder)
    with open(os.path.join(folder, "model.safetensors"), "w") as f:
        f.write("half written")
    if owner is not None:
        path = os.path.join(folder, OWNER)
        with open(path, "w") as f:
            json.dump(owner, f)
        os.utime(path, (time.time() - age_s, time.time() - age_s))
    return folder


def _ended_pid():
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          timeout=60)
    return int(done.stdout)


def test_only_stale_staging_folders_are_removed(tmp_path):
    host = socket.gethostname()
    live_here = _staging(tmp_path, "_tmp-checkpoint-1", {"pid": os.getppid(), "host": host, "started": None})
    ended_here = _staging(tmp_path, "_tmp-checkpoint-2", {"pid": _ended_pid(), "host": host, "started": None})
    fresh_elsewhere = _staging(tmp_path, "_tmp-checkpoint-3", {"pid": 1, "host": host + "-other-pod"},
                               age_s=60)
    silent_elsewhere = _staging(tmp_path, "_tmp-checkpoint-4", {"pid": 1, "host": host + "-other-pod"},
                                age_s=3 * 86400)
    ownerless = _staging(tmp_path, "_tmp-deleting-checkpoint-5")
    done = clean_stale(str(tmp_path))
    assert os.path.isdir(live_here) and os.path.isdir(fresh_elsewhere)
    assert not any(os.path.exists(p) for p in (ended_here, silent_elsewhere, ownerless))
    assert len(done) == 3 and "has ended" in done[0] and "has not refreshed it" in done[1]
    assert 60 < staging.STALE_AFTER_S < 3 * 86400  # the documented age lies between the two


def test_a_folder_this_process_claimed_is_live_until_it_stops_writing_it(tmp_path):
    folder = _staging(tmp_path, "_tmp-checkpoint-7")
    heartbeat = staging.claim(folder)
    try:
        with open(os.path.join(folder, OWNER)) as f:
            owner = json.load(f)
        assert (owner["pid"], owner["host"]) == (os.getpid(), socket.gethostname())
        assert staging.staleness(folder) is None and clean_stale(str(tmp_path)) == []
    finally:
        heartbeat.stop()
    assert staging.staleness(folder) == "this process no longer writes it"  # e.g. a train() that raised mid-save
    assert clean_stale(str(tmp_path)) and not os.path.exists(folder)


@pytest.mark.slow
def test_a_second_job_leaves_a_save_in_progress_alone(tmp_path):
    """Job A (a subprocess) pauses while writing checkpoint-1; job B (this process) starts on the same folder and
    cleans up: A's staging folder survives, and A's checkpoint completes once it goes on."""
    from tests.checkpoints.kill_runner import build_model

    model, out = tmp_path / "model", tmp_path / "run"
    build_model(str(model))
    ready, go = tmp_path / "ready", tmp_path / "go"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(HERE)), os.environ.get("PYTHONPATH", "")])}
    job_a = subprocess.Popen([sys.executable, os.path.join(HERE, "paused_save.py"), str(out), str(model), str(ready),
                              str(go)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while not ready.exists() and job_a.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), job_a.communicate(timeout=60)[0][-3000:] if job_a.poll() is not None else "no save"
        assert clean_stale(str(out)) == []  # job B's start
        assert (out / "_tmp-checkpoint-1" / "model.safetensors").is_file()
        go.touch()
        log = job_a.communicate(timeout=300)[0]
    finally:
        if job_a.poll() is None:
            job_a.kill()
            job_a.wait()
    assert job_a.returncode == 0, log[-3000:]
    assert check_complete(str(out / "checkpoint-1")).complete
    assert not (out / "checkpoint-1" / OWNER).exists()
    assert not [n for n in os.listdir(out) if n.startswith("_tmp-")]

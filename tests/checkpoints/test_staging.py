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


def _here(pid, **more):
    """An owner record of this host, PID namespace and boot."""
    return {"pid": pid, "host": socket.gethostname(), "started": None, "pid_ns": staging._pid_namespace(),
            "boot_id": staging._boot_id(), **more}


def test_only_stale_staging_folders_are_removed(tmp_path):
    host = socket.gethostname()
    live_here = _staging(tmp_path, "_tmp-checkpoint-1", _here(os.getppid()))
    ended_here = _staging(tmp_path, "_tmp-checkpoint-2", _here(_ended_pid()))
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
    folder = str(tmp_path / "_tmp-checkpoint-7")
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


@pytest.mark.parametrize("differs", ["pid_ns", "boot_id", "both_missing"])
def test_an_owner_in_another_pid_namespace_or_boot_is_judged_by_its_heartbeat(tmp_path, differs):
    """Two containers with one host name: the owner's pid means nothing here (it may name no process, or another
    one). Its folder is live while the heartbeat is fresh, stale once it is older than STALE_AFTER_S."""
    elsewhere = _here(_ended_pid())  # no such process in this namespace: the pid rule would call it ended
    if differs == "both_missing":  # an owner file of an older trl_fp8: it does not say where the pid lives
        del elsewhere["pid_ns"], elsewhere["boot_id"]
    else:
        elsewhere[differs] = "pid:[4026531836]-another" if differs == "pid_ns" else "another-boot"
    fresh = _staging(tmp_path, "_tmp-checkpoint-7", elsewhere, age_s=60)
    silent = _staging(tmp_path, "_tmp-checkpoint-8", elsewhere, age_s=3 * 86400)
    done = clean_stale(str(tmp_path))
    assert os.path.isdir(fresh) and not os.path.exists(silent)
    assert len(done) == 1 and "another PID namespace or boot" in done[0] and "has not refreshed it" in done[0]


def test_the_owner_file_records_the_pid_namespace_and_boot(tmp_path):
    heartbeat = staging.claim(str(tmp_path / "_tmp-checkpoint-1"))
    try:
        with open(tmp_path / "_tmp-checkpoint-1" / OWNER) as f:
            owner = json.load(f)
    finally:
        heartbeat.stop()
    assert owner["pid_ns"] == staging._pid_namespace() and owner["boot_id"] == staging._boot_id()
    if os.path.exists("/proc/self/ns/pid"):
        assert owner["pid_ns"].startswith("pid:[") and owner["boot_id"]


def test_a_staging_folder_is_never_seen_without_its_owner(tmp_path, monkeypatch):
    """A job starting (clean_stale) at the moment a save writes its owner file leaves the save's folder alone: the
    folder only gets its name once the owner file is complete in it."""
    import json as json_module

    seen = []
    dump = json_module.dump

    def another_job_starts_meanwhile(obj, f, *a, **kw):
        seen.append(clean_stale(str(tmp_path)))
        return dump(obj, f, *a, **kw)

    monkeypatch.setattr(staging.json, "dump", another_job_starts_meanwhile)
    folder = tmp_path / "_tmp-checkpoint-3"
    heartbeat = staging.claim(str(folder))
    try:
        assert seen == [[]]  # the other job removed nothing
        assert (folder / OWNER).is_file() and staging.staleness(str(folder)) is None
        assert sorted(os.listdir(tmp_path)) == ["_tmp-checkpoint-3"] and os.listdir(folder) == [OWNER]
    finally:
        heartbeat.stop()


def test_an_old_unfinished_claim_is_stale(tmp_path):
    young = tmp_path / "_tmp-claim-young"
    old = tmp_path / "_tmp-claim-old"
    young.mkdir()
    old.mkdir()
    past = time.time() - 2 * staging.STALE_AFTER_S
    os.utime(old, (past, past))
    done = clean_stale(str(tmp_path))
    assert young.is_dir() and not old.exists() and "an unfinished claim" in done[0]


def _fake_trainer(run_dir, step):
    from types import SimpleNamespace

    args = SimpleNamespace(should_save=True, save_on_each_node=False, world_size=1, process_index=0,
                           push_to_hub=False, save_total_limit=None)
    accelerator = SimpleNamespace(wait_for_everyone=lambda: None)
    return SimpleNamespace(args=args, accelerator=accelerator, state=SimpleNamespace(global_step=step))


def test_a_checkpoint_save_refuses_a_staging_folder_another_process_writes(tmp_path, monkeypatch):
    """The live-owner rule of the final-model save holds for checkpoints too: a save of step 7 that finds another
    live process's _tmp-checkpoint-7 raises instead of deleting it."""
    from trl_fp8 import _trl
    from trl_fp8.checkpoints import save

    monkeypatch.setattr(_trl, "run_dir", lambda trainer, trial: str(tmp_path))
    live = _staging(tmp_path, "_tmp-checkpoint-7", _here(os.getppid()))
    with pytest.raises(staging.StagingBusy, match="being written by another process"):
        save.save_checkpoint(_fake_trainer(str(tmp_path), 7), None)
    assert (tmp_path / "_tmp-checkpoint-7" / "model.safetensors").is_file() and os.path.isdir(live)


def test_a_checkpoint_save_puts_a_stale_complete_staging_copy_into_place_first(tmp_path, monkeypatch):
    """A stale, complete _tmp-checkpoint-7 while checkpoint-7 is missing is the step's only copy: a new save of step 7
    puts it into place (its own commit then replaces it) instead of deleting it."""
    from trl_fp8 import _trl
    from trl_fp8.checkpoints import commit, save

    monkeypatch.setattr(_trl, "run_dir", lambda trainer, trial: str(tmp_path))
    folder = _staging(tmp_path, "_tmp-checkpoint-7")
    commit(folder, str(tmp_path / "checkpoint-7"))
    os.rename(tmp_path / "checkpoint-7", folder)  # as if killed between the marker and the rename
    _staging_owner = _here(_ended_pid())
    with open(os.path.join(folder, OWNER), "w") as f:
        json.dump(_staging_owner, f)
    monkeypatch.setattr(save, "_stage", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("killed while staging")))
    with pytest.raises(RuntimeError, match="killed while staging"):
        save.save_checkpoint(_fake_trainer(str(tmp_path), 7), None)
    assert check_complete(str(tmp_path / "checkpoint-7")).complete


def _another_vm(pid=4242):
    """An owner record of a process on another machine (a new Colab/Kaggle VM resumes the run of a dead one)."""
    return {"pid": pid, "host": socket.gethostname() + "-dead-vm", "started": 1.0, "pid_ns": "pid:[1]",
            "boot_id": "another-boot"}


def test_a_resumed_run_takes_over_its_dead_predecessor_s_fresh_staging_folder(tmp_path, monkeypatch):
    """Killed while saving step 4 on one VM, resumed on another that reaches step 4's save within STALE_AFTER_S of the
    dead run's last heartbeat: the save watches the heartbeat for WATCH_S, sees it still, and takes the folder over
    (before: StagingBusy, and the resumed run died where it should carry on)."""
    monkeypatch.setattr(staging, "WATCH_S", 0.5)
    dead = _staging(tmp_path, "_tmp-checkpoint-4", _another_vm(), age_s=20)
    assert staging.staleness(dead) is None  # by age alone it would still count as live
    begun = time.monotonic()
    done = staging.take_over(dead, "checkpoint-4")
    assert time.monotonic() - begun >= 0.5  # it watched
    assert "did not refresh it in 0 s of watching" in done or "did not refresh it in 1 s of watching" in done, done
    assert not os.path.exists(dead)  # the dead run's half-written folder is gone: the save can claim it
    heartbeat = staging.claim(dead)
    heartbeat.stop()


def test_a_live_save_on_another_machine_is_still_refused(tmp_path, monkeypatch):
    """Another process (here a second one, on 'another machine' by its owner record) refreshes the heartbeat: the
    watch sees it move, and the save refuses the folder instead of deleting a save in progress."""
    monkeypatch.setattr(staging, "WATCH_S", 3.0)
    folder = _staging(tmp_path, "_tmp-checkpoint-5", _another_vm(), age_s=5)
    beat = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time\n"
        "path = sys.argv[1]\n"
        "for _ in range(60):\n"
        "    os.utime(path)\n"
        "    time.sleep(0.1)\n"), os.path.join(folder, OWNER)])
    try:
        with pytest.raises(staging.StagingBusy, match="being written by another process"):
            staging.take_over(folder, "checkpoint-5")
    finally:
        beat.kill()
        beat.wait()
    assert (tmp_path / "_tmp-checkpoint-5" / "model.safetensors").is_file()


def test_a_claim_refuses_a_folder_that_appeared_after_the_take_over(tmp_path):
    """Two jobs in the window between take_over and claim: the second claim finds the first's folder and refuses it
    (before: it wrote its own owner file into the other job's folder, and both wrote one folder)."""
    first = staging.claim(str(tmp_path / "_tmp-checkpoint-6"))
    try:
        with open(tmp_path / "_tmp-checkpoint-6" / OWNER) as f:
            owner = f.read()
        with pytest.raises(staging.StagingBusy, match="claimed by another process"):
            staging.claim(str(tmp_path / "_tmp-checkpoint-6"))
        with open(tmp_path / "_tmp-checkpoint-6" / OWNER) as f:
            assert f.read() == owner  # the first job's owner file, untouched
        assert [n for n in os.listdir(tmp_path) if n.startswith("_tmp-claim-")] == []  # no draft left behind
    finally:
        first.stop()

"""`trl-fp8 grpo` under a scheduler: a SIGTERM sent to the launcher reaches the training process (accelerate's
one-process launcher does not pass it on), and a run stopped to be resumed — by a SIGTERM or its time budget — exits
with status 75 (EX_TEMPFAIL), not 0, so a Kubernetes Job or a requeue script runs it again."""

import os
import signal
import subprocess
import sys
import time

import pytest

from trl_fp8.app.scripts import EXIT_RESUMABLE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(REPO, "recipes", "demo_grpo.yaml")


def _launch(out, *extra):
    cmd = [sys.executable, "-m", "trl_fp8.app.cli", "grpo", "--config", RECIPE, "--output_dir", str(out),
           "--metrics_jsonl", str(out / "metrics.jsonl"), "--per_device_train_batch_size", "16", "--logging_steps", "1",
           "--max_completion_length", "8", *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop("TRL_FP8_TIME_BUDGET", None)
    return subprocess.Popen(cmd, cwd=out.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group: whatever it leaves is killed after


def _finish(proc, timeout):
    try:
        return proc.communicate(timeout=timeout)[0]
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and anything it left running
        except ProcessLookupError:
            pass


def _wait_for_a_step(proc, out):
    """Until training has started (a step is logged); the run must still be going."""
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        if (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().count("\n") >= 1:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before the signal"


def _checkpoints(out):
    from trl_fp8.checkpoints import check_complete

    return {n: check_complete(str(out / n)).complete for n in os.listdir(out) if n.startswith("checkpoint-")}


def test_exit_status_75_is_documented_in_the_help(capsys):
    from trl_fp8.app.cli import main

    assert main(["--help"]) == 0
    assert "75 (EX_TEMPFAIL) stopped before max_steps" in capsys.readouterr().out
    from trl_fp8.app.scripts.grpo import make_parser

    assert f"{EXIT_RESUMABLE} (EX_TEMPFAIL) when its time budget" in make_parser().format_help().replace("\n", " ")


@pytest.mark.slow
def test_a_sigterm_to_the_launcher_saves_and_exits_75(tmp_path):
    out = tmp_path / "run"
    proc = _launch(out, "--max_steps", "1000", "--time_budget", "10h")
    try:
        _wait_for_a_step(proc, out)
        proc.send_signal(signal.SIGTERM)  # to the launcher only, as Kubernetes signals a container's first process
        log = proc.communicate(timeout=300)[0]
    finally:
        _finish(proc, 1)
    assert proc.returncode == EXIT_RESUMABLE, log[-3000:]
    saved = _checkpoints(out)
    assert len(saved) == 1 and all(saved.values()), saved
    assert "SIGTERM received" in log and "--resume_from_checkpoint auto" in log


def test_a_launcher_killed_outright_stops_the_training_process_with_a_checkpoint(tmp_path):
    """SIGKILL to the launcher alone (the OOM killer, `kill -9` on the pid a user sees): the training process it
    started is not left training on, orphaned — Linux's parent-death signal gives it a SIGTERM, it saves at the step's
    end and exits. (Before, it trained to max_steps alone, writing into the run's folder.)"""
    import psutil

    out = tmp_path / "run"
    proc = _launch(out, "--max_steps", "1000", "--time_budget", "10h")
    try:
        _wait_for_a_step(proc, out)
        trainers = psutil.Process(proc.pid).children()
        assert len(trainers) == 1, trainers
        proc.kill()  # the launcher only
        log = proc.communicate(timeout=60)[0]
        gone, alive = psutil.wait_procs(trainers, timeout=300)
        assert not alive, "the training process outlived its launcher by 300 s"
    finally:
        _finish(proc, 1)
    saved = _checkpoints(out)
    assert len(saved) == 1 and all(saved.values()), (saved, log[-3000:])
    steps = (out / "metrics.jsonl").read_text().count('"loss"')
    assert steps < 1000 and f"checkpoint-{steps}" in saved, (steps, saved)


def test_following_the_launcher_is_armed_only_for_the_launchers_own_child(monkeypatch):
    from trl_fp8.app import scripts

    monkeypatch.delenv(scripts.SIGNALS_FORWARDED_ENV, raising=False)
    assert scripts.follow_the_launcher() is False  # not launched by `trl-fp8 grpo`
    monkeypatch.setenv(scripts.SIGNALS_FORWARDED_ENV, "1")
    assert scripts.follow_the_launcher() is False  # an older launcher's value: no pid to follow
    # a process whose parent is not the launcher named (a launch in between, still running): not armed
    monkeypatch.setenv(scripts.SIGNALS_FORWARDED_ENV, str(os.getpid()))
    assert scripts.follow_the_launcher() is False
    monkeypatch.setenv(scripts.SIGNALS_FORWARDED_ENV, str(os.getppid()))
    if sys.platform.startswith("linux"):
        try:
            assert scripts.follow_the_launcher() is True
        finally:
            import ctypes

            ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)  # disarmed: pytest's parent may end before pytest does


def test_a_launcher_gone_before_training_starts_stops_the_process(tmp_path):
    """The launcher died between starting the process and the process arming its parent-death signal: it stops
    before anything loads."""
    code = ("import os, sys; from trl_fp8.app.scripts import follow_the_launcher; follow_the_launcher(); "
            "print('trained on')")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer exists
    env = {**os.environ, "TRL_FP8_SIGNALS_FORWARDED": str(dead.pid)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert "trained on" not in done.stdout and f"launcher (pid {dead.pid}) is gone" in done.stderr


@pytest.mark.slow
def test_a_run_its_time_budget_stopped_exits_75(tmp_path):
    out = tmp_path / "run"
    proc = _launch(out, "--max_steps", "1000", "--time_budget", "1s")  # the process is older than that at step 1
    log = _finish(proc, 600)
    assert proc.returncode == EXIT_RESUMABLE, log[-3000:]
    assert _checkpoints(out) == {"checkpoint-1": True}


def test_the_launchers_report_becomes_the_exit_status(tmp_path, monkeypatch, capsys):
    """One process: accelerate's CalledProcessError (killed by signal N -> 128 + N); several: torchrun's
    ChildFailedError with the first failed rank's status (75 after a budget stop)."""
    import subprocess

    import accelerate.commands.launch as launch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from trl_fp8.app.cli import main

    def failing(error):
        def launch_command(args):
            raise error
        return launch_command

    argv = ["grpo", "--config", RECIPE, "--output_dir", str(tmp_path / "run")]
    for error, status in ((subprocess.CalledProcessError(75, "python"), 75),
                          (subprocess.CalledProcessError(-9, "python"), 137),
                          (ChildFailedError("grpo", {0: ProcessFailure(0, 1, 75, str(tmp_path / "none.json"))}), 75),
                          (ChildFailedError("grpo", {1: ProcessFailure(1, 2, 1, str(tmp_path / "none.json"))}), 1)):
        monkeypatch.setattr(launch, "launch_command", failing(error))
        assert main(argv) == status
    assert "run the same command again" in capsys.readouterr().err

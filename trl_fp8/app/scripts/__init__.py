"""Training scripts launched by the ``trl-fp8`` CLI through ``accelerate launch``."""

import os
import signal
import sys

from ...time_budget import SIGNALS_FORWARDED_ENV  # set by `trl-fp8 grpo` (the launcher's pid) for what it launches

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def follow_the_launcher() -> bool:
    """A training process that ``trl-fp8 grpo`` launched gets a SIGTERM when its launcher dies (Linux's parent-death
    signal), so a launcher killed outright — SIGKILL, the OOM killer — does not leave the training running on alone,
    orphaned, holding its GPU and writing into the run's folder: the SIGTERM makes it save at the step's end and exit
    75, as a SIGTERM to the launcher does. A launcher already gone when this runs stops the process here (nothing is
    trained yet). Returns whether the signal is armed: not off Linux, not for a process that the launcher did not
    start itself, not without ``$TRL_FP8_SIGNALS_FORWARDED`` holding the launcher's pid."""
    value = os.environ.get(SIGNALS_FORWARDED_ENV, "")
    if not value.isdigit() or not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    if prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        return False
    launcher = int(value)
    if os.getppid() == launcher:
        return True
    try:  # another parent: a launch in between (it is not ours to follow), or the launcher died before prctl
        os.kill(launcher, 0)
        alive = True
    except ProcessLookupError:
        alive = False
    except PermissionError:
        alive = True
    prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0)
    if not alive:
        print(f"trl_fp8: the launcher (pid {launcher}) is gone before training started: stopping.", file=sys.stderr)
        raise SystemExit(128 + int(signal.SIGTERM))
    return False

# The exit status of a training script that stopped before max_steps to be resumed (its time budget ran out, or a
# SIGTERM came): EX_TEMPFAIL from sysexits.h, "try again later". A Kubernetes Job's podFailurePolicy or a requeue
# script tells it from 0 (finished) and from a failure, and runs the same command again.
EXIT_RESUMABLE = 75

"""Training scripts launched by the ``trl-fp8`` CLI through ``accelerate launch``."""

from ...time_budget import SIGNALS_FORWARDED_ENV  # noqa: F401  (set by `trl-fp8 grpo` for the process it launches)

# The exit status of a training script that stopped before max_steps to be resumed (its time budget ran out, or a
# SIGTERM came): EX_TEMPFAIL from sysexits.h, "try again later". A Kubernetes Job's podFailurePolicy or a requeue
# script tells it from 0 (finished) and from a failure, and runs the same command again.
EXIT_RESUMABLE = 75

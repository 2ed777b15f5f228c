"""Weight-sync checks: seven explicit assertions that the sampler serves what the learner trains."""

from .checks import CHECKS, DEFAULT_CHECKS, WeightSyncError, WeightSyncWarning, resolve_checks

__all__ = ["CHECKS", "DEFAULT_CHECKS", "WeightSyncError", "WeightSyncWarning", "resolve_checks"]

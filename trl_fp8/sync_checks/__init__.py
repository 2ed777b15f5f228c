"""Weight-sync checks: seven explicit assertions that the sampler serves what the learner trains.

The names below are imported on first use, so that the memory plan can read :mod:`trl_fp8.sync_checks.memory` (pure
arithmetic) without importing torch.
"""

__all__ = ["CHECKS", "DEFAULT_CHECKS", "WeightSyncError", "WeightSyncWarning", "resolve_checks"]


def __getattr__(name):
    if name in ("CHECKS", "DEFAULT_CHECKS", "resolve_checks"):
        from . import names

        return getattr(names, name)
    if name in __all__:
        from . import checks

        return getattr(checks, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

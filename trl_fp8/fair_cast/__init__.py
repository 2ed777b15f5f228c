"""Fair Cast: unbiased export of fp32 master weights into the served low-precision copy.

The names below are imported on first use, so that the memory plan can read :mod:`trl_fp8.fair_cast.memory` (pure
arithmetic) without importing torch.
"""

__all__ = ["ErrorFeedback", "error_feedback_round", "round_nearest", "rtn_plus_noise", "stochastic_round", "ulp"]


def __getattr__(name):
    if name in __all__:
        from . import rounding

        return getattr(rounding, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

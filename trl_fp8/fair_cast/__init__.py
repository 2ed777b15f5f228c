"""Fair Cast: unbiased export of fp32 master weights into the served low-precision copy."""

from .rounding import ErrorFeedback, error_feedback_round, round_nearest, stochastic_round, ulp

__all__ = ["ErrorFeedback", "error_feedback_round", "round_nearest", "stochastic_round", "ulp"]

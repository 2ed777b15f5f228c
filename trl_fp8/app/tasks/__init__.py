"""Built-in verifiable tasks for offline demos and tests."""

from .arithmetic import correctness_reward, extract_boxed, format_reward, make_arithmetic_dataset

__all__ = ["correctness_reward", "extract_boxed", "format_reward", "make_arithmetic_dataset"]

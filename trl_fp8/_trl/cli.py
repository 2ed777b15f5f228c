"""TRL's command line: its accelerate configs."""

from __future__ import annotations


# -- TRL's command line --------------------------------------------------------------------------------------------
def resolve_accelerate_config(args: list[str]) -> list[str]:
    """``--accelerate_config NAME`` resolved as ``trl grpo`` resolves it (TRL's named configs or a file)."""
    from trl.cli.accelerate_config import resolve_accelerate_config_argument

    return resolve_accelerate_config_argument(args)


def subtract_subsequence(sequence: list[str], subsequence: list[str]) -> list[str]:
    """What ``trl grpo`` uses to split its arguments between the script and ``accelerate launch``."""
    from trl.cli.commands.training import _subtract_subsequence

    return _subtract_subsequence(sequence, subsequence)

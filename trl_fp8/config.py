"""``trl_fp8.GRPOConfig``: TRL's ``GRPOConfig`` plus the trl_fp8 fields.

Every trl_fp8 field is a dataclass field with ``metadata={"help": ...}``, so ``TrlParser``, YAML recipes and
the ``trl-fp8`` CLI see it like any TRL field. With every trl_fp8 field at its default the trainer behaves
exactly like ``trl.GRPOTrainer``. Invalid values raise ``ValueError`` in ``__post_init__`` (config time),
naming the field and what is allowed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from trl import GRPOConfig as _TRLGRPOConfig

# Names of the fields trl_fp8 adds on top of trl.GRPOConfig (kept in sync by a test).
TRL_FP8_FIELDS: tuple[str, ...] = ("metrics_jsonl",)


@dataclass
class GRPOConfig(_TRLGRPOConfig):
    r"""
    Configuration for [`trl_fp8.GRPOTrainer`]: every parameter of [`trl.GRPOConfig`] plus the ones below.

    Parameters:
        > trl_fp8: reporting

        metrics_jsonl (`str`, *optional*):
            Path of a JSON-lines file to which every logged metrics record is appended (one JSON object per
            line, with `step` and `epoch`), on the main process only. `None` (default) writes nothing.
    """

    metrics_jsonl: str | None = field(
        default=None,
        metadata={
            "help": "trl_fp8: path of a JSON-lines file that receives every logged metrics record (one JSON object "
            "per line, with `step` and `epoch`), written by the main process. None (default) writes nothing."
        },
    )

    def __post_init__(self):
        self._validate_trl_fp8_fields()
        super().__post_init__()

    def _validate_trl_fp8_fields(self) -> None:
        if self.metrics_jsonl is not None:
            if not isinstance(self.metrics_jsonl, (str, os.PathLike)) or not str(self.metrics_jsonl).strip():
                raise ValueError(
                    f"metrics_jsonl must be a non-empty file path or None, got {self.metrics_jsonl!r}."
                )
            self.metrics_jsonl = os.fspath(self.metrics_jsonl)
            if os.path.isdir(self.metrics_jsonl):
                raise ValueError(
                    f"metrics_jsonl={self.metrics_jsonl!r} is a directory; give a file path such as "
                    f"'{os.path.join(self.metrics_jsonl, 'metrics.jsonl')}'."
                )

    def trl_fp8_fields(self) -> dict:
        """The trl_fp8-specific fields and their values (handy for logging a run's recipe)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in TRL_FP8_FIELDS}


def check_choice(field_name: str, value, allowed) -> None:
    """Raise a ``ValueError`` naming ``field_name`` and the allowed values unless ``value`` is one of them."""
    if value not in allowed:
        allowed_text = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{field_name}={value!r} is not valid; allowed values: {allowed_text}.")

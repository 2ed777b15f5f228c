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

from .capability import check_choice  # noqa: F401  (re-exported: part of trl_fp8.config's API)
from .composition import check_conflicts
from .precision import PrecisionArgs, resolve_precision
from .registry import CAPABILITIES
from . import serving
from .serving import ServingArgs


@dataclass
class ReportingArgs:
    metrics_jsonl: str | None = field(
        default=None,
        metadata={
            "help": "trl_fp8: path of a JSON-lines file that receives every logged metrics record (one JSON object "
            "per line, with `step` and `epoch`), written by the main process. None (default) writes nothing."
        },
    )


_MIXINS = (ReportingArgs, PrecisionArgs, ServingArgs) + tuple(c.Args for c in CAPABILITIES if c.Args is not None)
# Names of the fields trl_fp8 adds on top of trl.GRPOConfig (every field of the capabilities' mixins).
TRL_FP8_FIELDS: tuple[str, ...] = tuple(f.name for mixin in _MIXINS for f in fields(mixin))


@dataclass
class GRPOConfig(*_MIXINS, _TRLGRPOConfig):
    r"""
    Configuration for [`trl_fp8.GRPOTrainer`]: every parameter of [`trl.GRPOConfig`] plus the trl_fp8 fields, one
    dataclass mixin per capability (their ``metadata["help"]`` is what ``TrlParser``, ``trl-fp8 grpo --help`` and the
    generated reference ``docs/configuration.md`` show: ``python -m trl_fp8.config`` prints it).
    """

    def __post_init__(self):
        # sets bf16/fp16 before TRL (unset bf16 -> True) and transformers read them
        resolve_precision(self, CAPABILITIES)
        super().__post_init__()
        self.validate_trl_fp8()

    def validate_trl_fp8(self) -> None:
        """Every trl_fp8 check of the fields, their combinations and the process layout: run when the config is built
        and again when a :class:`trl_fp8.GRPOTrainer` is (a field set after construction — ``args.fair_cast = ...``
        in a notebook — is checked too). ``ValueError`` naming the field(s) and what is allowed."""
        self._validate_metrics_jsonl()
        serving.validate(self)
        for capability in CAPABILITIES:
            capability.validate(self)
        check_conflicts(CAPABILITIES, self)  # declared per capability
        self._admit_layout()

    def _admit_layout(self) -> None:
        """Refuse, at config time, a capability asked for under a process layout it does not support: DeepSpeed/FSDP from
        ``args`` *or* from an accelerate config (the environment ``accelerate launch`` sets); checked again at
        trainer start (:func:`trl_fp8.distributed.admit`). A capability on by default is left to the trainer."""
        from .distributed import admit, detect_config

        layout = detect_config(self)
        for capability in CAPABILITIES:
            soft = capability.soft_default is not None and capability.soft_default(self, CAPABILITIES)
            if capability.wanted(self) and not soft:
                admit(capability, self, layout)

    def _validate_metrics_jsonl(self) -> None:
        if self.metrics_jsonl is None:
            return
        if not isinstance(self.metrics_jsonl, (str, os.PathLike)) or not str(self.metrics_jsonl).strip():
            raise ValueError(f"metrics_jsonl must be a non-empty file path or None, got {self.metrics_jsonl!r}.")
        self.metrics_jsonl = os.fspath(self.metrics_jsonl)
        if os.path.isdir(self.metrics_jsonl):
            raise ValueError(
                f"metrics_jsonl={self.metrics_jsonl!r} is a directory; give a file path such as "
                f"'{os.path.join(self.metrics_jsonl, 'metrics.jsonl')}'."
            )

    def trl_fp8_fields(self) -> dict:
        """The trl_fp8-specific fields and their values (handy for logging a run's recipe)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in TRL_FP8_FIELDS}


# -- the field reference (docs/configuration.md), generated from the fields' metadata -----------------------------
def _default_text(f) -> str:
    from dataclasses import MISSING

    if f.default is not MISSING:
        value = f.default
    elif f.default_factory is not MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    return f"`{value!r}`"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def field_reference() -> str:
    """Every field trl_fp8 adds to ``GRPOConfig``, grouped by capability, as Markdown tables built from the fields'
    metadata (help, choices) and defaults: the text of ``docs/configuration.md`` (a test keeps the two equal)."""
    titles = {ReportingArgs: "Reporting", PrecisionArgs: "Precision", ServingArgs: "Serving a LoRA policy"}
    titles.update({c.Args: f"{c.__name__} (`{c.name}`)" for c in CAPABILITIES if c.Args is not None})
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from the fields' metadata by `python -m trl_fp8.config > docs/configuration.md`; do not edit. -->",
        "",
        "`trl_fp8.GRPOConfig` is `trl.GRPOConfig` plus the fields below (every TRL field keeps its meaning). With each",
        "of them at its default, training is TRL's. Invalid values and combinations raise `ValueError` when the config",
        "is built, naming the field and what is allowed. `resume_from_checkpoint` (transformers' field) also takes",
        "`\"auto\"` (see [Free tier](free-tier.md)).",
    ]
    for mixin in _MIXINS:
        lines += ["", f"## {titles.get(mixin, mixin.__name__)}", "", "| field | default | allowed | meaning |",
                  "|---|---|---|---|"]
        for f in fields(mixin):
            meaning = f.metadata.get("help", "").removeprefix("trl_fp8: ")
            choices = f.metadata.get("choices")
            allowed = ", ".join(f"`{c!r}`" for c in choices) if choices else ""
            lines.append(f"| `{f.name}` | {_cell(_default_text(f))} | {_cell(allowed)} | {_cell(meaning)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(field_reference(), end="")

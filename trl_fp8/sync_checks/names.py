"""The seven weight-sync checks by name, the presets, and ``sync_checks`` resolved to names — the one home of both,
read by the checks (:mod:`trl_fp8.sync_checks.checks`) and the memory plan (:mod:`trl_fp8.sync_checks.memory`).
Pure Python: the plan imports it without torch."""

from __future__ import annotations

CHECKS = (
    "recipe_parity", "coverage", "freshness", "quant_parity", "logprob_agreement", "differential_oracle",
    "cache_hygiene",
)
# Cheap enough to leave on every step in production (the differential oracle reloads the weights several times).
DEFAULT_CHECKS = tuple(c for c in CHECKS if c != "differential_oracle")


def resolve_checks(value) -> tuple[str, ...]:
    """``"default"`` / ``"all"`` / ``"off"`` or a list of check names -> the tuple of checks to run."""
    if isinstance(value, str):
        presets = {"default": DEFAULT_CHECKS, "all": CHECKS, "off": ()}
        if value in presets:
            return presets[value]
        value = [v.strip() for v in value.split(",") if v.strip()]
    names = list(value)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise ValueError(
            f"sync_checks: unknown check(s) {', '.join(map(repr, unknown))}; known checks: {', '.join(CHECKS)} "
            "(or one of 'default', 'all', 'off')."
        )
    return tuple(c for c in CHECKS if c in names)

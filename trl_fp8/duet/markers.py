"""Answer markers by domain (DUET axis 2): a rollout that shows one has committed to an answer."""

from __future__ import annotations

import re

MARKER_PRESETS: dict[str, tuple[str, ...]] = {
    "math": (r"\\boxed\{[^{}]*\}", r"Final answer:\s*\S+"),
    "code": (r"```[^\n]*\n[\s\S]*?```",),  # a closed fence
    "qa": (r"<answer>[\s\S]*?</answer>", r"[Tt]he answer is\s+\S+"),
}


def compile_markers(spec, field_name: str = "duet_markers") -> tuple[re.Pattern, ...]:
    """Preset names (``"math"``, ``"code"``, ``"qa"``) and/or regular expressions -> compiled patterns.

    ``spec`` is one preset name or a non-empty list whose entries are preset names or regexes.
    """
    if isinstance(spec, str):
        if spec not in MARKER_PRESETS:
            raise ValueError(
                f"{field_name}={spec!r} is not valid; allowed: {', '.join(map(repr, MARKER_PRESETS))} or a list of "
                "preset names and regular expressions."
            )
        spec = [spec]
    if not isinstance(spec, (list, tuple)) or not spec:
        raise ValueError(f"{field_name} must be a preset name or a non-empty list of markers, got {spec!r}.")
    patterns = []
    for item in spec:
        if not isinstance(item, str) or not item:
            raise ValueError(f"{field_name}: every marker must be a non-empty string, got {item!r}.")
        for regex in MARKER_PRESETS.get(item, (item,)):
            try:
                patterns.append(re.compile(regex))
            except re.error as err:
                raise ValueError(f"{field_name}: invalid regular expression {item!r}: {err}.") from err
    return tuple(patterns)


class MarkerDetector:
    def __init__(self, spec="math"):
        self.patterns = compile_markers(spec)

    def found(self, text: str) -> bool:
        return any(p.search(text) for p in self.patterns)

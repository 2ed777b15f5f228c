"""The time budget's pure core: durations as users write them, and the planner that decides when to save and stop.

Nothing here knows about TRL, transformers or clocks: the caller measures (seconds, from any clock) and asks.

The rule (after each optimizer step): training goes on only while one more step *and then* a save would still end
``margin`` before the budget, with both estimates inflated by :data:`SAFETY`::

    elapsed + SAFETY * (step + save) + margin < budget

Otherwise: save now and stop. ``step`` is the longest of the last :data:`STEP_WINDOW` steps (a GRPO step that
generates is longer than one that reuses a generation batch; the first ones pay warm-up), ``save`` the longest of the
last :data:`SAVE_WINDOW` measured saves, or a prior before any save was measured. Late is cheap (one step less in
this session), too late is not (everything since the last complete checkpoint is lost), hence maxima and the factor.
"""

from __future__ import annotations

import math
import re
from collections import deque
from dataclasses import dataclass

SAFETY = 1.25  # both estimates are inflated by this factor
STEP_WINDOW = 16  # steps whose longest sets the step estimate
SAVE_WINDOW = 8  # measured saves whose longest sets the save estimate
SAVE_PRIOR_FRACTION, SAVE_PRIOR_CAP_S = 0.05, 120.0  # a save before one was measured: 5% of the budget, at most 2 min
MARGIN_FRACTION, MARGIN_CAP_S = 0.05, 60.0  # default margin: 5% of the budget, at most 1 min

FORMS = "seconds (e.g. 41400), or a duration such as '11h30m', '90m', '45s', '1h', '1d2h' or '11:30:00' (H:MM:SS)"
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"
_UNITS = re.compile(
    rf"(?:{_NUMBER}\s*d)?\s*(?:{_NUMBER}\s*h)?\s*(?:{_NUMBER}\s*m)?\s*(?:{_NUMBER}\s*s)?", re.IGNORECASE
)
_CLOCK = re.compile(r"(\d+):([0-5]\d):([0-5]\d(?:\.\d*)?)")
_SCALES = (86400.0, 3600.0, 60.0, 1.0)


def parse_duration(value, name: str = "time_budget", allow_zero: bool = False) -> float:
    """Seconds in ``value``: a number of seconds (int, float or a numeric string), ``'11h30m'``-style units (d, h, m,
    s, each at most once, in that order, e.g. ``'90m'``, ``'1.5h'``, ``'1h 30m'``) or ``'H:MM:SS'``.

    Raises a ``ValueError`` naming ``name`` and the accepted forms for anything else, and for a duration that is not
    > 0 (>= 0 with ``allow_zero``) or not finite.
    """
    seconds = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            clock = _CLOCK.fullmatch(text)
            units = _UNITS.fullmatch(text) if clock is None else None
            if clock is not None:
                h, m, s = clock.groups()
                seconds = int(h) * 3600.0 + int(m) * 60.0 + float(s)
            elif text and units is not None and any(units.groups()):
                seconds = sum(float(g) * scale for g, scale in zip(units.groups(), _SCALES) if g is not None)
    if seconds is None or math.isnan(seconds):
        raise ValueError(f"{name}={value!r} is not a duration; give {FORMS}.")
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}={value!r}: the duration must be finite and {bound}; give {FORMS}.")
    return seconds


def format_duration(seconds: float) -> str:
    """A short human form: ``'11h30m'``, ``'4m05s'``, ``'12.3s'``, ``'-2m00s'``."""
    sign = "-" if seconds < 0 else ""
    seconds = abs(float(seconds))
    if seconds < 60:
        return f"{sign}{seconds:.1f}s"
    total = int(round(seconds))
    h, rest = divmod(total, 3600)
    m, s = divmod(rest, 60)
    if h:
        return f"{sign}{h}h{m:02d}m"
    return f"{sign}{m}m{s:02d}s"


def default_margin(budget_s: float) -> float:
    return min(MARGIN_CAP_S, MARGIN_FRACTION * budget_s)


def default_save_prior(budget_s: float) -> float:
    return min(SAVE_PRIOR_CAP_S, SAVE_PRIOR_FRACTION * budget_s)


@dataclass(frozen=True)
class Decision:
    stop: bool  # save a checkpoint now and stop
    elapsed_s: float  # what counts against the budget
    remaining_s: float  # budget - elapsed (negative once over)
    step_s: float  # step estimate (0 before any step was measured)
    save_s: float  # save estimate
    reserve_s: float  # what one more step and a save need: SAFETY * (step + save) + margin
    late: bool  # even a save started now is expected to end after the budget


class BudgetPlanner:
    """Decides, from measured step and save durations, when a run must save and stop to end within its budget."""

    def __init__(self, budget_s: float, margin_s: float | None = None, *, save_prior_s: float | None = None,
                 safety: float = SAFETY, step_window: int = STEP_WINDOW, save_window: int = SAVE_WINDOW):
        if not budget_s > 0:
            raise ValueError(f"budget_s must be > 0, got {budget_s!r}")
        self.budget_s = float(budget_s)
        self.margin_s = default_margin(self.budget_s) if margin_s is None else float(margin_s)
        self.save_prior_s = default_save_prior(self.budget_s) if save_prior_s is None else float(save_prior_s)
        self.safety = float(safety)
        self.steps: deque[float] = deque(maxlen=step_window)
        self.saves: deque[float] = deque(maxlen=save_window)

    def record_step(self, seconds: float) -> None:
        self.steps.append(max(0.0, float(seconds)))

    def record_save(self, seconds: float) -> None:
        self.saves.append(max(0.0, float(seconds)))

    def step_estimate(self) -> float:
        return max(self.steps, default=0.0)

    def save_estimate(self) -> float:
        return max(self.saves) if self.saves else self.save_prior_s

    def decide(self, elapsed_s: float) -> Decision:
        step, save = self.step_estimate(), self.save_estimate()
        reserve = self.safety * (step + save) + self.margin_s
        return Decision(
            stop=elapsed_s + reserve >= self.budget_s,
            elapsed_s=float(elapsed_s),
            remaining_s=self.budget_s - elapsed_s,
            step_s=step,
            save_s=save,
            reserve_s=reserve,
            late=elapsed_s + save > self.budget_s,
        )

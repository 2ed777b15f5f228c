"""The time budget's pure core: the duration parser and the planner, with exact expectations (no clock at all)."""

import math

import pytest

from trl_fp8.time_budget.core import (
    SAFETY, BudgetPlanner, default_margin, default_save_prior, format_duration, parse_duration,
)


@pytest.mark.parametrize("value, seconds", [
    ("11h30m", 41400), ("90m", 5400), ("45s", 45), ("1h", 3600), ("1d2h", 93600), ("1h30m15s", 5415),
    ("1.5h", 5400), ("1h 30m", 5400), (" 11H30M ", 41400), ("2m30.5s", 150.5), ("11:30:00", 41400),
    ("0:00:45", 45), ("3600", 3600), ("3600.5", 3600.5), ("1e3", 1000), (41400, 41400), (12.5, 12.5),
])
def test_parse_duration_accepts(value, seconds):
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", [
    "11x", "h", "30m11h", "1h30", "5ms", "1:2:3", "11:60:00", "-5m", "", "  ", "nan", "1h1h", True, None, [1], "m5",
])
def test_parse_duration_refuses_with_the_field_and_the_forms(value):
    with pytest.raises(ValueError, match=r"time_budget=.*(is not a duration|must be finite).*'11h30m'.*'90m'"):
        parse_duration(value)


@pytest.mark.parametrize("value", [0, "0", "0s", -1, "-3", math.inf, "inf"])
def test_parse_duration_refuses_zero_negative_and_infinite(value):
    with pytest.raises(ValueError, match=r"time_budget=.*must be finite and > 0"):
        parse_duration(value)


def test_parse_duration_names_the_given_source_and_allows_zero_when_asked():
    with pytest.raises(ValueError, match=r"^TRL_FP8_TIME_BUDGET \(time_budget\)='soon' is not a duration"):
        parse_duration("soon", "TRL_FP8_TIME_BUDGET (time_budget)")
    assert parse_duration("0", "time_budget_margin", allow_zero=True) == 0
    with pytest.raises(ValueError, match=r"time_budget_margin=-1: the duration must be finite and >= 0"):
        parse_duration(-1, "time_budget_margin", allow_zero=True)


@pytest.mark.parametrize("seconds, text", [
    (41400, "11h30m"), (41399.6, "11h30m"), (245, "4m05s"), (12.34, "12.3s"), (-120, "-2m00s"), (3600, "1h00m"),
])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_defaults_scale_with_the_budget_and_are_capped():
    assert default_margin(100) == 5 and default_margin(41400) == 60
    assert default_save_prior(100) == 5 and default_save_prior(41400) == 120


def test_planner_goes_on_while_a_step_and_a_save_fit_and_stops_at_the_last_step_that_leaves_room():
    p = BudgetPlanner(100, margin_s=0, save_prior_s=5)
    stops = []
    for k in range(1, 11):  # steps of 10 s: after step k, 10k s are used
        p.record_step(10)
        stops.append(p.decide(10 * k).stop)
    # reserve = 1.25 * (10 + 5) = 18.75: go on while 10k + 18.75 < 100, i.e. up to k = 8; stop after step 9
    assert stops == [False] * 8 + [True, True]
    d = p.decide(90)
    assert (d.step_s, d.save_s, d.reserve_s, d.remaining_s, d.late) == (10, 5, 18.75, 10, False)
    assert 90 + d.save_s <= 100  # the checkpoint is complete before the budget ends


def test_planner_step_estimate_is_the_longest_recent_step():
    p = BudgetPlanner(1000, margin_s=0, save_prior_s=0, step_window=3)
    for s in (50, 10, 10):
        p.record_step(s)
    assert p.step_estimate() == 50
    p.record_step(10)  # the 50 s step leaves the window
    assert p.step_estimate() == 10
    assert p.decide(1000 - SAFETY * 10).stop and not p.decide(1000 - SAFETY * 10 - 0.001).stop


def test_planner_save_estimate_replaces_the_prior_with_the_longest_measured_save():
    p = BudgetPlanner(1000, margin_s=7, save_prior_s=120)
    p.record_step(20)
    assert p.decide(0).reserve_s == SAFETY * (20 + 120) + 7
    p.record_save(30)
    p.record_save(12)
    assert p.save_estimate() == 30
    assert p.decide(0).reserve_s == SAFETY * (20 + 30) + 7


def test_planner_before_any_step_reserves_the_save_and_the_margin():
    p = BudgetPlanner(100, margin_s=10, save_prior_s=20)
    assert p.decide(0).step_s == 0
    assert not p.decide(64.9).stop and p.decide(65).stop  # 65 + 1.25 * 20 + 10 = 100


def test_planner_flags_a_save_that_cannot_end_in_time():
    p = BudgetPlanner(100, margin_s=0, save_prior_s=30)
    p.record_step(1)
    assert not p.decide(70).late and p.decide(70.5).late
    assert p.decide(130).remaining_s == -30


def test_planner_defaults_and_checks():
    p = BudgetPlanner(41400)
    assert (p.margin_s, p.save_prior_s) == (60, 120)
    with pytest.raises(ValueError, match="budget_s must be > 0"):
        BudgetPlanner(0)

"""The time budget's config fields (and the environment variable), its SIGTERM hook and its checkpoint state, without
a training run."""

import signal
import sys
import threading

import pytest

from trl_fp8 import GRPOConfig
from trl_fp8.time_budget.component import ENV_VAR, BudgetCallback, SigtermHook, TimeBudget
from trl_fp8.time_budget.core import BudgetPlanner


def _cfg(tmp_path, **kwargs):
    return GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none", **kwargs)


# -- config ---------------------------------------------------------------------------------------------------------
def test_off_by_default(tmp_path):
    cfg = _cfg(tmp_path)
    assert cfg.time_budget is None and not TimeBudget.wanted(cfg)


@pytest.mark.parametrize("value", ["11h30m", "90m", 41400, 3600.5, "11:30:00"])
def test_accepts_durations_and_keeps_them_as_given(tmp_path, value):
    cfg = _cfg(tmp_path, time_budget=value, time_budget_margin="2m", time_budget_scope="total")
    assert cfg.time_budget == value and TimeBudget.wanted(cfg)


def test_refuses_a_bad_budget_naming_the_field_and_the_forms(tmp_path):
    with pytest.raises(ValueError, match=r"time_budget='11 hours' is not a duration; give seconds .*'11h30m'"):
        _cfg(tmp_path, time_budget="11 hours")
    with pytest.raises(ValueError, match=r"time_budget=0: the duration must be finite and > 0"):
        _cfg(tmp_path, time_budget=0)


def test_refuses_a_bad_margin_or_scope(tmp_path):
    with pytest.raises(ValueError, match=r"time_budget_margin='soon' is not a duration"):
        _cfg(tmp_path, time_budget="1h", time_budget_margin="soon")
    with pytest.raises(ValueError, match=r"time_budget_margin='1h' must be shorter than the budget"):
        _cfg(tmp_path, time_budget="1h", time_budget_margin="1h")
    with pytest.raises(ValueError, match=r"time_budget_scope='week' is not valid; allowed values: 'session', 'total'"):
        _cfg(tmp_path, time_budget="1h", time_budget_scope="week")


def test_the_environment_variable_sets_an_unset_budget(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, " 11h30m ")
    assert _cfg(tmp_path).time_budget == "11h30m"
    assert _cfg(tmp_path, time_budget="2h").time_budget == "2h"  # the field wins
    assert _cfg(tmp_path, time_budget="off").time_budget is None  # and can switch it off
    monkeypatch.setenv(ENV_VAR, "")
    assert _cfg(tmp_path).time_budget is None
    monkeypatch.setenv(ENV_VAR, "half a day")
    with pytest.raises(ValueError, match=rf"^{ENV_VAR} \(time_budget\)='half a day' is not a duration"):
        _cfg(tmp_path)


# -- state across resumes -------------------------------------------------------------------------------------------
def _budget(scope="session", token="this process"):
    budget = TimeBudget()
    budget.budget_s, budget.scope, budget.token = 1000.0, scope, token
    budget.planner = BudgetPlanner(1000.0, 0)
    budget.clock, budget.session_start = (lambda: 300.0), 100.0  # 200 s into this session
    budget.prior_s, budget.sessions = 0.0, 1
    budget.callback = BudgetCallback(budget, trainer=None)
    return budget


def test_state_from_another_process_adds_its_time():
    budget = _budget(scope="total")
    budget.load_state_dict({"elapsed_s": 500.0, "session_s": 120.0, "process": "an earlier session", "sessions": 2,
                            "saves_s": [7.0]})
    assert (budget.total(300.0), budget.elapsed(300.0), budget.sessions) == (700.0, 700.0, 3)
    assert budget.planner.save_estimate() == 7.0
    assert budget.state_dict()["elapsed_s"] == 700.0


def test_state_from_this_very_process_is_not_counted_twice():
    budget = _budget()
    budget.load_state_dict({"elapsed_s": 650.0, "session_s": 150.0, "process": "this process", "sessions": 2})
    # 500 s came from earlier sessions; this session's time is counted from the process start, once
    assert (budget.prior_s, budget.total(300.0), budget.sessions, budget.elapsed(300.0)) == (500.0, 700.0, 2, 200.0)


def test_state_counts_the_save_in_progress_only_between_a_step_end_and_on_save():
    budget = _budget()
    assert budget.state_dict()["saves_s"] == []
    budget.callback.save_may_run, budget.callback.last_event = True, 290.0
    assert budget.state_dict()["saves_s"] == [10.0]


# -- SIGTERM ----------------------------------------------------------------------------------------------------------
class _Trainer:
    def train(self, hook):  # a frame named train() whose `self` is the trainer: "training is running"
        hook.handle(signal.SIGTERM, sys._getframe())


@pytest.fixture
def recorder():
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sigterm_during_train_only_sets_the_flag_and_uninstall_restores(recorder):
    trainer = _Trainer()
    hook = SigtermHook(trainer)
    previous = signal.getsignal(signal.SIGTERM)
    assert hook.install() and signal.getsignal(signal.SIGTERM) == hook.handle
    trainer.train(hook)
    assert hook.requested and recorder == []
    hook.uninstall()
    assert signal.getsignal(signal.SIGTERM) is previous


def test_a_second_sigterm_goes_to_the_previous_handler(recorder):
    trainer = _Trainer()
    hook = SigtermHook(trainer)
    hook.install()
    trainer.train(hook)
    trainer.train(hook)
    assert recorder == [signal.SIGTERM] and not hook.installed


def test_a_repeated_sigterm_forwarded_by_the_launcher_is_the_same_request(recorder, monkeypatch):
    """Under `trl-fp8 grpo`, which forwards the SIGTERM it gets, one SIGTERM to the process group arrives twice: the
    repeat does not terminate (a second SIGTERM to the launcher sends SIGKILL instead)."""
    from trl_fp8.time_budget import SIGNALS_FORWARDED_ENV

    monkeypatch.setenv(SIGNALS_FORWARDED_ENV, "1")
    trainer = _Trainer()
    hook = SigtermHook(trainer)
    hook.install()
    trainer.train(hook)
    trainer.train(hook)
    assert hook.requested and recorder == [] and hook.installed
    hook.uninstall()


def test_sigterm_outside_train_or_in_a_forked_child_goes_to_the_previous_handler(recorder):
    trainer = _Trainer()
    hook = SigtermHook(trainer)
    hook.install()
    hook.handle(signal.SIGTERM, sys._getframe())  # train() is not running (e.g. it raised without uninstalling)
    assert recorder == [signal.SIGTERM] and not hook.requested
    hook.install()
    hook.pid = -1  # as a DataLoader worker forked inside train() sees it
    trainer.train(hook)
    assert recorder == [signal.SIGTERM] * 2 and not hook.requested


def test_a_stale_hook_left_by_a_crash_is_not_chained(recorder):
    previous = signal.getsignal(signal.SIGTERM)
    stale = SigtermHook(_Trainer())
    stale.install()  # never uninstalled
    fresh = SigtermHook(_Trainer())
    fresh.install()
    assert fresh.previous is previous
    fresh.uninstall()
    assert signal.getsignal(signal.SIGTERM) is previous


def test_no_hook_outside_the_main_thread(recorder):
    hook = SigtermHook(_Trainer())
    results = []
    thread = threading.Thread(target=lambda: results.append(hook.install()))
    thread.start()
    thread.join()
    assert results == [False] and not hook.installed


"""The time budget as a trainer capability: its config fields, the callback that measures steps and saves and stops
the run in time, the SIGTERM hook that takes the same path, and the state that carries the time used across resumes.

When the planner (:mod:`trl_fp8.time_budget.core`) says the next step and a save would no longer fit, or after a SIGTERM,
the callback asks the trainer at that step's end for a checkpoint (``control.should_save``, even with
``save_strategy="no"``: the point of stopping early is to resume) and for the end of training
(``control.should_training_stop``); that step's evaluation is skipped so the save starts at once. The trainer then
saves through its normal path (``checkpoint-N``, with every capability's state) and ``train()`` returns normally.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import weakref

import torch
from transformers import StoppingCriteria, TrainerCallback

from .. import _trl
from ..capability import Capability, check_choice
from . import SIGNALS_FORWARDED_ENV
from .core import BudgetPlanner, default_margin, default_save_prior, format_duration, parse_duration
from . import declaration
from .declaration import TimeBudgetArgs, ENV_VAR, SCOPES  # noqa: F401 (re-exported)

logger = logging.getLogger("trl_fp8.time_budget")
_OFF = ("off", "none")
_IMPORTED_AT = time.monotonic()




_AGREED_ENV: list[str] = []  # rank 0's $TRL_FP8_TIME_BUDGET, once the processes of a run have agreed on it


def env_budget() -> str:
    """``$TRL_FP8_TIME_BUDGET`` (stripped; '' when unset), as the run's first process reads it. With several processes
    (a process group initialized: the config's own ``__post_init__`` does it under torchrun) rank 0 reads it once
    and broadcasts it, so a variable set on some nodes only cannot put the time budget (and its all-reduces) on some
    ranks only. Every process must call it then: :meth:`TimeBudget.validate` does, whatever the field says. One
    process: no collective, read each time."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return os.environ.get(ENV_VAR, "").strip()
    if not _AGREED_ENV:
        value = [os.environ.get(ENV_VAR, "").strip() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(value, src=0)  # NCCL: on the current GPU (set by accelerate's PartialState)
        _AGREED_ENV.append(value[0] or "")
    return _AGREED_ENV[0]


def _budget_source(args) -> tuple[object, str]:
    """The budget asked for (the field, else the environment variable) and how to name it in an error."""
    env = env_budget()  # first: every process takes part in the agreement, whatever its field says
    value = getattr(args, "time_budget", None)
    if value is None and env:
        return env, f"{ENV_VAR} (time_budget)"
    return value, "time_budget"


def process_age_s() -> float:
    """Seconds since this process started (a notebook: its kernel), or since trl_fp8.time_budget was imported where the
    start time cannot be read."""
    try:
        import psutil

        return max(0.0, time.time() - psutil.Process().create_time())
    except Exception:  # noqa: BLE001 - psutil missing or no /proc: fall back to our own import time
        return time.monotonic() - _IMPORTED_AT


def process_token() -> str:
    """Tells this process apart from any other (a pid is reused; a pid with its start time is not, in practice)."""
    try:
        import psutil

        return f"{os.getpid()}@{psutil.Process().create_time():.3f}"
    except Exception:  # noqa: BLE001
        return f"{os.getpid()}@{time.time() - time.monotonic() + _IMPORTED_AT:.0f}"


def any_rank(flag: bool, device) -> bool:
    """True on every rank when ``flag`` is True on any (one all-reduce; nothing without a process group), so every
    rank saves and stops at the same step."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def _training_on_stack(frame, trainer) -> bool:
    """Whether ``trainer.train()`` is running in the frame chain (the main thread's, when a signal arrives)."""
    while frame is not None:
        if frame.f_code.co_name == "train" and frame.f_locals.get("self") is trainer:
            return True
        frame = frame.f_back
    return False


class SigtermHook:
    """A SIGTERM handler for the duration of ``train()`` that only sets a flag; the callback acts on it at the next
    step end. It passes the signal on to the previous handler (the default: terminate) when it arrives a second
    time, outside ``train()`` (after a crash left the hook installed), or in a forked child (a DataLoader worker) —
    except a second one in a process ``trl-fp8 grpo`` launched (:data:`SIGNALS_FORWARDED_ENV`): that launcher
    forwards the SIGTERM it gets, so one SIGTERM to the process group arrives twice; a second SIGTERM to the launcher
    kills with SIGKILL."""

    def __init__(self, trainer):
        self._trainer = weakref.ref(trainer)
        self.requested = False
        self.previous = None
        self.installed = False
        self.pid = os.getpid()

    def install(self) -> bool:
        if threading.current_thread() is not threading.main_thread():
            logger.info("time budget: train() runs outside the main thread, so SIGTERM is not handled here.")
            return False
        current = signal.getsignal(signal.SIGTERM)
        stale = getattr(current, "__self__", None)
        if isinstance(stale, SigtermHook):  # left by a train() that raised: chain to what it had replaced
            current = stale.previous
        self.previous = signal.SIG_DFL if current is None else current
        self.requested = False
        self.pid = os.getpid()
        signal.signal(signal.SIGTERM, self.handle)
        self.installed = True
        return True

    def uninstall(self) -> None:
        if self.installed and signal.getsignal(signal.SIGTERM) == self.handle:
            signal.signal(signal.SIGTERM, self.previous)
        self.installed = False

    def handle(self, signum, frame) -> None:
        trainer = self._trainer()
        if os.getpid() == self.pid and trainer is not None and _training_on_stack(frame, trainer):
            if not self.requested:
                self.requested = True  # nothing else here: the step in flight finishes, then the callback saves
                return
            if os.environ.get(SIGNALS_FORWARDED_ENV):  # `trl-fp8 grpo` forwards: the same SIGTERM, got twice
                return  # (sent to the process group and forwarded); a second one to the launcher sends SIGKILL
        previous = self.previous
        self.uninstall()
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
        # SIG_IGN: ignored, as before


class BudgetCallback(TrainerCallback):
    """Measures each step (optimizer step end to step end, saves excluded) and each save (the last event before the
    save, i.e. step end, log or evaluation, to ``on_save``), asks the planner at each step end, and stops the run."""

    def __init__(self, budget: TimeBudget, trainer):
        self.budget = budget
        self.trainer = trainer
        self.mark = None  # end of the last step (or start of training), save time excluded
        self.last_event = None  # the last event before a save can start
        self.stopping = None  # why this run is stopping: "budget" or "SIGTERM"
        self.save_may_run = False  # between a step end and on_save (or the next step): a save may be running

    def save_so_far(self, now: float) -> float | None:
        """How long the save running now has taken so far (None: no save can be running). Read when a checkpoint
        stores the budget's state, after the trainer has written the model, optimizer and its own state."""
        return now - self.last_event if self.save_may_run else None

    def _record(self, name: str, value: float) -> None:
        _trl.record_metric(self.trainer, name, value)

    def on_train_begin(self, args, state, control, **kwargs):
        budget = self.budget
        now = budget.clock()
        self.mark = self.last_event = now
        self.stopping = None
        budget.sigterm.install()
        if state.is_world_process_zero:
            what = ("for this session (counted from the start of this process)" if budget.scope == "session" else
                    f"over every session of this run (this is session {budget.sessions})")
            used = budget.elapsed(now)
            logger.info("time budget %s %s: %s used, %s left; a checkpoint is saved and training stops before it "
                        "runs out, or on SIGTERM.", format_duration(budget.budget_s), what, format_duration(used),
                        format_duration(budget.budget_s - used))

    def on_step_begin(self, args, state, control, **kwargs):
        self.save_may_run = False

    def on_step_end(self, args, state, control, **kwargs):
        budget, planner = self.budget, self.budget.planner
        now = budget.clock()
        planner.record_step(now - self.mark)
        self.mark = self.last_event = now
        self.save_may_run = True
        decision = planner.decide(budget.elapsed(now))
        sigterm = budget.sigterm.requested
        self._record("budget/elapsed_s", budget.total(now))
        self._record("budget/session_s", budget.session(now))
        self._record("budget/remaining_s", decision.remaining_s)
        self._record("budget/step_s", decision.step_s)
        stop = any_rank(decision.stop or sigterm, args.device)
        if not stop or self.stopping is not None:
            return control
        self.stopping = "SIGTERM" if sigterm else "budget"
        if state.global_step >= state.max_steps:  # the last step anyway: TRL's own end (and save strategy) applies
            return control
        control.should_save = True
        control.should_training_stop = True
        control.should_evaluate = False  # start the save now (and keep save_strategy="best" from cancelling it)
        if state.is_world_process_zero:
            where = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            if self.stopping == "SIGTERM":
                why = "SIGTERM received"
            else:
                why = (f"time budget {format_duration(budget.budget_s)} ({budget.scope}): "
                       f"{format_duration(decision.elapsed_s)} used, another step and a save need "
                       f"~{format_duration(decision.reserve_s)}")
            logger.warning("trl_fp8: %s; saving %s (step %d of %d) and stopping. Resume with "
                           "resume_from_checkpoint=True.%s", why, where, state.global_step, state.max_steps,
                           " The save may not finish within the budget." if decision.late and not sigterm else "")
        return control

    def on_log(self, args, state, control, **kwargs):
        self.last_event = self.budget.clock()

    def on_evaluate(self, args, state, control, **kwargs):
        self.last_event = self.budget.clock()

    def on_save(self, args, state, control, **kwargs):
        now = self.budget.clock()
        seconds = now - self.last_event
        self.budget.planner.record_save(seconds)
        self.mark += seconds  # a save is not part of the next step
        self.last_event = now
        self.save_may_run = False
        self._record("budget/save_s", seconds)
        if self.stopping is not None and state.is_world_process_zero:
            logger.info("time budget: checkpoint-%d saved in %s; %s left.", state.global_step,
                        format_duration(seconds), format_duration(self.budget.budget_s - self.budget.elapsed(now)))

    def on_train_end(self, args, state, control, **kwargs):
        self.budget.sigterm.uninstall()


class EndGenerationOnSigterm(StoppingCriteria):
    """A stopping criterion that, once SIGTERM has been received, ends every sequence of the generation in flight at
    the next decoding step instead of at ``max_completion_length``. The step it belonged to is then stopped (see
    :meth:`TimeBudget.stop_now`), so the cut completions are never scored or trained on."""

    def __init__(self, hook: SigtermHook):
        self.hook = hook

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.hook.requested, dtype=torch.bool, device=input_ids.device)


class TimeBudget(Capability):
    name = "time_budget"
    Args = TimeBudgetArgs
    state_file = "time_budget_state.pt"
    state_required = False  # a checkpoint written without a budget resumes with none used so far
    state_at_stop = "current"  # a stop saves the time used up to the stop, not to the last step's end
    # it observes step and save times and asks for TRL's own save; the stop decision is all-reduced (any_rank)
    layouts = {"ddp": None, "deepspeed": None, "fsdp": None}
    off_hint = "time_budget=None (and no TRL_FP8_TIME_BUDGET)"

    @classmethod
    def wanted(cls, args) -> bool:
        return declaration.wanted(args)

    @staticmethod
    def validate(args) -> None:
        value, source = _budget_source(args)
        if isinstance(value, str) and value.strip().lower() in _OFF:
            value = None
        budget = None if value is None else parse_duration(value, source)
        args.time_budget = value
        margin = args.time_budget_margin
        if margin is not None:
            margin_s = parse_duration(margin, "time_budget_margin", allow_zero=True)
            if budget is not None and margin_s >= budget:
                raise ValueError(f"time_budget_margin={margin!r} must be shorter than the budget ({source}="
                                 f"{value!r}).")
        check_choice("time_budget_scope", args.time_budget_scope, SCOPES)

    def setup(self, trainer) -> bool:
        args = trainer.args
        self.budget_s = parse_duration(args.time_budget)
        margin = args.time_budget_margin
        self.margin_s = default_margin(self.budget_s) if margin is None else parse_duration(margin, allow_zero=True)
        self.scope = args.time_budget_scope
        self.planner = BudgetPlanner(self.budget_s, self.margin_s, save_prior_s=default_save_prior(self.budget_s))
        self.clock = time.monotonic  # tests swap in a fake clock (with session_start in its time base)
        self.session_start = self.clock() - process_age_s()
        self.token = process_token()
        self.prior_s = 0.0  # time used by earlier sessions of this run (from the resumed checkpoint)
        self.sessions = 1
        self.sigterm = SigtermHook(trainer)
        self.callback = BudgetCallback(self, trainer)
        trainer.add_callback(self.callback)
        if args.save_only_model:
            logger.warning("time budget with save_only_model=True: the checkpoint written when the budget stops "
                           "training holds the model only, so a resume starts a fresh optimizer and scheduler.")
        if args.save_strategy == "no":
            logger.info("time budget with save_strategy='no': a checkpoint is still written when the budget (or a "
                        "SIGTERM) stops training, so the run can resume.")
        return True

    # -- SIGTERM: stop the step in flight -----------------------------------------------------------------------
    def stopping_criteria(self, trainer) -> list:
        if not trainer.model.training or not self._stops_mid_step(trainer):
            return []
        return [EndGenerationOnSigterm(self.sigterm)]

    @staticmethod
    def _stops_mid_step(trainer) -> bool:
        # DeepSpeed and FSDP keep gradient and partition state inside their engines: stop at the step end there
        return not (trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled)

    def stop_now(self, trainer) -> bool:
        """After a SIGTERM on any process, stop the optimizer step in flight at the next micro-batch or generation
        boundary (one all-reduce per boundary with several processes): the last complete step is saved at once,
        instead of after the rest of a step that can take minutes on a real model — longer than the ~30 s a
        scheduler leaves between SIGTERM and SIGKILL."""
        if not self._stops_mid_step(trainer):
            return False
        if not any_rank(self.sigterm.requested, trainer.args.device):
            return False
        self.callback.stopping = "SIGTERM"
        return True

    # -- time ----------------------------------------------------------------------------------------------------
    def session(self, now: float) -> float:
        return now - self.session_start

    def total(self, now: float) -> float:
        return self.prior_s + self.session(now)

    def elapsed(self, now: float) -> float:
        """What counts against the budget: this session's time, or the run's over every session."""
        return self.session(now) if self.scope == "session" else self.total(now)

    def held_tensors(self) -> dict:
        """None: a clock, a deadline and a flag (see :mod:`trl_fp8.time_budget.memory`)."""
        return {"time_budget/state": []}

    # -- state ---------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        now = self.clock()
        saves = list(self.planner.saves)
        running = self.callback.save_so_far(now)
        if running is not None:  # this very save, up to now: the next session knows what a save costs
            saves.append(running)
        return {"elapsed_s": self.total(now), "session_s": self.session(now), "process": self.token,
                "sessions": self.sessions, "saves_s": saves[-self.planner.saves.maxlen:], "budget_s": self.budget_s,
                "scope": self.scope}

    def load_state_dict(self, state: dict) -> None:
        same_process = state.get("process") == self.token  # resumed within the process that wrote it
        self.prior_s = float(state["elapsed_s"]) - (float(state["session_s"]) if same_process else 0.0)
        self.sessions = int(state.get("sessions", 1)) + (0 if same_process else 1)
        known = list(self.planner.saves)
        self.planner.saves.clear()
        self.planner.saves.extend([float(s) for s in state.get("saves_s", [])] + known)
        logger.info("time budget: the resumed run had used %s over %d session(s).", format_duration(self.prior_s),
                    self.sessions - 1 if not same_process else self.sessions)

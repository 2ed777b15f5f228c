"""The time budget in a real CPU GRPO run on the demo model, with a fake clock: the budget runs out mid-run, a complete
checkpoint is written and training stops cleanly before max_steps; a SIGTERM takes the same path; the time used
accumulates across a resume. No test reads a real clock's value."""

import json
import logging
import os
import signal

import pytest
from transformers import TrainerCallback

from trl_fp8 import GRPOConfig, GRPOTrainer
from trl_fp8.app.tasks.arithmetic import correctness_reward, format_reward, make_arithmetic_dataset

STEP_S, SAVE_S = 10.0, 5.0  # fake seconds each optimizer step / each save takes
# With time_budget=100, margin 0 and the save prior of 5% (5 s): go on while 10k + 1.25 * (10 + 5) < 100 -> stop at 9.
STOP_STEP = 9
CHECKPOINT_FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json",
                    "time_budget_state.pt")


class FakeClock:
    def __init__(self, now=0.0):
        self.now = now

    def __call__(self):
        return self.now


class Tick(TrainerCallback):
    """Advances the fake clock: each step takes STEP_S."""

    def __init__(self, clock):
        self.clock = clock

    def on_step_begin(self, args, state, control, **kwargs):
        self.clock.now += STEP_S


class SigtermAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def _trainer(demo_dir, output_dir, callbacks=(), clock=None, **overrides):
    kwargs = dict(
        output_dir=str(output_dir), use_cpu=True, bf16=False, max_steps=20, learning_rate=1e-3,
        per_device_train_batch_size=8, num_generations=4, max_completion_length=8, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, gradient_checkpointing=False, seed=3,
        time_budget=100, time_budget_margin=0,
    )
    # the 100 s default is meant for the fake clock: a real one counts from the start of this (pytest) process
    assert clock is not None or "time_budget" in overrides, "without a fake clock, pass time_budget explicitly"
    kwargs.update(overrides)
    trainer = GRPOTrainer(model=demo_dir, reward_funcs=[correctness_reward, format_reward], args=GRPOConfig(**kwargs),
                          train_dataset=make_arithmetic_dataset(200, seed=5), callbacks=list(callbacks))
    budget = trainer.capability("time_budget")
    if clock is not None and budget is not None:
        budget.clock, budget.session_start = clock, 0.0
        save_model = trainer.save_model

        def slow_save_model(*args, **kwargs):  # writing the model takes SAVE_S (fake) seconds
            clock.now += SAVE_S
            return save_model(*args, **kwargs)

        trainer.save_model = slow_save_model
    return trainer


def _state(checkpoint):
    import torch

    return torch.load(os.path.join(checkpoint, "time_budget_state.pt"), weights_only=True)


def _assert_complete(checkpoint, step):
    missing = [f for f in CHECKPOINT_FILES if not os.path.isfile(os.path.join(checkpoint, f))]
    assert not missing, missing
    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        assert json.load(f)["global_step"] == step


def _metric(trainer, name, after_step=0):
    """A metric's logged values (after ``after_step``: a resumed history starts with the checkpoint's records)."""
    return [rec[name] for rec in trainer.state.log_history if name in rec and rec["step"] > after_step]


@pytest.fixture
def sigterm_guard():
    """A recording SIGTERM handler for the test's duration: a SIGTERM that escapes the budget's hook is recorded
    instead of killing pytest."""
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_budget_runs_out_mid_run_saves_a_complete_checkpoint_and_stops(tmp_path, demo_dir, caplog, sigterm_guard):
    clock = FakeClock()
    trainer = _trainer(demo_dir, tmp_path / "out", [Tick(clock)], clock)  # save_strategy="no": saved anyway
    with caplog.at_level(logging.INFO, logger="trl_fp8.time_budget"):
        output = trainer.train()
    assert trainer.state.global_step == STOP_STEP < trainer.args.max_steps
    assert output.global_step == STOP_STEP and "train_runtime" in trainer.state.log_history[-1]  # a normal end
    assert [d for d in os.listdir(tmp_path / "out") if d.startswith("checkpoint-")] == [f"checkpoint-{STOP_STEP}"]
    checkpoint = str(tmp_path / "out" / f"checkpoint-{STOP_STEP}")
    _assert_complete(checkpoint, STOP_STEP)
    state = _state(checkpoint)
    assert (state["elapsed_s"], state["session_s"], state["sessions"]) == (95.0, 95.0, 1)  # written after the model
    assert state["saves_s"] == [SAVE_S]  # this save so far (the model is written): for the next session's planner
    assert _metric(trainer, "budget/elapsed_s")[:STOP_STEP] == [STEP_S * k for k in range(1, STOP_STEP + 1)]
    assert _metric(trainer, "budget/remaining_s")[STOP_STEP - 1] == 10.0
    assert _metric(trainer, "budget/save_s") == [SAVE_S]  # measured from the step end to on_save
    stops = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(stops) == 1 and f"checkpoint-{STOP_STEP} (step {STOP_STEP} of 20) and stopping" in stops[0]
    assert "time budget 1m40s (session): 1m30s used" in stops[0]
    assert sigterm_guard == [] and signal.getsignal(signal.SIGTERM) != trainer.capability("time_budget").sigterm.handle


def test_sigterm_saves_a_complete_checkpoint_and_stops(tmp_path, demo_dir, caplog, sigterm_guard):
    trainer = _trainer(demo_dir, tmp_path / "out", [SigtermAt(3)], time_budget="10h")  # real clock: far from it
    with caplog.at_level(logging.WARNING, logger="trl_fp8.time_budget"):
        trainer.train()
    assert trainer.state.global_step == 3
    _assert_complete(str(tmp_path / "out" / "checkpoint-3"), 3)
    assert sigterm_guard == []  # the hook took it...
    assert [r.getMessage() for r in caplog.records][0].startswith("trl_fp8: SIGTERM received; saving")
    handler = signal.getsignal(signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)  # ... and after train() the previous handler is back
    assert sigterm_guard == [signal.SIGTERM] and handler is not None


def test_elapsed_time_accumulates_across_a_resume(tmp_path, demo_dir, sigterm_guard):
    out = tmp_path / "out"
    clock = FakeClock()
    _trainer(demo_dir, out, [Tick(clock)], clock).train()

    clock = FakeClock()  # a new session: its clock starts again
    second = _trainer(demo_dir, out, [Tick(clock)], clock)
    second.capability("time_budget").token = "another process"
    second.train(resume_from_checkpoint=True)
    assert second.state.global_step == 2 * STOP_STEP  # the session budget applies anew
    checkpoint = str(out / f"checkpoint-{2 * STOP_STEP}")
    _assert_complete(checkpoint, 2 * STOP_STEP)
    state = _state(checkpoint)
    assert (state["elapsed_s"], state["session_s"], state["sessions"]) == (190.0, 95.0, 2)
    assert state["saves_s"] == [SAVE_S, SAVE_S]  # the first session's save, then this one
    assert _metric(second, "budget/elapsed_s", STOP_STEP)[0] == 95.0 + STEP_S
    assert _metric(second, "budget/session_s", STOP_STEP)[0] == STEP_S

    clock = FakeClock()
    third = _trainer(demo_dir, out, [Tick(clock)], clock, time_budget=200, time_budget_scope="total")
    third.capability("time_budget").token = "a third process"
    third.train(resume_from_checkpoint=True)  # 190 s of 200 s used: one step (200 s), then save and stop
    assert third.state.global_step == 2 * STOP_STEP + 1
    state = _state(str(out / f"checkpoint-{2 * STOP_STEP + 1}"))
    assert (state["elapsed_s"], state["sessions"], state["saves_s"]) == (205.0, 3, [SAVE_S] * 3)


def test_resume_from_a_checkpoint_written_without_a_budget(tmp_path, demo_dir, sigterm_guard):
    out = tmp_path / "out"
    _trainer(demo_dir, out, max_steps=2, save_strategy="steps", save_steps=2, time_budget=None).train()
    assert not os.path.exists(out / "checkpoint-2" / "time_budget_state.pt")
    clock = FakeClock()
    resumed = _trainer(demo_dir, out, [Tick(clock)], clock, max_steps=3)
    resumed.train(resume_from_checkpoint=True)  # nothing to restore: none used before this session
    assert resumed.state.global_step == 3
    assert _metric(resumed, "budget/elapsed_s", 2) == [STEP_S]


# -- SIGTERM in the middle of a step: stopped at the next boundary, the last complete step saved ------------------
class SigtermInGeneration:
    """SIGTERM at the ``call``-th forward of the generation of step ``step + 1``; counts the forwards after it."""

    def __init__(self, trainer, step=2, call=3):
        self.trainer, self.step, self.call = trainer, step, call
        self.calls = self.after = 0
        self.sent = False
        self.handle = trainer.model.register_forward_pre_hook(self)

    def __call__(self, module, args):
        if self.trainer.state.global_step != self.step:
            return
        self.calls += 1
        if self.sent:
            self.after += 1
        elif self.calls == self.call:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


class SigtermAtStepBegin(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_mid_generation_saves_the_last_complete_step_at_once(tmp_path, demo_dir, caplog, sigterm_guard):
    trainer = _trainer(demo_dir, tmp_path / "out", time_budget="10h", max_steps=5, max_completion_length=16)
    spy = SigtermInGeneration(trainer)
    with caplog.at_level(logging.WARNING, logger="trl_fp8"):
        output = trainer.train()
    spy.handle.remove()
    assert spy.sent and spy.after == 0  # the generation in flight ended at the decoding step the signal came in
    assert trainer.state.global_step == 2 and output.global_step == 2  # step 3 never reached its optimizer step
    assert output.metrics == {"stopped_in_step": 3}
    assert [d for d in os.listdir(tmp_path / "out") if d.startswith("checkpoint-")] == ["checkpoint-2"]
    _assert_complete(str(tmp_path / "out" / "checkpoint-2"), 2)
    assert not os.path.exists(tmp_path / "out" / "checkpoint-2" / "grpo_generation_state.pt")  # at a boundary
    assert "the step in flight (3) was stopped at a micro-batch/generation boundary; saved" in caplog.text
    assert trainer.capability("time_budget").callback.stopping == "SIGTERM"
    assert sigterm_guard == [] and signal.getsignal(signal.SIGTERM) != trainer.capability("time_budget").sigterm.handle
    resumed = _trainer(demo_dir, tmp_path / "out", time_budget="10h", max_steps=5, max_completion_length=16)
    resumed.train(resume_from_checkpoint="auto")
    assert resumed.state.global_step == 5


def test_sigterm_between_micro_batches_of_a_generation_keeps_that_steps_buffer(tmp_path, demo_dir, sigterm_guard):
    """steps_per_generation=2 (one generation feeds two optimizer steps): stopped at step 4's first micro-batch, the
    checkpoint of step 3 holds the buffer as it was at step 3's end — the run resumes as it would have gone on."""
    common = dict(time_budget="10h", max_steps=6, steps_per_generation=2)
    straight = _trainer(demo_dir, tmp_path / "straight", **common)
    straight.train()
    cut = _trainer(demo_dir, tmp_path / "cut", [SigtermAtStepBegin(3)], **common)
    output = cut.train()
    assert cut.state.global_step == 3 and output.metrics == {"stopped_in_step": 4}
    checkpoint = str(tmp_path / "cut" / "checkpoint-3")
    _assert_complete(checkpoint, 3)
    assert os.path.isfile(os.path.join(checkpoint, "grpo_generation_state.pt"))  # between two generations
    resumed = _trainer(demo_dir, tmp_path / "cut", **common)
    resumed.train(resume_from_checkpoint=checkpoint)
    import torch

    same = [torch.equal(p, q) for p, q in zip(straight.model.parameters(), resumed.model.parameters())]
    assert resumed.state.global_step == 6 and all(same)  # step 4 trained on the buffer it would have had


def _same(a, b, path=""):
    """Where two nested states differ (tensors and numpy arrays by value)."""
    import torch

    if torch.is_tensor(a) or torch.is_tensor(b):
        return [] if torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b) else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        return [path + ": keys"] if set(a) != set(b) else [d for k in a for d in _same(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return [path + ": length"] if len(a) != len(b) else [d for i, (x, y) in enumerate(zip(a, b))
                                                              for d in _same(x, y, f"{path}[{i}]")]
    if hasattr(a, "tolist"):
        return [] if a.tolist() == b.tolist() else [path]
    return [] if a == b else [path]


class SigtermInAnyGeneration:
    """SIGTERM at the ``call``-th module forward while step ``step + 1`` runs (its generation: by the policy or by a
    served twin)."""

    def __init__(self, trainer, step=2, call=3):
        self.trainer, self.step, self.call, self.calls, self.sent = trainer, step, call, 0, False
        self.handle = __import__("torch").nn.modules.module.register_module_forward_pre_hook(self)

    def __call__(self, module, args):
        if self.trainer.state.global_step == self.step and not self.sent:
            self.calls += 1
            if self.calls == self.call:
                self.sent = True
                os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("settings, state_file", [
    (dict(duet=True, duet_budget=0.5), "duet_state.pt"),
    (dict(fair_cast="stochastic"), "fair_cast_state.pt"),
], ids=["duet", "fair_cast"])
def test_a_sigterm_stopped_checkpoint_holds_the_state_at_the_end_of_its_step(tmp_path, demo_dir, sigterm_guard,
                                                                             settings, state_file):
    """Time budget, SIGTERM in the generation of step 3: the checkpoint-2 the stop writes holds the capability's state
    and the RNG states as they were at the end of step 2 — those of a run that saved checkpoint-2 on its way — not as
    step 3's generation had moved them (DUET then counted the cut step's groups, and again when the resumed run redid
    the step). Fair Cast's (model-sized) state moves only at the optimizer step: it is not copied at each step."""
    import torch

    common = dict(time_budget="10h", max_completion_length=16, lr_scheduler_type="constant", **settings)
    straight = _trainer(demo_dir, tmp_path / "straight", max_steps=2, save_strategy="steps", save_steps=2, **common)
    straight.train()
    cut = _trainer(demo_dir, tmp_path / "cut", max_steps=5, **common)
    spy = SigtermInAnyGeneration(cut)
    try:
        output = cut.train()
    finally:
        spy.handle.remove()
    assert spy.sent and output.metrics == {"stopped_in_step": 3}
    copied = set(cut._step_boundary.states)
    assert "fair_cast" not in copied and "time_budget" not in copied and ("duet" in copied) == ("duet" in settings)
    a, b = tmp_path / "straight" / "checkpoint-2", tmp_path / "cut" / "checkpoint-2"
    _assert_complete(str(b), 2)
    states = sorted(n for n in os.listdir(a) if n.endswith("_state.pt") and n != "time_budget_state.pt")
    assert state_file in states  # (with Fair Cast, the checks' counters too: sync_checks_state.pt)
    for name in (*states, "rng_state.pth"):
        differ = _same(torch.load(a / name, weights_only=False), torch.load(b / name, weights_only=False))
        assert differ == [], (name, differ[:5])
    from safetensors.torch import load_file

    assert _same(load_file(a / "model.safetensors"), load_file(b / "model.safetensors")) == []


def test_a_stop_saves_over_a_stale_checkpoint_of_an_earlier_run(tmp_path, demo_dir, sigterm_guard):
    """An earlier run (max_steps=2) left checkpoint-2 in the same output_dir; this run (max_steps=5) starts afresh (no
    resume) and is stopped in step 3. Its step 2 must be saved: the earlier run's checkpoint-2 is not this run's save
    (before, it was taken for one, and a resume went on from the earlier run's state)."""
    earlier = _trainer(demo_dir, tmp_path / "out", time_budget="10h", max_steps=2, save_strategy="steps", save_steps=1)
    earlier.train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["max_steps"] == 2
    run = _trainer(demo_dir, tmp_path / "out", [SigtermAtStepBegin(2)], time_budget="10h", max_steps=5)
    output = run.train()
    assert run.state.global_step == 2 and output.metrics == {"stopped_in_step": 3}
    _assert_complete(str(checkpoint), 2)
    assert json.loads((checkpoint / "trainer_state.json").read_text())["max_steps"] == 5  # this run's
    # a checkpoint this run resumed from is its own: stopped again at once, it is not written again
    again = _trainer(demo_dir, tmp_path / "out", [SigtermAtStepBegin(2)], time_budget="10h", max_steps=5)
    before = os.stat(checkpoint / "trainer_state.json").st_mtime_ns
    assert again.train(resume_from_checkpoint="auto").metrics == {"stopped_in_step": 3}
    assert os.stat(checkpoint / "trainer_state.json").st_mtime_ns == before

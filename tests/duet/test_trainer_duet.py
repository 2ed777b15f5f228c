"""DUET wired into trl_fp8.GRPOTrainer (in-process sampler)."""

import random

import pytest
import torch

import trl_fp8
from trl_fp8.duet.abort import RolloutMonitor
from trl_fp8.duet.markers import MarkerDetector
from trl_fp8.duet.sampling import DuetStoppingCriteria
from trl_fp8.app.tasks.arithmetic import correctness_reward, format_reward, make_arithmetic_dataset


def _args(tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, max_steps=3, learning_rate=1e-3,
        per_device_train_batch_size=32, num_generations=8, max_completion_length=16, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, gradient_checkpointing=False, seed=3, duet=True,
    )
    kwargs.update(overrides)
    return trl_fp8.GRPOConfig(**kwargs)


class _Spy(trl_fp8.GRPOTrainer):
    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        self.seen.append((self._last_plan_rows, out))
        return out

    def _generate_single_turn(self, *args, **kwargs):
        result = super()._generate_single_turn(*args, **kwargs)
        batch = self.capability("duet").batch
        self._last_plan_rows = (list(batch["rows"]), batch["plan"])
        return result


def _trainer(tmp_path, model_dir, dataset=None, cls=trl_fp8.GRPOTrainer, **overrides):
    trainer = cls(model=model_dir, reward_funcs=[correctness_reward, format_reward], args=_args(tmp_path, **overrides),
                  train_dataset=dataset or make_arithmetic_dataset(200, seed=5))
    trainer.seen = []
    return trainer


@pytest.fixture(scope="module")
def demo_dir():
    from trl_fp8.app.demo.model import demo_model_path

    return demo_model_path()


def test_placeholder_slots_carry_no_gradient_and_real_rollouts_follow_the_plan(tmp_path, demo_dir):
    trainer = _trainer(tmp_path, demo_dir, cls=_Spy, duet_budget=0.5)
    trainer.capability("duet").drops_masked_rows = False  # the whole slot layout (the placeholders stay in the batch)
    trainer.train()
    assert trainer.seen
    for (rows, plan), out in trainer.seen:
        total = out["advantages"].numel()
        real = torch.zeros(total, dtype=torch.bool)
        real[rows] = True
        assert int(plan.counts.sum()) == len(rows) < total  # fewer real rollouts than slots at β = 0.5
        mask = out["completion_mask"]
        assert torch.all(mask[~real].sum(1) == 0)  # placeholders: no tokens in the loss
        assert torch.all(out["advantages"][~real] == 0)
        assert torch.all(mask[real].sum(1) > 0)
        groups = total // 8
        for g in range(groups):  # real rollouts fill the first n_q slots of each group
            assert real[g * 8: g * 8 + int(plan.counts[g])].all() and not real[g * 8 + int(plan.counts[g]): (g + 1) * 8].any()
    logged = trainer.state.log_history[0]
    for key in ("duet/tokens", "duet/tokens_saved_frac", "duet/abort_frac", "duet/rollouts_per_prompt/mean",
                "duet/rollouts_per_prompt/min", "duet/rollouts_per_prompt/max"):
        assert key in logged
    assert 0.3 < logged["duet/tokens_saved_frac"] < 0.7


def test_the_loss_normaliser_counts_only_the_rows_left_in_the_loss(tmp_path, demo_dir):
    """TRL counts ``num_items_in_batch`` (the dapo loss's normaliser) before DUET masks placeholders and aborted
    rollouts out: it is recounted, so the rows DUET leaves out do not shrink the others' gradient."""
    trainer = _trainer(tmp_path, demo_dir, cls=_Spy, duet_budget=0.5)
    trainer.train()
    assert trainer.seen
    for (rows, plan), out in trainer.seen:
        kept = int(out["completion_mask"].sum())
        assert int(out["num_items_in_batch"]) == kept
        assert len(rows) < 32  # placeholders were there to leave out


def test_repeated_prompts_warm_the_surrogate(tmp_path, demo_dir):
    trainer = _trainer(tmp_path, demo_dir, dataset=make_arithmetic_dataset(8, seed=1), max_steps=6)
    trainer.train()
    assert len(trainer.capability("duet").controller.stats) > 0  # observed groups were recorded per prompt
    assert trainer.capability("duet").controller.stats.cold_length() < 16


def test_stopped_rows_generate_no_more_tokens(tiny_model_dir):
    """An aborted rollout ends the generation for that row; when all rows stop, generate returns early."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList, StoppingCriteriaList

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    enc = tok(["12+3=", "4+56="], return_tensors="pt", padding=True)

    class _AlwaysAbort:
        def random(self):
            return 0.0

    monitors = [RolloutMonitor(MarkerDetector(["NEVER"]), k1=0, k2=0, rng=_AlwaysAbort(), grace=4) for _ in range(2)]
    crit = DuetStoppingCriteria(monitors, tok, eos_token_ids=[])
    torch.manual_seed(0)
    out = model.generate(**enc, do_sample=True, max_new_tokens=40, pad_token_id=tok.pad_token_id,
                         eos_token_id=[], logits_processor=LogitsProcessorList([crit.scores_tap]),
                         stopping_criteria=StoppingCriteriaList([crit]))
    assert out.shape[1] - enc["input_ids"].shape[1] == 4  # stopped at k2 + grace, not at 40
    assert crit.stop_at == [4, 4] and all(m.aborted for m in monitors)
    assert torch.all(crit.sum_logps < 0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"duet_budget": 0.0}, "duet_budget must be in \\(0, 1\\]"),
        ({"duet_budget": 1.5}, "duet_budget must be in \\(0, 1\\]"),
        ({"duet_n_min": 0}, "duet_n_min must be an integer >= 2"),
        ({"duet_n_min": 1}, "duet_n_min=1 is not allowed: GRPO's advantages are relative"),
        ({"duet_n_max": 1, "duet_n_min": 2}, "duet_n_max must be an integer >= 2"),
        ({"duet_abort_grace": -1}, "duet_abort_grace must be an integer >= 0 or None"),
        ({"duet_n_max": 9}, "duet_n_max=9 exceeds num_generations=8"),
        ({"duet_n_min": 5, "duet_n_max": 4}, "duet_n_min=5 must be <= duet_n_max=4"),
        ({"duet_markers": []}, "duet_markers must be a preset name or a non-empty list"),
        ({"duet_markers": ["(unclosed"]}, "invalid regular expression"),
        ({"duet_markers": "latex"}, "duet_markers='latex' is not valid"),
        ({"duet_abort_keep_prob": 0.0}, "duet_abort_keep_prob must be in \\(0, 1\\]"),
        ({"duet_min_propensity": 2.0}, "duet_min_propensity must be in \\(0, 1\\]"),
        ({"duet_max_weight": 0.5}, "duet_max_weight must be >= 1"),
        ({"duet_prior_strength": -1.0}, "duet_prior_strength must be a finite number >= 0 \\(pseudo-groups; 0 = no "
                                        "shrinkage\\), got -1.0."),
        ({"duet_prior_strength": float("inf")}, "duet_prior_strength must be a finite number >= 0"),
        ({"use_vllm": True, "vllm_mode": "server"}, "needs vllm_mode=.colocate."),
        ({"duet_screen": 1}, "duet_screen=1 is not allowed: one rollout's reward cannot show"),
        ({"duet_screen": -1}, "duet_screen must be an integer >= 0"),
        ({"duet_screen_keep_prob": 0.0}, "duet_screen_keep_prob must be in \\(0, 1\\]"),
        ({"duet_poll_every": 0}, "duet_poll_every must be an integer >= 1 or None"),
        ({"duet_abort_min_tokens": -2}, "duet_abort_min_tokens must be an integer >= 0 or None"),
        ({"duet_allocator": "neyman"}, "duet_allocator must be one of 'informativeness', 'pass_rate', got 'neyman'"),
        ({"duet_pass_decay": 0.0}, "duet_pass_decay must be in \\(0, 1\\]"),
        ({"duet_pass_threshold": float("nan")}, "duet_pass_threshold must be a finite number"),
        ({"duet_pass_threshold": "1"}, "duet_pass_threshold must be a finite number"),
    ],
)
def test_config_validation(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        _args(tmp_path, **overrides)


def _one(completions, **kwargs):
    return [1.0] * len(completions)


def _zero(completions, **kwargs):
    return [0.0] * len(completions)


def test_a_step_that_samples_nothing_logs_no_none_and_keeps_trl_reward_metrics(tmp_path, demo_dir, monkeypatch):
    """TRL's own test of the weighted reward (constant rewards 1.0 and 0.0, reward_weights 0.7/0.3): a DUET step whose
    every prompt gets no rollout leaves the reward statistics out, never None, and the others keep TRL's value."""
    from trl_fp8.duet.controller import DuetController

    real_plan = DuetController.plan
    calls = []

    def plan(self, keys):
        out = real_plan(self, keys)
        calls.append(1)
        if len(calls) % 2 == 0:  # every second step samples nothing (as DUET does once constant rewards are known)
            out.counts = torch.zeros_like(out.counts)
            out.monitors = []
        return out

    monkeypatch.setattr(DuetController, "plan", plan)
    trainer = trl_fp8.GRPOTrainer(
        model=demo_dir, reward_funcs=[_one, _zero],
        args=_args(tmp_path, max_steps=4, per_device_train_batch_size=6, num_generations=3, max_completion_length=8,
                   reward_weights=[0.7, 0.3], duet_budget=0.5),
        train_dataset=make_arithmetic_dataset(40, seed=1))
    trainer.train()
    records = [h for h in trainer.state.log_history if "loss" in h]
    assert len(records) == 4
    for h in records:
        assert all(v is not None for v in h.values()), h
    with_reward = [h for h in records if "reward" in h]
    assert [h["step"] for h in with_reward] == [1, 3]  # the steps that sampled
    for h in with_reward:
        assert abs(h["reward"] - 0.7) < 1e-5 and h["rewards/_one/mean"] == 1.0 and h["rewards/_zero/mean"] == 0.0
    # a logging window over both kinds of step averages the steps that sampled: TRL's value
    trainer = trl_fp8.GRPOTrainer(
        model=demo_dir, reward_funcs=[_one, _zero],
        args=_args(tmp_path, max_steps=2, logging_steps=2, per_device_train_batch_size=6, num_generations=3,
                   max_completion_length=8, reward_weights=[0.7, 0.3], duet_budget=0.5),
        train_dataset=make_arithmetic_dataset(40, seed=1))
    trainer.train()
    last = [h for h in trainer.state.log_history if "loss" in h][-1]
    assert abs(last["reward"] - 0.7) < 1e-5


def test_a_step_never_samples_nothing_and_trl_reward_metric_is_always_logged(tmp_path, demo_dir):
    """TRL's test_reward_metric_reflects_reward_weights under DUET: constant rewards give every group zero variance,
    so every prompt's informativeness is 0 and the allocator samples each at the propensity floor; a batch where every
    coin fails still gets one group (weights from the marginal inclusion, unbiased), so every logged step has TRL's
    `reward` (0.7 = 0.7 x 1 + 0.3 x 0)."""
    trainer = trl_fp8.GRPOTrainer(
        model=demo_dir, reward_funcs=[_one, _zero],
        args=_args(tmp_path, max_steps=8, per_device_train_batch_size=6, num_generations=3, max_completion_length=8,
                   reward_weights=[0.7, 0.3], duet_budget=0.5),
        train_dataset=make_arithmetic_dataset(4, seed=1))  # 4 prompts: all warm after the first two steps
    trainer.train()
    records = [h for h in trainer.state.log_history if "loss" in h]
    assert len(records) == 8
    for h in records:
        assert "reward" in h and abs(h["reward"] - 0.7) < 1e-5, h
        assert h["duet/prompts_without_rollouts_frac"] < 1.0


def test_cold_prompts_are_screened_in_the_first_pass(tmp_path, demo_dir):
    """Step 1 sees only new prompts: each is screened (duet/screened_frac 1.0); with constant rewards every screen is
    uniform, so only a few continue (duet_screen_keep_prob) and the step spends far less than its budget; later steps
    on the same prompts are not screened."""
    trainer = trl_fp8.GRPOTrainer(
        model=demo_dir, reward_funcs=[_one, _zero],
        args=_args(tmp_path, max_steps=3, per_device_train_batch_size=32, num_generations=8, max_completion_length=8,
                   duet_budget=0.5, duet_screen_keep_prob=1e-9),
        train_dataset=make_arithmetic_dataset(4, seed=1))
    trainer.train()
    records = [h for h in trainer.state.log_history if "loss" in h]
    assert records[0]["duet/screened_frac"] == 1.0 and records[0]["duet/screen_uniform_frac"] == 1.0
    assert records[0]["duet/rollouts_per_prompt/mean"] == 2.0  # the screens only: none continued
    assert records[2]["duet/screened_frac"] == 0.0  # the 4 prompts are warm by then


def test_screening_scores_with_the_trainers_reward_functions(tmp_path, demo_dir):
    """A reward that differs within every group: every screen is mixed, every prompt continues to the allocator's
    count (β = 0.5 of 8 slots: 4), the same counts as without screening."""
    calls = []

    def alternating(completions, **kwargs):
        calls.append(len(completions))
        return [float(i % 2) for i in range(len(completions))]

    trainer = trl_fp8.GRPOTrainer(
        model=demo_dir, reward_funcs=[alternating],
        args=_args(tmp_path, max_steps=1, per_device_train_batch_size=32, num_generations=8, max_completion_length=8,
                   duet_budget=0.5),
        train_dataset=make_arithmetic_dataset(40, seed=1))
    trainer.train()
    h = [h for h in trainer.state.log_history if "loss" in h][0]
    assert h["duet/screened_frac"] == 1.0 and h["duet/screen_uniform_frac"] == 0.0
    assert h["duet/rollouts_per_prompt/min"] == h["duet/rollouts_per_prompt/max"] == 4.0
    assert calls[0] == 4 * 2  # the screens (4 prompts x 2), then TRL's own call on the whole batch
    assert calls[1] == 32


def test_sigterm_cuts_duets_generation_in_flight(tmp_path, demo_dir):
    """DUET's generation path honours the other capabilities' stopping criteria (declared in
    trl_fp8.capability.GENERATION_PATH_HONOURS): with a time budget, a SIGTERM during step 3's generation ends that
    generation at the decoding step it came in (no forward pass after it), and step 2's checkpoint is saved."""
    import os
    import signal

    trainer = trl_fp8.GRPOTrainer(
        model=demo_dir, reward_funcs=[correctness_reward, format_reward],
        args=_args(tmp_path, max_steps=5, per_device_train_batch_size=16, num_generations=8,
                   max_completion_length=16, time_budget="10h", duet_screen=0),
        train_dataset=make_arithmetic_dataset(200, seed=5))

    class SigtermInGeneration:
        def __init__(self):
            self.calls = self.after = 0
            self.sent = False

        def __call__(self, module, args):
            if trainer.state.global_step != 2:
                return
            self.calls += 1
            if self.sent:
                self.after += 1
            elif self.calls == 3:
                self.sent = True
                os.kill(os.getpid(), signal.SIGTERM)

    spy = SigtermInGeneration()
    handle = trainer.model.register_forward_pre_hook(spy)
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        output = trainer.train()
    finally:
        signal.signal(signal.SIGTERM, previous)
        handle.remove()
    assert spy.sent and spy.after == 0  # the generation in flight ended at the decoding step the signal came in
    assert trainer.state.global_step == 2 and output.metrics == {"stopped_in_step": 3}
    assert [d for d in os.listdir(tmp_path / "run") if d.startswith("checkpoint-")] == ["checkpoint-2"]
    assert received == []


def test_rows_left_out_of_the_loss_skip_its_pass_and_the_training_is_the_same(tmp_path, demo_dir, monkeypatch):
    """DUET's placeholder rows (all-zero loss mask) leave the batch before the loss's forward and backward: the
    logged losses and gradient norms equal those of the whole batch (dapo, the default: a masked row adds nothing)."""
    from trl_fp8.duet.component import Duet

    def run(name, drop):
        monkeypatch.setattr(Duet, "drops_masked_rows", drop)
        trainer = _trainer(tmp_path / name, demo_dir, cls=_Spy, duet_budget=0.5, sync_checks="off")
        trainer.train()
        rows = [out["completion_mask"].size(0) for _, out in trainer.seen]
        logs = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h]
        dropped = [h.get("duet/loss_rows_dropped_frac") for h in trainer.state.log_history if "grad_norm" in h]
        return rows, logs, dropped

    whole, whole_logs, none = run("whole", False)
    compact, compact_logs, dropped = run("compact", True)
    assert whole == [32] * 3 and all(r < 32 for r in compact) and none == [None] * 3
    assert dropped == pytest.approx([1 - r / 32 for r in compact])
    # the first step: the same loss and gradient norm (later steps sample differently: TRL's shuffle of the batch
    # draws a permutation of its length from the global generator, so a shorter batch moves the stream)
    assert compact_logs[0] == pytest.approx(whole_logs[0], rel=1e-5, abs=1e-7)
    assert abs(whole_logs[0][1]) > 0  # a real gradient, not a vacuous zero


def test_a_batch_without_its_masked_rows_gives_the_same_loss_and_gradient(tmp_path, demo_dir):
    """On one captured batch: TRL's loss and every parameter's gradient, whole and without the all-masked rows."""
    from trl_fp8 import _trl

    trainer = _trainer(tmp_path, demo_dir, cls=_Spy, duet_budget=0.5, sync_checks="off", max_steps=1)
    trainer.capability("duet").drops_masked_rows = False
    trainer.train()
    (_, batch), = trainer.seen
    compact, dropped = _trl.drop_masked_rows(trainer, batch)
    assert dropped > 0

    def loss_and_grads(inputs):
        trainer.model.zero_grad()
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        return loss.item(), [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]

    loss_whole, grads_whole = loss_and_grads(batch)
    loss_compact, grads_compact = loss_and_grads(compact)
    assert loss_compact == pytest.approx(loss_whole, rel=1e-5, abs=1e-8)
    assert len(grads_whole) == len(grads_compact) > 0 and any(g.abs().sum() > 0 for g in grads_whole)
    for a, b in zip(grads_whole, grads_compact, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)


def test_dropping_masked_rows_keeps_a_multiple_of_the_micro_batches_and_other_losses_whole():
    from types import SimpleNamespace

    from trl_fp8 import _trl

    mask = torch.zeros(8, 3, dtype=torch.long)
    mask[[1, 4, 6], 0] = 1
    batch = {"completion_mask": mask, "advantages": torch.arange(8.0), "prompt_ids": torch.arange(16).view(8, 2),
             "num_items_in_batch": torch.tensor(3), "old_per_token_logps": None}

    def trainer(loss_type="dapo", steps=1):
        return SimpleNamespace(loss_type=loss_type, args=SimpleNamespace(steps_per_generation=steps))

    out, dropped = _trl.drop_masked_rows(trainer(), batch)
    assert dropped == 5 and out["advantages"].tolist() == [1.0, 4.0, 6.0] and out["prompt_ids"][:, 0].tolist() == [2, 8, 12]
    assert out["num_items_in_batch"] is batch["num_items_in_batch"] and out["old_per_token_logps"] is None
    out, dropped = _trl.drop_masked_rows(trainer(steps=2), batch)  # 4 rows: the 3 kept and the first masked one
    assert dropped == 4 and out["advantages"].tolist() == [0.0, 1.0, 4.0, 6.0]
    empty = {**batch, "completion_mask": torch.zeros(8, 3, dtype=torch.long)}
    out, dropped = _trl.drop_masked_rows(trainer(steps=2), empty)  # never fewer rows than micro-batches
    assert dropped == 6 and out["advantages"].tolist() == [0.0, 1.0]
    for loss in ("grpo", "bnpo", "dr_grpo", "sapo", "luspo"):  # per-sequence or per-batch means: kept whole
        assert _trl.drop_masked_rows(trainer(loss), batch) == (batch, 0)
    assert _trl.drop_masked_rows(trainer(), {**batch, "images": [None] * 8}) == ({**batch, "images": [None] * 8}, 0)

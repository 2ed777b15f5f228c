import json

import pytest

from trl_fp8.app.demo.run import DemoSettings, check_settings, format_summary, run_demo, summarize


@pytest.mark.parametrize(
    "field, value",
    [("max_steps", 0), ("prompts_per_step", -1), ("num_generations", 1), ("learning_rate", 0.0),
     ("temperature", -1.0), ("num_problems", 2.5)],
)
def test_settings_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        DemoSettings(**{field: value}).validate()


@pytest.mark.parametrize(
    "field, value, message",
    [("fair_cast", "sometimes", "fair_cast='sometimes' is not valid"), ("sync_checks", "freshnes", "freshnes"),
     ("duet_budget", 1.5, "duet_budget must be in"), ("max_steps", 0, "max_steps")],
)
def test_check_settings_rejects_bad_values_before_any_output(tmp_path, field, value, message):
    with pytest.raises(ValueError, match=message):
        check_settings(DemoSettings(output_dir=str(tmp_path / "out"), **{field: value}))
    assert not (tmp_path / "out").exists()


def test_check_settings_returns_the_run_config(tmp_path):
    args = check_settings(DemoSettings(output_dir=str(tmp_path), fair_cast="rtn", max_steps=7))
    assert (args.fair_cast, args.max_steps, args.metrics_jsonl) == ("rtn", 7, str(tmp_path / "metrics.jsonl"))


def test_summarize_first_and_last_window(tmp_path):
    path = tmp_path / "m.jsonl"
    rows = [{"step": i, "reward": i / 100, "rewards/correctness_reward/mean": i / 200} for i in range(1, 31)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    s = summarize(path)
    assert s["reward"]["first_mean"] == pytest.approx(sum(range(1, 11)) / 1000)
    assert s["reward"]["last_mean"] == pytest.approx(sum(range(21, 31)) / 1000)
    assert s["rewards/correctness_reward/mean"]["gain"] == pytest.approx(0.1)


@pytest.mark.slow
def test_default_demo_reward_rises(tmp_path):
    """The main job as a newcomer runs it (default settings): the accuracy must clearly rise."""
    summary = run_demo(DemoSettings(output_dir=str(tmp_path), progress=False))
    acc = summary["rewards/correctness_reward/mean"]
    assert summary["steps"] == DemoSettings().max_steps
    assert acc["last_mean"] - acc["first_mean"] > 0.15, acc
    assert summary["reward"]["gain"] > 0.15
    assert len(summary["plots"]) == 5  # reward, length, Fair Cast lag and visible-update, sync logprob gap
    checks = summary["sync_checks"]  # the default weight-sync checks ran at every step and never failed
    assert checks["freshness"] == {"runs": summary["steps"], "failed": 0}
    assert checks["logprob_agreement"]["runs"] == summary["steps"] and checks["logprob_agreement"]["failed"] == 0
    import trl_fp8.sync_checks

    assert set(checks) <= set(trl_fp8.sync_checks.CHECKS)  # pass/fail records only, not the logprob figures (sync/logp_*)
    assert "weight-sync checks:" in format_summary(summary)
    assert "accuracy" in format_summary(summary)


def test_task_defaults_fill_the_unset_fields():
    arithmetic = DemoSettings()
    assert (arithmetic.task, arithmetic.max_steps, arithmetic.prompts_per_step) == ("arithmetic", 300, 16)
    assert (arithmetic.max_completion_length, arithmetic.duet_budget, arithmetic.learning_rate) == (16, None, 1e-4)
    reasoning = DemoSettings(task="reasoning")
    assert (reasoning.max_steps, reasoning.prompts_per_step, reasoning.max_completion_length) == (30, 8, 320)
    assert (reasoning.duet_budget, reasoning.learning_rate) == (0.5, 2e-5)
    assert DemoSettings(task="reasoning", duet_budget=None).duet_budget is None  # DUET off on request
    assert DemoSettings(task="reasoning", duet_budget=0.25, max_steps=4).max_steps == 4


def test_reasoning_run_config(tmp_path):
    args = check_settings(DemoSettings(task="reasoning", output_dir=str(tmp_path)))
    assert (args.duet, args.duet_budget, args.max_completion_length) == (True, 0.5, 320)
    assert args.duet_markers == ["math"] and args.reward_weights == [1.0, 0.2]
    assert args.per_device_train_batch_size == 8 * 8 and args.learning_rate == 2e-5


@pytest.mark.parametrize("field, value, message", [
    ("task", "resoning", "task must be one of 'arithmetic', 'reasoning', 'chat_math', got 'resoning'"),
    ("duet_budget", "half", "duet_budget must be None"),
])
def test_task_and_budget_validation_names_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        DemoSettings(**{field: value}).validate()


def test_reasoning_demo_smoke(tmp_path):
    """A very short reasoning run with DUET: its report has the token-budget plots and summary."""
    out = tmp_path / "run"
    summary = run_demo(DemoSettings(task="reasoning", output_dir=str(out), max_steps=2, prompts_per_step=2,
                                    num_generations=4, max_completion_length=64, progress=False))
    assert summary["task"] == "reasoning" and summary["steps"] == 2
    names = {p.rsplit("/", 1)[-1] for p in summary["plots"]}
    assert {"reward.png", "duet_tokens.png", "rollout_tokens.png", "abort_frac.png", "reward_vs_tokens.png"} <= names
    assert summary["budget"]["rollout_tokens_total"] > 0 and 0 <= summary["budget"]["duet_abort_frac_mean"] <= 1
    text = format_summary(summary)
    assert "reasoning task" in text and "rollout tokens:" in text and "DUET aborted" in text
    assert json.loads((out / "summary.json").read_text())["task"] == "reasoning"

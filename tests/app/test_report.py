import json
import math
from types import SimpleNamespace

import pytest

from trl_fp8.app.report import MetricsJsonlCallback, plot_metrics, read_metrics, series, truncate_metrics


def _state(step, main=True):
    return SimpleNamespace(global_step=step, epoch=step / 10, is_world_process_zero=main)


def test_callback_appends_one_json_object_per_log(tmp_path):
    import torch

    path = tmp_path / "sub" / "metrics.jsonl"
    cb = MetricsJsonlCallback(path)
    cb.on_log(None, _state(1), None, logs={"reward": 0.5, "loss": torch.tensor(2.0), "bad": math.nan})
    cb.on_log(None, _state(2), None, logs={"reward": 0.75, "note": object})
    cb.on_log(None, _state(3, main=False), None, logs={"reward": 9.0})  # not the main process: nothing
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first == {"step": 1, "epoch": 0.1, "reward": 0.5, "loss": 2.0, "bad": None}
    assert second["step"] == 2 and second["reward"] == 0.75 and isinstance(second["note"], str)


def test_read_metrics_names_file_and_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n\n{broken\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"m\.jsonl, line 3"):
        read_metrics(path)


def test_read_metrics_skips_a_truncated_last_line_with_a_warning(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "rew')  # killed while writing line 2
    with pytest.warns(UserWarning, match=r"m\.jsonl, line 2: the last line is incomplete"):
        assert read_metrics(path) == [{"step": 1, "reward": 0.5}]


def test_plot_tolerates_a_truncated_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward": s / 4}) + "\n" for s in range(1, 4)) + '{"step": 4, "re')
    with pytest.warns(UserWarning, match="incomplete"):
        written = plot_metrics(path, tmp_path / "plots", plots=(("reward", "Reward", ("reward",)),))
    assert [p.rsplit("/", 1)[-1] for p in written] == ["reward.png"]


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_truncate_metrics_drops_later_steps_and_a_cut_last_line_atomically(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [{"step": s, "reward": s} for s in (1, 2, 3, 4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 5, "rew')
    assert truncate_metrics(path, 2) == 3
    assert _lines(path) == records[:2]
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary file left
    inode = path.stat().st_ino
    assert truncate_metrics(path, 2) == 0 and path.stat().st_ino == inode  # nothing to drop: not rewritten
    assert truncate_metrics(tmp_path / "absent.jsonl", 3) == 0


def test_a_resumed_run_continues_the_file_without_repeating_steps(tmp_path):
    """Session 1 logs steps 1-4 and is killed mid-line; the checkpoint is at step 2; session 2 resumes from it."""
    path = tmp_path / "metrics.jsonl"
    first = MetricsJsonlCallback(path)
    first.on_train_begin(None, _state(0), None)
    for step in (1, 2, 3, 4):
        first.on_log(None, _state(step), None, logs={"reward": step})
    with open(path, "a") as f:
        f.write('{"step": 5, "rew')
    second = MetricsJsonlCallback(path)
    second.on_train_begin(None, _state(2, main=False), None)  # another process: leaves the file alone
    assert len(path.read_text().splitlines()) == 5
    second.on_train_begin(None, _state(2), None)
    for step in (3, 4, 5):
        second.on_log(None, _state(step), None, logs={"reward": step * 10})
    assert [(r["step"], r["reward"]) for r in read_metrics(path)] == [(1, 1), (2, 2), (3, 30), (4, 40), (5, 50)]


def test_a_broken_middle_line_is_left_alone_at_train_begin(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{broken\n{"step": 2}\n')
    with pytest.warns(UserWarning, match="appended to as it is"):
        MetricsJsonlCallback(path).on_train_begin(None, _state(1), None)
    assert path.read_text() == '{"step": 1}\n{broken\n{"step": 2}\n'


def test_series_skips_missing_and_non_finite():
    records = [{"step": 1, "r": 1.0}, {"step": 2}, {"step": 3, "r": None}, {"step": 4, "r": 2}, {"step": 5, "r": True}]
    assert series(records, "r") == ([1, 4], [1.0, 2.0])


def test_plot_metrics_writes_pngs_for_present_metrics_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    cb = MetricsJsonlCallback(path)
    for step in range(1, 6):
        cb.on_log(None, _state(step), None, logs={"reward": step / 5, "completions/mean_length": 10 + step})
    written = plot_metrics(path, tmp_path / "plots", plots=(
        ("reward", "Reward", ("reward",)),
        ("completion_length", "Length", ("completions/mean_length",)),
        ("absent", "Absent", ("nope",)),
    ))
    assert [p.rsplit("/", 1)[-1] for p in written] == ["reward.png", "completion_length.png"]
    for p in written:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert not list((tmp_path / "plots").glob(".*tmp*"))


def _write(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_callback_logs_the_completions_per_step():
    from trl_fp8.app.report import completions_per_step

    args = SimpleNamespace(per_device_train_batch_size=32, world_size=2, gradient_accumulation_steps=2,
                           num_iterations=2)
    assert completions_per_step(args) == 64
    assert completions_per_step(None) is None


def test_callback_adds_the_count_to_records_with_lengths(tmp_path):
    path = tmp_path / "m.jsonl"
    cb = MetricsJsonlCallback(path)
    args = SimpleNamespace(per_device_train_batch_size=16, world_size=1, gradient_accumulation_steps=1,
                           num_iterations=1)
    cb.on_log(args, _state(1), None, logs={"reward": 0.5, "completions/mean_length": 10.0})
    cb.on_log(args, _state(1), None, logs={"train_runtime": 3.0})
    first, second = read_metrics(path)
    assert first["rollout/completions"] == 16 and "rollout/completions" not in second


def test_rollout_tokens_prefers_duet_and_reward_vs_cumulative_tokens():
    from trl_fp8.app.report import reward_vs_tokens, rollout_tokens

    records = [
        {"step": 1, "reward": 0.1, "completions/mean_length": 10.0, "rollout/completions": 8},
        {"step": 2, "reward": 0.2, "completions/mean_length": 12.0, "rollout/completions": 8, "duet/tokens": 50.0},
        {"step": 4, "reward": 0.4, "completions/mean_length": 5.0, "rollout/completions": 8},  # stands for 2 steps
        {"step": 5, "reward": 0.5, "completions/mean_length": 5.0},  # no count: unknown tokens, skipped
        {"step": 5, "train_runtime": 1.0},
    ]
    assert rollout_tokens(records) == ([1, 2, 4], [80.0, 50.0, 40.0])
    assert reward_vs_tokens(records) == ([80.0, 130.0, 210.0], [0.1, 0.2, 0.4])


def test_run_labels_use_folder_names_and_disambiguate(tmp_path):
    from trl_fp8.app.report import run_labels

    assert run_labels([tmp_path / "grpo" / "metrics.jsonl", tmp_path / "duet.jsonl"]) == ["grpo", "duet"]
    a, b = tmp_path / "x" / "run" / "metrics.jsonl", tmp_path / "y" / "run" / "metrics.jsonl"
    assert run_labels([a, b]) == ["x/run", "y/run"]


def test_plot_budget_one_and_several_runs(tmp_path):
    from trl_fp8.app.report import plot_budget

    grpo = _write(tmp_path / "grpo" / "metrics.jsonl", [
        {"step": s, "reward": s / 10, "rewards/correctness_reward/mean": s / 20, "completions/mean_length": 60.0,
         "rollout/completions": 64} for s in range(1, 6)])
    duet = _write(tmp_path / "duet" / "metrics.jsonl", [
        {"step": s, "reward": s / 8, "rewards/correctness_reward/mean": s / 16, "duet/tokens": 2000.0,
         "duet/abort_frac": 0.05} for s in range(1, 6)])
    written = plot_budget([grpo, duet], tmp_path / "cmp")
    assert [p.rsplit("/", 1)[-1] for p in written] == ["rollout_tokens.png", "abort_frac.png", "reward_vs_tokens.png"]
    for p in written:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    only = plot_budget([grpo], tmp_path / "one")  # plain GRPO: no abort plot
    assert [p.rsplit("/", 1)[-1] for p in only] == ["rollout_tokens.png", "reward_vs_tokens.png"]
    old = _write(tmp_path / "old.jsonl", [{"step": 1, "reward": 0.1, "completions/mean_length": 4.0}])
    assert plot_budget([old], tmp_path / "none") == []  # no completion count logged: nothing to draw
    with pytest.raises(ValueError, match="labels"):
        plot_budget([grpo, duet], tmp_path / "x", labels=["a"])
    with pytest.raises(ValueError, match="window"):
        plot_budget([grpo], tmp_path / "x", window=0)

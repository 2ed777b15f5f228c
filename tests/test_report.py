import json
import math
from types import SimpleNamespace

import pytest

from trl_fp8.report import MetricsJsonlCallback, plot_metrics, read_metrics, series


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
    path.write_text('{"step": 1}\n\n{broken\n')
    with pytest.raises(ValueError, match=r"m\.jsonl, line 3"):
        read_metrics(path)


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

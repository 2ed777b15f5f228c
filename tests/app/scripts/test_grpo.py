import os

import pytest

from trl_fp8.app.scripts.grpo import (
    BUILTIN_DATASET,
    check_script_args,
    load_datasets,
    make_parser,
    resolve_reward_funcs,
)
from trl_fp8.app.tasks.arithmetic import correctness_reward, format_reward


def test_help_lists_every_field():
    """argparse formats each help with `%`: a field whose help has a bare `%` made `--help` crash."""
    text = make_parser().format_help()
    assert "--time_budget_margin" in text and "--fair_cast" in text and "--learning_rate" in text


def test_builtin_and_dotted_reward_names():
    funcs = resolve_reward_funcs(["correctness_reward", "trl_fp8.app.tasks.arithmetic.format_reward"])
    assert funcs == [correctness_reward, format_reward]
    assert resolve_reward_funcs(None, reward_model="some/reward-model") == ["some/reward-model"]


def test_unknown_reward_name_lists_the_allowed_ones():
    with pytest.raises(ValueError, match="unknown reward function 'corectness'.*correctness_reward"):
        resolve_reward_funcs(["corectness"])
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        resolve_reward_funcs(["trl_fp8.app.tasks.arithmetic.nope"])
    with pytest.raises(ValueError, match="at least one reward"):
        resolve_reward_funcs([])


def test_parser_has_trl_and_trl_fp8_fields(tmp_path):
    script_args, training_args, model_args, _ = make_parser().parse_args_and_config(
        ["--dataset_name", BUILTIN_DATASET, "--model_name_or_path", "trl-fp8:demo-model", "--output_dir",
         str(tmp_path), "--use_cpu", "true", "--bf16", "false", "--metrics_jsonl", str(tmp_path / "m.jsonl")]
    )
    assert training_args.metrics_jsonl == str(tmp_path / "m.jsonl")
    assert model_args.model_name_or_path == "trl-fp8:demo-model"
    ds = load_datasets(script_args, _, training_args)
    assert set(ds) == {"train", "test"} and ds["train"].column_names == ["prompt", "answer"]


def test_local_dataset_goes_through_load_dataset(tmp_path):
    """The real `load_dataset` path, on a local folder."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    script_args, training_args, _, dataset_args = make_parser().parse_args_and_config(
        ["--dataset_name", str(tmp_path / "data"), "--output_dir", str(tmp_path), "--use_cpu", "true",
         "--bf16", "false"]
    )
    ds = load_datasets(script_args, dataset_args, training_args)
    assert ds["train"][0] == {"prompt": "1+1=", "answer": "2"}


def test_no_dataset_is_an_error(tmp_path):
    script_args, training_args, _, dataset_args = make_parser().parse_args_and_config(
        ["--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false"]
    )
    with pytest.raises(ValueError, match="dataset_name"):
        load_datasets(script_args, dataset_args, training_args)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--dataset_name", BUILTIN_DATASET, "--reward_funcs", "correctness_reward"], "model_name_or_path is required"),
        (["--model_name_or_path", "trl-fp8:demo-model", "--reward_funcs", "correctness_reward"], "dataset_name"),
        (["--model_name_or_path", "trl-fp8:demo-model", "--dataset_name", BUILTIN_DATASET], "at least one reward"),
    ],
)
def test_check_script_args_before_launch(tmp_path, argv, expected):
    script_args, _, model_args, dataset_args = make_parser().parse_args_and_config(
        argv + ["--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false"]
    )
    with pytest.raises(ValueError, match=expected):
        check_script_args(script_args, model_args, dataset_args)


# -- after train(): the final model only when training finished, written atomically ---------------------------------
def _finished_stub(tmp_path, step, max_steps, stopping=None, files=None):
    from types import SimpleNamespace

    out = tmp_path / "out"
    calls = {"save_model": [], "push": 0, "printed": []}

    def save_model(folder):
        calls["save_model"].append(folder)
        os.makedirs(folder, exist_ok=True)
        for name, text in (files or {"model.safetensors": "new-weights", "config.json": "{}"}).items():
            if text is None:  # a kill / crash in the middle of the write
                raise KeyboardInterrupt("killed while writing")
            with open(os.path.join(folder, name), "w") as f:
                f.write(text)

    budget = SimpleNamespace(callback=SimpleNamespace(stopping=stopping))
    trainer = SimpleNamespace(
        state=SimpleNamespace(global_step=step, max_steps=max_steps),
        args=SimpleNamespace(should_save=True),
        accelerator=SimpleNamespace(wait_for_everyone=lambda: None, print=calls["printed"].append),
        capability=lambda name: budget if name == "time_budget" else None,
        save_model=save_model,
        push_to_hub=lambda **kw: calls.__setitem__("push", calls["push"] + 1),
    )
    args = SimpleNamespace(output_dir=str(out), push_to_hub=True)
    return trainer, args, SimpleNamespace(dataset_name="x"), calls, out


@pytest.mark.parametrize("stopping, said", [("budget", "the time budget ran out"), ("SIGTERM", "SIGTERM received")])
def test_a_run_stopped_to_be_resumed_is_not_saved_or_pushed_as_final(tmp_path, stopping, said):
    from trl_fp8.app.scripts.grpo import finish

    trainer, args, script_args, calls, out = _finished_stub(tmp_path, 3, 10, stopping=stopping)
    assert finish(trainer, args, script_args) is False
    assert calls["save_model"] == [] and calls["push"] == 0
    (line,) = calls["printed"]
    assert f"{said} at step 3 of 10" in line and "not saved" in line and "nor pushed to the Hub" in line
    assert "checkpoint-3" in line and "--resume_from_checkpoint auto" in line
    assert not out.exists()


def test_a_finished_run_is_saved_atomically_then_pushed(tmp_path):
    from trl_fp8.app.scripts.grpo import finish

    trainer, args, script_args, calls, out = _finished_stub(tmp_path, 10, 10, stopping="budget")  # its last step
    assert finish(trainer, args, script_args) is True
    assert calls["push"] == 1 and calls["printed"] == [f"Model saved to {out}."]
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]  # no staging folder left
    assert (out / "model.safetensors").read_text() == "new-weights"
    # a second save killed half-way leaves the first one whole
    trainer, args, script_args, calls, out = _finished_stub(
        tmp_path, 10, 10, files={"model.safetensors": "half", "config.json": None})
    with pytest.raises(KeyboardInterrupt):
        finish(trainer, args, script_args)
    assert (out / "model.safetensors").read_text() == "new-weights" and calls["push"] == 0


def test_a_run_another_callback_stopped_is_final_and_says_where(tmp_path):
    from trl_fp8.app.scripts.grpo import finish

    trainer, args, script_args, calls, out = _finished_stub(tmp_path, 4, 10)  # e.g. early stopping
    assert finish(trainer, args, script_args) is True
    assert calls["printed"] == [f"Model saved to {out} (training stopped at step 4 of 10)."]


# -- built-in tasks by name, where a dataset goes ---------------------------------------------------------------------
def test_every_builtin_task_loads_by_name(tmp_path):
    from trl_fp8.app.tasks import TASKS

    for name in TASKS:
        script_args, training_args, _, dataset_args = make_parser().parse_args_and_config(
            ["--dataset_name", f"trl-fp8:{name}", "--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16",
             "false"])
        ds = load_datasets(script_args, dataset_args, training_args)
        assert set(ds) == {"train", "test"} and "prompt" in ds["train"].column_names and len(ds["test"]) > 0, name


def test_an_unknown_builtin_task_lists_the_builtins(tmp_path):
    from trl_fp8.app.tasks import TASKS

    script_args, training_args, model_args, dataset_args = make_parser().parse_args_and_config(
        ["--dataset_name", "trl-fp8:chat-math", "--model_name_or_path", BUILTIN_MODEL_NAME, "--reward_funcs",
         "correctness_reward", "--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false"])
    for call in (lambda: check_script_args(script_args, model_args, dataset_args),
                 lambda: load_datasets(script_args, dataset_args, training_args)):
        with pytest.raises(ValueError, match="unknown built-in task 'trl-fp8:chat-math'") as info:
            call()
        assert all(f"trl-fp8:{name}" in str(info.value) for name in TASKS)


BUILTIN_MODEL_NAME = "trl-fp8:demo-model"


@pytest.mark.slow
def test_the_cli_trains_on_the_chat_math_task_by_name(tmp_path):
    """`trl-fp8 grpo --dataset_name trl-fp8:chat_math` (the SmolLM2 task the docs use), as a user runs it: a
    subprocess, one step on the tiny demo model."""
    import subprocess
    import sys

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "trl_fp8.app.cli", "grpo", "--model_name_or_path", BUILTIN_MODEL_NAME,
           "--dataset_name", "trl-fp8:chat_math", "--reward_funcs", "correctness_reward", "--max_steps", "1",
           "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "4",
           "--use_cpu", "true", "--bf16", "false", "--dtype", "float32", "--save_strategy", "no", "--report_to",
           "none", "--output_dir", str(out), "--num_processes", "1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "model.safetensors").is_file()
    assert "Couldn't find any data file" not in proc.stderr

import pytest

from trl_fp8.scripts.grpo import (
    BUILTIN_DATASET,
    check_script_args,
    load_datasets,
    make_parser,
    resolve_reward_funcs,
)
from trl_fp8.tasks.arithmetic import correctness_reward, format_reward


def test_builtin_and_dotted_reward_names():
    funcs = resolve_reward_funcs(["correctness_reward", "trl_fp8.tasks.arithmetic.format_reward"])
    assert funcs == [correctness_reward, format_reward]
    assert resolve_reward_funcs(None, reward_model="some/reward-model") == ["some/reward-model"]


def test_unknown_reward_name_lists_the_allowed_ones():
    with pytest.raises(ValueError, match="unknown reward function 'corectness'.*correctness_reward"):
        resolve_reward_funcs(["corectness"])
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        resolve_reward_funcs(["trl_fp8.tasks.arithmetic.nope"])
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

import pytest

from trl_fp8.app.tasks.arithmetic import (
    correctness_reward,
    extract_boxed,
    format_reward,
    make_arithmetic_dataset,
    target_completion,
)


def test_dataset_columns_answers_and_determinism():
    ds = make_arithmetic_dataset(50, seed=3)
    assert ds.column_names == ["prompt", "answer"]
    assert len(ds) == 50
    for row in ds:
        a, b = row["prompt"].rstrip("=").split("+")
        assert row["prompt"].endswith("=")
        assert int(row["answer"]) == int(a) + int(b)
        assert 0 <= int(a) <= 99 and 0 <= int(b) <= 99
    assert make_arithmetic_dataset(50, seed=3)["prompt"] == ds["prompt"]
    assert make_arithmetic_dataset(50, seed=4)["prompt"] != ds["prompt"]


@pytest.mark.parametrize("kwargs", [{"num_samples": 0}, {"max_operand": 0}])
def test_dataset_rejects_bad_sizes(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        make_arithmetic_dataset(**{"num_samples": 10, **kwargs})


def test_extract_boxed_takes_the_last_box():
    assert extract_boxed("\\boxed{3} then \\boxed{ 42 }") == "42"
    assert extract_boxed("no box here") is None
    assert extract_boxed("\\boxed{}") == ""


def test_correctness_reward_exact():
    completions = [target_completion("46"), "\\boxed{45}", "46", "\\boxed{46} trailing", ""]
    assert correctness_reward(completions, answer=["46"] * 5) == [1.0, 0.0, 0.0, 1.0, 0.0]


def test_format_reward_exact():
    completions = ["\\boxed{46}", " \\boxed{-3}\n", "\\boxed{46} trailing", "\\boxed{4a}", "46"]
    assert format_reward(completions) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_rewards_accept_conversational_completions():
    completions = [[{"role": "assistant", "content": "\\boxed{7}"}]]
    assert correctness_reward(completions, answer=["7"]) == [1.0]
    assert format_reward(completions) == [1.0]


def test_rewards_reject_unknown_completion_type():
    with pytest.raises(TypeError, match="unsupported completion type"):
        format_reward([42])

import random
import re

import pytest

from trl_fp8.duet.markers import MarkerDetector, compile_markers
from trl_fp8.app.tasks.reasoning import (
    MAX_TERMS,
    correctness_reward,
    difficulty_of,
    format_reward,
    make_problem,
    make_reasoning_dataset,
    parse_prompt,
    steps_reward,
    target_completion,
)


def _evaluate(prompt: str) -> int:
    return sum(t if op == "+" else -t for op, t in parse_prompt(prompt))


def test_dataset_columns_answers_and_determinism():
    ds = make_reasoning_dataset(200, seed=3)
    assert ds.column_names == ["prompt", "answer", "num_terms", "difficulty"]
    assert len(ds) == 200
    for row in ds:
        terms = parse_prompt(row["prompt"])
        assert len(terms) == row["num_terms"] and 2 <= row["num_terms"] <= MAX_TERMS
        assert 1 <= terms[0][1] <= 9 and all(0 <= t <= 9 for _, t in terms)
        assert int(row["answer"]) == _evaluate(row["prompt"])
        assert row["difficulty"] == difficulty_of(row["num_terms"])
    assert set(ds["num_terms"]) == set(range(2, MAX_TERMS + 1))  # the whole range is drawn
    assert set(ds["difficulty"]) == {"easy", "medium", "hard"}
    assert make_reasoning_dataset(200, seed=3)["prompt"] == ds["prompt"]
    assert make_reasoning_dataset(200, seed=4)["prompt"] != ds["prompt"]


@pytest.mark.parametrize("kwargs, field", [({"num_samples": 0}, "num_samples"), ({"num_samples": 2.5}, "num_samples"),
                                           ({"max_terms": 1}, "max_terms"), ({"max_terms": 31}, "max_terms")])
def test_dataset_rejects_bad_sizes(kwargs, field):
    with pytest.raises(ValueError, match=field):
        make_reasoning_dataset(**{"num_samples": 10, **kwargs})


def test_make_problem_rejects_a_bad_number_of_terms():
    with pytest.raises(ValueError, match="num_terms"):
        make_problem(random.Random(0), num_terms=1)


def test_difficulty_splits_the_range_in_thirds():
    # 2..14 terms: easy 2-6, medium 7-10, hard 11-14
    assert [difficulty_of(n) for n in (2, 6, 7, 10, 11, 14)] == ["easy", "easy", "medium", "medium", "hard", "hard"]
    assert [difficulty_of(n, max_terms=4) for n in (2, 3, 4)] == ["easy", "medium", "hard"]


def test_target_completion_writes_every_step():
    assert target_completion("3+5-2+7+4=") == "3+5=8;8-2=6;6+7=13;13+4=17. So the answer is \\boxed{17}"
    assert target_completion("2-7=") == "2-7=-5. So the answer is \\boxed{-5}"
    with pytest.raises(ValueError, match="not a chain prompt"):
        target_completion("12+3=")


def test_target_lengths_grow_with_the_terms_and_marker_is_only_at_the_end():
    rng = random.Random(0)
    lengths = {}
    detector = MarkerDetector("math")
    for _ in range(2000):
        prompt, answer, n = make_problem(rng)
        text = target_completion(prompt)
        lengths.setdefault(n, []).append(len(text))
        assert len(prompt) + len(text) <= 200
        assert text.count("\\boxed{") == 1 and text.endswith(f"\\boxed{{{answer}}}")
        # no prefix of the reasoning shows DUET's math marker: it appears only once the answer is written
        assert not detector.found(text[: text.index("\\boxed{")])
        assert detector.found(text)
        assert format_reward([text]) == [1.0] and correctness_reward([text], [answer]) == [1.0]
        assert steps_reward([text]) == [1.0]
    means = [sum(v) / len(v) for _, v in sorted(lengths.items())]
    assert means == sorted(means)  # more terms, longer completions
    assert 30 <= min(min(v) for v in lengths.values()) and max(max(v) for v in lengths.values()) <= 160
    assert means[-1] > 3 * means[0]  # lengths vary widely between prompts


def test_correctness_reward():
    completions = ["3+5=8. So the answer is \\boxed{8}", "3+5=9. So the answer is \\boxed{9}", "3+5=8;8+1",
                   "\\boxed{8}", "\\boxed{7} then \\boxed{ 8 }", ""]
    assert correctness_reward(completions, answer=["8"] * 6) == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]


def test_format_reward():
    completions = [
        "3+5=8;8-2=6. So the answer is \\boxed{6}",
        " 3+5=8. So the answer is \\boxed{-1}\n",  # shape only: the arithmetic is correctness' job
        "\\boxed{6}",  # no steps
        "3+5=8;8-2=6. So the answer is \\boxed{6} and more",  # text after the answer
        "3+5=8;;8-2=6. So the answer is \\boxed{6}",
        "3+5=8;8-2=6",  # ran out before the answer
        "3+15=18. So the answer is \\boxed{18}",  # terms are single digits
    ]
    assert format_reward(completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_steps_reward_counts_right_steps():
    assert steps_reward(["3+5=8;8-2=7;7+1=8. So", "no steps", "3+5=8"]) == [pytest.approx(2 / 3), 0.0, 1.0]


def test_rewards_accept_conversational_completions():
    completions = [[{"role": "assistant", "content": "1+1=2. So the answer is \\boxed{2}"}]]
    assert correctness_reward(completions, answer=["2"]) == [1.0]
    assert format_reward(completions) == [1.0]


def test_math_marker_preset_is_the_boxed_answer():
    (boxed, *_rest) = compile_markers("math")
    assert re.search(boxed, "So the answer is \\boxed{17}")

import random

import pytest

from trl_fp8.app.tasks.chat_math import (EXAMPLE, INSTRUCTION, LEVELS, SYSTEM_PROMPT, boxed_format_reward,
                                     correctness_reward, make_chat_math_dataset, make_problem)


@pytest.mark.parametrize("level, low, high", [(1, 2, 18), (2, 1, 108), (3, 20, 198)])
def test_problems_of_each_level_have_their_operands_and_a_right_answer(level, low, high):
    rng = random.Random(level)
    for _ in range(300):
        question, answer = make_problem(rng, level)
        a, op, b = question.removeprefix("What is ").removesuffix("?").split()
        a, b = int(a), int(b)
        assert int(answer) == (a + b if op == "+" else a - b) and low <= int(answer) <= high
        assert (len(str(a)), len(str(b))) == {1: (1, 1), 2: (2, 1), 3: (2, 2)}[level]
        assert op == "+" or level == 2


def test_unknown_level_and_style_are_clear_errors():
    with pytest.raises(ValueError, match=r"level must be one of \(1, 2, 3\), got 4"):
        make_problem(random.Random(0), 4)
    with pytest.raises(ValueError, match=r"levels must be a non-empty subset of \(1, 2, 3\), got \(\)"):
        make_chat_math_dataset(4, levels=())
    with pytest.raises(ValueError, match="style must be one of"):
        make_chat_math_dataset(4, style="twoshot")
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        make_chat_math_dataset(0)


def test_dataset_styles_are_conversations_and_seeded():
    few = make_chat_math_dataset(30, seed=3)
    assert few["prompt"] == make_chat_math_dataset(30, seed=3)["prompt"]
    assert set(few["level"]) == set(LEVELS) and set(few.column_names) == {"prompt", "answer", "level"}
    first = few["prompt"][0]
    assert first[:2] == [dict(m) for m in EXAMPLE] and first[2]["role"] == "user"
    assert first[2]["content"].endswith(INSTRUCTION) and "\\boxed{}" in INSTRUCTION
    system = make_chat_math_dataset(3, seed=3, style="system")["prompt"][0]
    assert system[0] == {"role": "system", "content": SYSTEM_PROMPT} and system[1]["content"].startswith("What is")
    assert make_chat_math_dataset(3, seed=3, style="system", system_prompt=None)["prompt"][0][0]["role"] == "user"
    user = make_chat_math_dataset(3, seed=3, style="user")["prompt"][0]
    assert len(user) == 1 and user[0]["content"].endswith(INSTRUCTION)


def test_rewards_read_the_last_boxed_answer_of_a_chat_completion():
    done = [{"role": "assistant", "content": "7 + 5 = 12. The answer is \\boxed{12}."}]
    wrong = [{"role": "assistant", "content": "Maybe \\boxed{12}, no: \\boxed{13}"}]
    rambling = [{"role": "assistant", "content": "Seven and five make twelve"}]
    assert correctness_reward([done, wrong, rambling], ["12", "12", "12"]) == [1.0, 0.0, 0.0]
    assert boxed_format_reward([done, wrong, rambling]) == [1.0, 1.0, 0.0]
    assert boxed_format_reward(["\\boxed{ -3 }", "\\boxed{x}"]) == [1.0, 0.0]

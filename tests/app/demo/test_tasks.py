import pytest

from trl_fp8.app.demo.tasks import TASK_NAMES, DemoTask, demo_task


def test_registry_names_and_unknown_name_lists_the_allowed_ones():
    assert TASK_NAMES == ("arithmetic", "reasoning", "chat_math")
    with pytest.raises(ValueError, match=r"task must be one of 'arithmetic', 'reasoning', 'chat_math', got 'resoning'"):
        demo_task("resoning")


@pytest.mark.parametrize("name, max_len", [("arithmetic", 16), ("reasoning", 320), ("chat_math", 96)])
def test_each_task_is_complete(name, max_len):
    task = demo_task(name)
    assert isinstance(task, DemoTask) and task.name == name
    with pytest.raises(AttributeError):
        task.name = "other"  # frozen
    assert task.max_completion_length == max_len
    assert len(task.reward_funcs) == len(task.reward_weights) == 2
    assert task.duet_markers == ("math",)
    ds = task.make_dataset(8, seed=1)
    assert {"prompt", "answer"} <= set(ds.column_names) and len(ds) == 8
    assert task.make_dataset(8, seed=1)["prompt"] == ds["prompt"]
    # the rewards take TRL's signature, with the dataset's columns as keyword arguments
    rewards = task.reward_funcs[0](prompts=ds["prompt"], completions=["x"] * 8, completion_ids=None, **ds.to_dict())
    assert rewards == [0.0] * 8


def test_arithmetic_task_keeps_the_demo_defaults():
    from trl_fp8.app.demo.model import demo_model_path

    task = demo_task("arithmetic")
    assert (task.demo_max_steps, task.demo_prompts_per_step, task.demo_duet_budget) == (300, 16, None)
    assert task.reward_weights == (1.0, 0.2)
    assert task.model_path() == demo_model_path()


def test_accuracy_functions_run_on_the_shipped_models():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name in ("arithmetic", "reasoning"):  # chat_math's model is the real one: tests/test_models.py
        task = demo_task(name)
        model = AutoModelForCausalLM.from_pretrained(task.model_path())
        tokenizer = AutoTokenizer.from_pretrained(task.model_path())
        acc = task.accuracy(model, tokenizer, num_problems=8, seed=5, temperature=None)
        assert 0.0 <= acc <= 1.0
        assert acc == task.accuracy(model, tokenizer, num_problems=8, seed=5, temperature=None)  # greedy: repeatable

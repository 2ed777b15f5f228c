"""recipes/accelerate: trl_fp8's named accelerate configs, how `--accelerate_config NAME` resolves them (and TRL's),
and what trl_fp8's guards make of the environment accelerate launches each one with."""

import os
from types import SimpleNamespace

import pytest
import yaml

from trl_fp8.registry import CAPABILITIES
from trl_fp8.app.cli import accelerate_config_names, resolve_accelerate_config
from trl_fp8.distributed import detect_config, refusal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = os.path.join(ROOT, "recipes", "accelerate")
EXPECTED = {  # name -> (distributed_type, mixed_precision, engine label under 2 processes)
    "cpu": ("NO", "no", "one process"),
    "multi_gpu": ("MULTI_GPU", "bf16", "DDP (2 processes)"),
    "kaggle_t4x2": ("MULTI_GPU", "fp16", "DDP (2 processes)"),
    "zero2": ("DEEPSPEED", "bf16", "DeepSpeed ZeRO-2"),
    "zero3": ("DEEPSPEED", "bf16", "DeepSpeed ZeRO-3"),
    "fsdp2": ("FSDP", "bf16", "FSDP2"),
}


def test_recipes_are_the_packaged_configs():
    assert sorted(accelerate_config_names()["trl_fp8"]) == sorted(EXPECTED)
    assert sorted(f[:-5] for f in os.listdir(RECIPES) if f.endswith(".yaml")) == sorted(EXPECTED)
    for name, (kind, precision, _) in EXPECTED.items():
        path = os.path.join(RECIPES, f"{name}.yaml")
        config = yaml.safe_load(open(path))
        assert (config["distributed_type"], str(config["mixed_precision"])) == (kind, precision), name
        assert os.path.samefile(path, resolve_accelerate_config(["--accelerate_config", name])[1])
    readme = open(os.path.join(ROOT, "recipes", "README.md")).read()
    for name in EXPECTED:
        assert f"`{name}`" in readme, name


def test_names_resolve_ours_first_then_trls():
    ours = resolve_accelerate_config(["--accelerate_config", "zero2", "--num_processes", "2"])
    assert ours[0] == "--config_file" and ours[1].endswith(os.path.join("trl_fp8", "accelerate_configs", "zero2.yaml"))
    assert ours[2:] == ["--num_processes", "2"]
    trl = resolve_accelerate_config(["--accelerate_config", "trl:zero2"])
    assert trl[1].endswith(os.path.join("trl", "accelerate_configs", "zero2.yaml"))
    only_trl = resolve_accelerate_config(["--accelerate_config", "single_gpu"])
    assert only_trl[1].endswith(os.path.join("trl", "accelerate_configs", "single_gpu.yaml"))
    path = os.path.join(RECIPES, "cpu.yaml")
    assert resolve_accelerate_config(["--accelerate_config", path])[1] == path
    with pytest.raises(ValueError, match=r"'zero9' is neither a file nor a named config: trl_fp8's are .*kaggle_t4x2"):
        resolve_accelerate_config(["--accelerate_config", "zero9"])


def _launch_environment(name):
    """The environment `accelerate launch --config_file <recipe>` gives the training processes (accelerate's own
    functions), plus the WORLD_SIZE its launcher sets."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(
        resolve_accelerate_config(["--accelerate_config", name, "--num_processes", "2"]) + ["train.py"])
    _validate_launch_command(args)
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ""
        _, env = prepare_deepspeed_cmd_env(args)
    else:
        env = prepare_multi_gpu_env(args)
    return {**env, "WORLD_SIZE": "2"}


@pytest.mark.parametrize("name", ["multi_gpu", "kaggle_t4x2", "zero2", "zero3", "fsdp2"])
def test_each_recipe_is_seen_by_the_guards(name):
    env = _launch_environment(name)
    engine = detect_config(SimpleNamespace(deepspeed=None, fsdp=None, fsdp_config=None), env)
    assert engine.label == EXPECTED[name][2], (name, engine)
    fair_cast = next(c for c in CAPABILITIES if c.name == "fair_cast")
    assert (refusal(fair_cast, engine) is None) == (name != "fsdp2"), name

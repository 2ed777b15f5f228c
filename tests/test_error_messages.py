"""Raise sites of the pure cores that no other test named: each refuses bad input with a message that names the
argument or file and what is allowed."""

import random

import pytest
import torch


def test_rounding_refuses_what_it_cannot_round():
    from trl_fp8.fair_cast.rounding import error_feedback_round, stochastic_round

    with pytest.raises(TypeError, match="stochastic_round expects an fp32 tensor, got torch.float16"):
        stochastic_round(torch.zeros(4, dtype=torch.float16), seed=0, step=0, index=0)
    with pytest.raises(ValueError, match=r"stochastic_round: out must be torch.bfloat16 of shape \(4,\), got "
                                         r"torch.bfloat16 \(3,\)"):
        stochastic_round(torch.zeros(4), seed=0, step=0, index=0, out=torch.empty(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"error_feedback_round: residual shape \(3,\) != \(4,\)"):
        error_feedback_round(torch.zeros(4), torch.zeros(3))
    with pytest.raises(TypeError, match="error_feedback_round expects fp32 src and residual"):
        error_feedback_round(torch.zeros(4), torch.zeros(4, dtype=torch.float16))


def test_a_served_copy_needs_fp32_masters_and_something_to_export():
    from trl_fp8.fair_cast.served import ParamUnit, ServedCopy

    with pytest.raises(TypeError, match="Fair Cast needs fp32 master weights, but parameter 'w' is torch.bfloat16"):
        ParamUnit("w", torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match="the model has no parameters to export"):
        ServedCopy([], "stochastic", torch.bfloat16, seed=0)


def test_the_budget_planner_and_duets_allocation_name_their_arguments():
    from trl_fp8.time_budget.core import BudgetPlanner
    from trl_fp8.duet.allocation import allocate_rollouts

    with pytest.raises(ValueError, match="budget_s must be > 0, got 0"):
        BudgetPlanner(0)
    s, lengths = torch.ones(3), torch.ones(3)
    with pytest.raises(ValueError, match=r"s and lengths must be 1-D of equal size, got \(3,\) and \(2,\)"):
        allocate_rollouts(s, torch.ones(2), 10.0)
    with pytest.raises(ValueError, match="lengths must be positive"):
        allocate_rollouts(s, torch.zeros(3), 10.0)
    with pytest.raises(ValueError, match="need 1 <= n_min <= n_max, got n_min=3, n_max=2"):
        allocate_rollouts(s, lengths, 10.0, n_min=3, n_max=2)
    with pytest.raises(ValueError, match="min_inclusion must be in \\(0, 1\\], got 0"):
        allocate_rollouts(s, lengths, 10.0, rng=random.Random(0), min_inclusion=0)


def test_the_logprob_tap_and_the_report_refuse_bad_arguments(tmp_path):
    from trl_fp8.app.report import plot_budget, resolve_metrics_path
    from trl_fp8.sync_checks.logprobs import SampledLogprobTap

    with pytest.raises(ValueError, match="temperature must be > 0, got 0"):
        SampledLogprobTap(temperature=0)
    with pytest.raises(FileNotFoundError, match=f"metrics file not found: {tmp_path / 'metrics.jsonl'}"):
        resolve_metrics_path(tmp_path)
    with pytest.raises(ValueError, match="metrics_paths must name at least one metrics file"):
        plot_budget([], tmp_path)
    run = tmp_path / "m.jsonl"
    run.write_text('{"step": 1, "reward": 0.5}\n')
    with pytest.raises(ValueError, match=r"labels must have one entry per metrics file \(1\), got 2"):
        plot_budget([run], tmp_path, labels=["a", "b"])
    with pytest.raises(ValueError, match="window must be a positive integer, got 0"):
        plot_budget([run], tmp_path, window=0)


@pytest.mark.parametrize("make, kwargs, message", [
    ("trl_fp8.app.tasks.arithmetic:make_arithmetic_dataset", dict(num_samples=0), "num_samples must be >= 1, got 0"),
    ("trl_fp8.app.tasks.arithmetic:make_arithmetic_dataset", dict(num_samples=2, max_operand=0),
     "max_operand must be >= 1, got 0"),
    ("trl_fp8.app.tasks.chat_math:make_chat_math_dataset", dict(num_samples=0), "num_samples must be >= 1, got 0"),
])
def test_task_datasets_refuse_empty_or_impossible_requests(make, kwargs, message):
    import importlib

    module, name = make.split(":")
    with pytest.raises(ValueError, match=message):
        getattr(importlib.import_module(module), name)(**kwargs)


def test_the_native_kernel_wrapper_checks_before_it_passes_a_pointer():
    from trl_fp8 import native as _native

    src = torch.zeros(4)
    for kwargs, error, message in [
        (dict(src=[0.0]), TypeError, "src must be a torch.Tensor, got list"),
        (dict(src=src.double()), TypeError, "src must have dtype torch.float32, got torch.float64"),
        (dict(out=torch.empty(3, dtype=torch.bfloat16)), ValueError,
         r"out must have shape \(4,\) \(the shape of src\), got \(3,\)"),
        (dict(src=torch.zeros(4, 2).t()), ValueError, "src must be contiguous"),
        (dict(key=2**32), ValueError, r"key must be an int in \[0, 2\*\*32\), got 4294967296"),
        (dict(nthreads=0), ValueError, r"nthreads must be an int in \[1, 2\*\*31\), got 0"),
        (dict(offset=-1), ValueError, r"offset must be an int in \[0, 2\*\*62\), got -1"),
    ]:
        args = dict(src=src, out=None, key=0, nthreads=1, offset=0) | kwargs
        with pytest.raises(error, match=message):
            _native.sr_bf16(None, args.pop("src"), args.pop("out"), **args)  # refused before the library is used


def test_stochastic_round_names_the_dtypes_it_serves():
    from trl_fp8.fair_cast.rounding import stochastic_round

    with pytest.raises(ValueError, match="stochastic_round: dtype must be torch.bfloat16 or torch.float16, got "
                                         "torch.float32"):
        stochastic_round(torch.zeros(4), torch.float32, seed=0, step=0, index=0)


def test_composition_refuses_an_inconsistent_capability_list():
    from trl_fp8.capability import Capability
    from trl_fp8.composition import setup_order

    def cap(name, **attrs):
        return type(name.title(), (Capability,), {"name": name, **attrs})

    with pytest.raises(ValueError, match=r"two capabilities share a name: \['a', 'a'\]"):
        setup_order((cap("a"), cap("a")))
    with pytest.raises(ValueError, match=r"A names 'z', which is not a capability \(a, b\)\."):
        setup_order((cap("a", after=("z",)), cap("b")))
    with pytest.raises(ValueError, match="capability set-up order has a cycle: a -> b -> a"):
        setup_order((cap("a", after=("b",)), cap("b", after=("a",))))


@pytest.mark.parametrize("given, message", [
    (dict(duet=True, duet_max_weight=0.5), "duet_max_weight must be >= 1, got 0.5."),
    (dict(duet=True, duet_markers=["("]), r"duet_markers: invalid regular expression '\(': "),
    (dict(duet=True, use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True),
     r"duet=True with use_vllm=True cannot run with vllm_enable_sleep_mode=True yet."),
    (dict(precision="fp32", bf16=True), r"precision='fp32' means fp32 here \(as asked\), but bf16=True was given: "
                                        r"drop bf16 \(precision sets it\)"),
    (dict(precision="bf16", fp16=True, bf16=None), r"precision='bf16' means bf16 here \(as asked\), but fp16=True "
                                                   r"was given: drop fp16"),
])
def test_config_refusals(tmp_path, given, message):
    from trl_fp8 import GRPOConfig

    with pytest.raises(ValueError, match=message):
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **given)


def test_dtype_names_and_the_metrics_file(tmp_path):
    from trl_fp8.metrics import read_metrics
    from trl_fp8.numerics import torch_dtype

    with pytest.raises(ValueError, match=r"'bf17' is not a torch dtype name \(e.g. 'bfloat16', 'float16', "
                                         r"'float32'\)\."):
        torch_dtype("bf17")
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2,\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: not valid JSON \("):
        read_metrics(path)


def _lora(**config):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    return get_peft_model(model, LoraConfig(r=2, target_modules=["0"], **config))


def _lora_layers(model):
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]


def test_fair_cast_and_fast_qlora_name_the_lora_layer_they_cannot_serve():
    from trl_fp8.fair_cast.peft import LoraUnit, lora_units
    from trl_fp8.fast_qlora.component import FastQLoRA

    [(name, dora)] = _lora_layers(_lora(use_dora=True))
    with pytest.raises(ValueError, match=f"Fair Cast does not support DoRA \\(layer '{name}'\\): its forward is not "
                                         r"W \+ ΔW."):
        LoraUnit(name, dora)
    with pytest.raises(ValueError, match=f"fast QLoRA does not support DoRA \\(layer '{name}'\\)"):
        FastQLoRA._refuse_unsupported(None, None, [(name, dora)])
    [(name, biased)] = _lora_layers(_lora(lora_bias=True))
    with pytest.raises(ValueError, match=f"fast QLoRA does not support lora_bias=True \\(layer '{name}'\\)."):
        FastQLoRA._refuse_unsupported(None, None, [(name, biased)])
    with pytest.raises(ValueError, match=r"Fair Cast does not support PEFT `modules_to_save` yet \(parameter "
                                         r"'base_model.model.2.original_module.weight'\)"):
        lora_units(_lora(modules_to_save=["2"]))

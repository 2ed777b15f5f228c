"""``trl-fp8 plan`` on bad input and on models it does not know; the training phase as what is alive together; the
suggestion trying trl_fp8's own switches first; the plan's capability list and defaults held to the real ones."""

import json
import os
import subprocess
import sys

import pytest

from trl_fp8.app.cli import main
from trl_fp8.plan import FREE_TIER, memory_plan
from trl_fp8.plan.devices import DEVICES, GIB

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
MIXTRAL = os.path.join(FIXTURES, "mixtral-8x7b.json")
QWEN3_MOE = os.path.join(FIXTURES, "qwen3-30b-a3b.json")
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}


def _config(tmp_path, **change):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in {**TINY, **change}.items() if v is not None}))
    return str(path)


# (option the message must name, the arguments after `plan`); every option, every kind of bad value
BAD = [
    ("--model", ["--model", "qwen9"]),
    ("--model", ["--model", "{config}:num_attention_heads=0"]),
    ("--model", ["--model", "{config}:num_attention_heads=-4"]),
    ("--model", ["--model", "{config}:hidden_size=1.5"]),
    ("--model", ["--model", "{config}:hidden_size=\"wide\""]),
    ("--model", ["--model", "{config}:vocab_size=1e400"]),
    ("--model", ["--model", "{config}:num_hidden_layers=100000000000"]),
    ("--model", ["--model", "{config}:num_key_value_heads=3"]),
    ("--model", ["--model", "{config}:head_dim=0"]),
    ("--model", ["--model", "{config}:tie_word_embeddings=\"yes\""]),
    ("--model", ["--model", "{config}:model_type=\"olmo2\""]),
    ("--model", ["--model", "{notjson}"]),
    ("--model", ["--model", "{listjson}"]),
    ("--model", ["--model", "mistralai/Mixtral-8x7B-v0.1"]),
    ("--model", []),  # required
    ("--device", ["--device", "1e999GB"]),
    ("--device", ["--device", "0"]),
    ("--device", ["--device", "k80"]),
    ("--device", ["--device", "99999999TB"]),
    ("--device", ["--device", "-24GB"]),
    ("--lora-r", ["--lora-r", "0"]),
    ("--lora-r", ["--lora-r", "x"]),
    ("--lora-r", ["--lora-r", "100000000"]),
    ("--targets", ["--lora-r", "8", "--targets", "q_proj,foo"]),
    ("--targets", ["--lora-r", "8", "--targets", ","]),
    ("--fair-cast", ["--fair-cast", "sr"]),
    ("--lora-serving", ["--lora-serving", "dense"]),
    ("--fast-qlora", ["--fast-qlora", "fast"]),
    ("--sync-checks", ["--sync-checks", "bogus"]),
    ("--sync-checks", ["--sync-checks", ","]),
    ("--beta", ["--beta", "-1"]),
    ("--beta", ["--beta", "nan"]),
    ("--beta", ["--beta", "inf"]),
    ("--beta", ["--beta", "x"]),
    ("--generations", ["--generations", "0"]),
    ("--generations", ["--generations", "1e3"]),
    ("--batch-size", ["--batch-size", "-1"]),
    ("--gradient-accumulation-steps", ["--gradient-accumulation-steps", "0"]),
    ("--steps-per-generation", ["--steps-per-generation", "99999999"]),
    ("--completion-length", ["--completion-length", "100000000000000000000000000000"]),
    ("--prompt-length", ["--prompt-length", "0"]),
    ("--vllm", ["--vllm", "remote"]),
    ("--vllm-gpu-memory-utilization", ["--vllm-gpu-memory-utilization", "nan"]),
    ("--vllm-gpu-memory-utilization", ["--vllm-gpu-memory-utilization", "1.5"]),
    ("--optim", ["--optim", "sgd"]),
    ("--precision", ["--precision", "fp8"]),
    ("--precision", ["--precision", "bf16", "--device", "t4"]),
    ("--base-dtype", ["--base-dtype", "int8"]),
    ("--markdown", ["--json", "--markdown"]),
    ("--full", ["--full", "--lora-r", "8"]),
    ("--qlora", ["--full", "--qlora"]),
    ("--duet", ["--duet=1"]),
    ("--gradient-checkpointing", ["--gradient-checkpointing=no"]),
    ("--generations", ["--generations", "3", "--batch-size", "4"]),  # 4 rows a step: not a multiple of 3
]


@pytest.mark.parametrize("option, argv", BAD, ids=[" ".join(a) or o for o, a in BAD])
def test_every_bad_value_is_one_line_naming_the_option(tmp_path, capsys, option, argv):
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg.startswith("{config}:"):
            key, value = arg.split(":", 1)[1].split("=", 1)
            path = tmp_path / "config.json"
            path.write_text(json.dumps(TINY)[:-1] + f', "{key}": {value}}}')  # raw JSON: 1e400, 1.5 as written
            argv[i] = str(path)
        elif arg == "{notjson}":
            (tmp_path / "config.json").write_bytes(b"\xff\xfe not json")
            argv[i] = str(tmp_path / "config.json")
        elif arg == "{listjson}":
            (tmp_path / "config.json").write_text("[1, 2]")
            argv[i] = str(tmp_path / "config.json")
    if option != "--model" and "--model" not in argv:
        argv = ["--model", "smollm2-135m", *argv]
    assert main(["plan", *argv]) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.startswith("trl-fp8 plan: error: ") and err.count("\n") == 1, err
    assert option in err, err
    assert "Traceback" not in err + captured.out


def test_an_unknown_hub_id_says_how_to_pass_its_config(capsys):
    assert main(["plan", "--model", "someorg/SomeModel-7B"]) == 2
    err = capsys.readouterr().err
    assert "hf download someorg/SomeModel-7B config.json" in err and "--model: unknown model" in err


@pytest.mark.parametrize("config", [MIXTRAL, QWEN3_MOE], ids=["mixtral-8x7b", "qwen3-30b-a3b"])
def test_a_mixture_of_experts_is_refused_not_planned_as_a_dense_model(capsys, config):
    # Mixtral-8x7B's 4-bit weights alone are about 22 GiB: it was planned as one dense MLP per block (9.95 GiB, fits)
    assert main(["plan", "--model", config, "--qlora", "--device", "t4"]) == 2
    captured = capsys.readouterr()
    assert "fits: yes" not in captured.out
    assert "mixture of experts" in captured.err and "--model" in captured.err


def test_a_known_dense_config_still_plans(tmp_path):
    plan = memory_plan(_config(tmp_path, model_type="mistral"), FREE_TIER, device="t4")
    assert plan.fits and plan.spec.arch.model_type == "mistral"


# -- the training phase: what is alive together ----------------------------------------------------------------------
def _training(plan):
    rows = {r.item: r for r in plan.rows if r.phase == "training"}
    return rows, plan.totals[0]


def test_full_fine_tuning_training_phase_is_the_larger_of_forward_and_backward():
    plan = memory_plan("qwen2.5-7b", dict(FREE_TIER, fair_cast="off"), device="h200")
    rows, t = _training(plan)
    cache = next(r for r in rows.values() if r.item.startswith("autocast's"))
    grads = rows["gradients"]
    assert cache.note == "forward" and grads.note == "backward"  # freed before backward; None until backward
    everything = sum(r.bytes for r in rows.values())
    assert t["training_forward"] == everything - sum(r.bytes for r in rows.values() if r.note == "backward")
    assert t["training_backward"] == everything - cache.bytes
    assert t["training"] == max(t["training_forward"], t["training_backward"]) < everything - cache.bytes + 1
    assert everything - t["training"] == cache.bytes  # the old sum counted autocast's copies with the gradients


def test_gradient_accumulation_keeps_the_gradients_through_the_forwards():
    one = memory_plan("qwen2.5-7b", dict(FREE_TIER, fair_cast="off"), device="h200")
    four = memory_plan("qwen2.5-7b", dict(FREE_TIER, fair_cast="off", gradient_accumulation_steps=4,
                                          steps_per_generation=1), device="h200")
    rows1, t1 = _training(one)
    rows4, t4 = _training(four)
    grads = next(r for r in rows4.values() if r.category == "gradients")
    assert grads.note == "" and "accumulated over 4" in grads.item
    assert t4["training_forward"] == t1["training_forward"] + grads.bytes
    assert t4["training_backward"] == t1["training_backward"]


# -- the suggestion ---------------------------------------------------------------------------------------------------
def test_the_suggestion_tries_trl_fp8_s_own_switches_first(capsys):
    assert main(["plan", "--model", "qwen2.5-7b", "--device", "h200"]) == 0
    out = capsys.readouterr().out
    assert "fits: no" in out and "the one change that would make it fit: Fair Cast off (--fair-cast off)" in out
    assert main(["plan", "--model", "qwen2.5-7b", "--device", "h200", "--fair-cast", "off"]) == 0
    assert "fits: yes" in capsys.readouterr().out


def test_presets_and_what_80gb_means(capsys):
    for name in ("h200", "a100-80", "l40s", "a10g"):
        assert name in DEVICES and main(["plan", "--model", "smollm2-135m", "--device", name, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["device"]["name"] == name
    assert DEVICES["h100-80"].usable == int(79.1 * GIB)
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "10^9 bytes" in capsys.readouterr().out


def test_fast_qlora_and_beta_flags(capsys):
    main(["plan", "--model", "qwen2.5-7b", "--qlora", "--fast-qlora", "off", "--json"])
    assert json.loads(capsys.readouterr().out)["settings"]["fast_qlora"] == "off"
    main(["plan", "--model", "smollm2-135m", "--full", "--beta", "0.04", "--json"])
    assert "reference model (beta > 0)" in [r["item"] for r in json.loads(capsys.readouterr().out)["rows"]]


# -- the plan's view of the capability list and of GRPOConfig ---------------------------------------------------------
def test_the_plan_s_capability_list_and_defaults_are_the_real_ones():
    from trl_fp8.plan.capabilities import CAPABILITIES, DEFAULTS
    from trl_fp8.plan.plan import _defaults, make_spec, plan_for
    from trl_fp8.registry import CAPABILITIES as REAL

    assert [c.name for c in CAPABILITIES] == [c.name for c in REAL]
    assert [c.overrides for c in CAPABILITIES] == [tuple(c.overrides) for c in REAL]  # who wins the sampler
    real = _defaults()
    assert {k: real[k] for k in DEFAULTS} == DEFAULTS
    settings = [dict(FREE_TIER), {}, dict(fair_cast="error_feedback", duet=False, sync_checks="off"),
                dict(mxfp8=True, time_budget="1h", sync_checks="all", fast_qlora="on"),
                dict(sync_checks="coverage,freshness")]
    for s in settings:
        for kwargs in ({}, {"peft": 16, "quantization": "nf4"}, {"peft": 8, "vllm": "colocate"}):
            spec = make_spec("smollm2-135m", s, device="l4", **kwargs)
            assert [c.wanted(spec.args) for c in CAPABILITIES] == [c.wanted(spec.args) for c in REAL], s
            assert plan_for(spec, CAPABILITIES).rows == plan_for(spec, REAL).rows, (s, kwargs)


def _imports(argv):
    code = ("import sys; from trl_fp8.app.cli import main; rc = main(sys.argv[1:]); "
            "print('IMPORTED', sorted(m for m in ('trl', 'transformers', 'torch', 'peft') if m in sys.modules)); "
            "sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, "plan", *argv], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    return done.returncode, done.stdout.rsplit("IMPORTED", 1)[-1].strip()


def test_a_question_asked_before_anything_loads_imports_no_trl_nor_torch():
    assert _imports(["--model", MIXTRAL, "--qlora"]) == (2, "[]")
    assert _imports(["--model", "qwen2.5-7b", "--device", "1e999GB"]) == (2, "[]")


def test_a_plan_imports_no_trl():
    """The plan makes the trainer's own sampling decision from the capabilities' declarations (their ``serves``
    modules), which load no TRL, transformers or torch."""
    for argv in (["--model", "qwen2.5-7b", "--qlora", "--device", "t4"],
                 ["--model", "qwen2.5-7b", "--qlora", "--device", "2xt4", "--vllm", "server"]):
        rc, imported = _imports(argv)
        assert rc == 0 and imported == "[]", (argv, imported)

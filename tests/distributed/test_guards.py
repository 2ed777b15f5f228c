"""Every capability either runs or refuses under each engine, and DeepSpeed/FSDP are seen wherever they are asked
for: ``args``, an accelerate config (the environment ``accelerate launch`` sets) or the trainer itself."""

import json
import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from trl_fp8 import distributed
from trl_fp8.registry import CAPABILITIES
from trl_fp8.distributed import Layout, admit, detect, detect_config, refusal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGS = SimpleNamespace(deepspeed=None, fsdp=None, fsdp_config=None)


def test_detect_config_reads_args_and_the_accelerate_environment():
    assert detect_config(ARGS, {}) == Layout("single", 1)
    assert detect_config(ARGS, {"WORLD_SIZE": "2"}).backend == "ddp"
    ds = detect_config(SimpleNamespace(**(ARGS.__dict__ | {"deepspeed": {"zero_optimization": {"stage": 3}}})), {})
    assert (ds.backend, ds.zero_stage, ds.source) == ("deepspeed", 3, "args.deepspeed")
    env = detect_config(ARGS, {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
                               "WORLD_SIZE": "8"})
    assert (env.backend, env.zero_stage, env.num_processes, env.label) == ("deepspeed", 2, 8, "DeepSpeed ZeRO-2")
    assert "ACCELERATE_USE_DEEPSPEED" in env.source
    plugin = detect_config(SimpleNamespace(**(ARGS.__dict__ | {"deepspeed_plugin": SimpleNamespace(zero_stage=1)})), {})
    assert (plugin.backend, plugin.zero_stage) == ("deepspeed", 1)
    fsdp = detect_config(ARGS, {"ACCELERATE_USE_FSDP": "True", "FSDP_VERSION": "2"})
    assert (fsdp.backend, fsdp.fsdp_version, fsdp.label) == ("fsdp", 2, "FSDP2")
    assert detect_config(SimpleNamespace(**(ARGS.__dict__ | {"fsdp": ["full_shard"]})), {}).label == "FSDP1"


def _trainer(**kw):
    state = SimpleNamespace(deepspeed_plugin=kw.pop("plugin", None), fsdp_plugin=kw.pop("fsdp_plugin", None))
    accelerator = SimpleNamespace(num_processes=kw.pop("processes", 1), state=state)
    flags = {"is_deepspeed_enabled": False, "is_fsdp_enabled": False} | kw
    return SimpleNamespace(accelerator=accelerator, args=ARGS, **flags)


def test_detect_at_trainer_start(monkeypatch):
    for name in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert detect(_trainer()).backend == "single"
    assert detect(_trainer(processes=2)).label == "DDP (2 processes)"
    ds = detect(_trainer(is_deepspeed_enabled=True, plugin=SimpleNamespace(zero_stage=3), processes=2))
    assert ds.label == "DeepSpeed ZeRO-3" and "is_deepspeed_enabled" in ds.source
    fsdp = detect(_trainer(is_fsdp_enabled=True, fsdp_plugin=SimpleNamespace(fsdp_version=2)))
    assert fsdp.label == "FSDP2"
    # asked for by an accelerate config but not active in this trainer (accelerate drops FSDP on a CPU machine)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    requested = detect(_trainer())
    assert requested.label == "FSDP2" and "not active in this trainer" in requested.source


ENGINES = [Layout("ddp", 2, source="torchrun"), Layout("deepspeed", 2, 1, source="zero1.yaml"),
           Layout("deepspeed", 2, 2, source="zero2.yaml"), Layout("deepspeed", 2, 3, source="zero3.yaml"),
           Layout("fsdp", 2, fsdp_version=1, source="fsdp1.yaml"), Layout("fsdp", 2, fsdp_version=2, source="x")]


@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: c.name)
def test_every_capability_declares_each_engine(capability):
    assert capability.off_hint, capability.name
    for kind in distributed.LAYOUT_KINDS:
        assert kind in capability.layouts, (capability.name, kind)
    args = SimpleNamespace(sync_checks="all")
    assert admit(capability, args, Layout("single")) is True
    for engine in ENGINES:
        reason = refusal(capability, engine)
        if reason is None:
            assert admit(capability, args, engine) is True
            continue
        with pytest.raises(ValueError) as err:
            admit(capability, args, engine)
        text = str(err.value)
        assert capability.name in text and engine.label in text and engine.source in text, text
        assert capability.off_hint in text and reason in text


def test_default_checks_switch_off_with_one_line_instead_of_refusing(caplog):
    from trl_fp8.sync_checks.component import SyncChecks

    engine = Layout("fsdp", 2, fsdp_version=2, source="fsdp2.yaml")
    with caplog.at_level(logging.INFO, logger="trl_fp8.distributed"):
        assert admit(SyncChecks, SimpleNamespace(sync_checks="default", use_vllm=True), engine) is False
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "FSDP2" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trl_fp8.distributed"):  # TRL's own sampler: nothing to check
        args = SimpleNamespace(sync_checks="default", use_vllm=False, fair_cast="off")
        assert admit(SyncChecks, args, engine) is False
    assert [r.levelname for r in caplog.records] == ["INFO"]
    with pytest.raises(ValueError, match="sync_checks is not supported with FSDP2"):
        admit(SyncChecks, SimpleNamespace(sync_checks="all"), engine)


def test_support_table_has_every_capability_and_engine():
    from trl_fp8.registry import support_table

    table = dict(support_table())
    assert set(table) == {c.name for c in CAPABILITIES}
    assert table["fair_cast"]["DDP"] == table["fair_cast"]["ZeRO-3"] == "supported"
    assert table["fair_cast"]["FSDP2"].startswith("refused: ")
    assert all(row["one process"] == "supported" for row in table.values())


# -- the guard bypass: DeepSpeed/FSDP from an accelerate config, not from args (regression) ---------------------
CAP_FIELDS = {"fair_cast": {"fair_cast": "stochastic"}, "mxfp8": {"mxfp8": True}, "duet": {"duet": True},
              "sync_checks": {"sync_checks": "all"}}


@pytest.mark.parametrize("name", sorted(CAP_FIELDS))
def test_config_refuses_fsdp_from_an_accelerate_config(monkeypatch, tmp_path, name):
    import trl_fp8

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch --config_file fsdp2.yaml` sets
    monkeypatch.setenv("FSDP_VERSION", "2")
    base = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", num_generations=4,
                per_device_train_batch_size=4)
    with pytest.raises(ValueError) as err:
        trl_fp8.GRPOConfig(**base, **CAP_FIELDS[name])
    text = str(err.value)
    assert f"{name} is not supported with FSDP2" in text and "ACCELERATE_USE_FSDP" in text, text


@pytest.mark.parametrize("stage,fields,name", [(3, {"duet": True}, "duet"), (3, {"mxfp8": True}, "mxfp8"),
                                               (2, {"fast_qlora": "on"}, "fast_qlora")])
def test_config_refuses_deepspeed_from_an_accelerate_config(monkeypatch, tmp_path, stage, fields, name):
    pytest.importorskip("deepspeed")  # transformers builds a DeepSpeed plugin from the environment
    import trl_fp8

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", str(stage))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    with pytest.raises(ValueError, match=rf"{name} is not supported with DeepSpeed ZeRO-{stage} \(asked for by an "
                                         r"accelerate config \(ACCELERATE_USE_DEEPSPEED"):
        trl_fp8.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", num_generations=4,
                           per_device_train_batch_size=4, **fields)


TRAINER_SCRIPT = r"""
import json, os, sys
import trl_fp8
from trl_fp8.app.demo.model import demo_model_path
from trl_fp8.app.tasks.arithmetic import correctness_reward, make_arithmetic_dataset

out = {}
def build(**fields):
    args = trl_fp8.GRPOConfig(output_dir=sys.argv[1], use_cpu=True, bf16=False, report_to="none", max_steps=1,
                              num_generations=4, per_device_train_batch_size=4, max_completion_length=4, **fields)
    return args

def trainer(args):
    return trl_fp8.GRPOTrainer(model=demo_model_path(), reward_funcs=[correctness_reward], args=args,
                               train_dataset=make_arithmetic_dataset(8, seed=1))

# the config is made before the accelerate environment appears: the trainer start must still refuse
fields = {"fair_cast": "stochastic"} if sys.argv[2] == "ACCELERATE_USE_FSDP" else {"duet": True}
args = build(sync_checks="off", **fields)
os.environ[sys.argv[2]] = "true"
os.environ["ACCELERATE_DEEPSPEED_ZERO_STAGE"] = "3"
try:
    t = trainer(args)
    out["result"] = "ran: " + ",".join(t.capabilities) + f" ds={t.is_deepspeed_enabled} fsdp={t.is_fsdp_enabled}"
except ValueError as err:
    out["result"] = str(err)
print(json.dumps(out))
"""


@pytest.mark.parametrize("variable", ["ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"])
def test_trainer_start_refuses_an_engine_from_the_environment(tmp_path, variable):
    """At trainer start, with the real trainer: FSDP from the environment (which accelerate does not act on on a CPU
    machine; Fair Cast refused) and DeepSpeed ZeRO-3 from the environment (which it does: ``is_deepspeed_enabled``;
    DUET refused)."""
    if variable == "ACCELERATE_USE_DEEPSPEED":
        pytest.importorskip("deepspeed")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "WORLD_SIZE"):
        env.pop(name, None)
    result = subprocess.run([sys.executable, "-c", TRAINER_SCRIPT, str(tmp_path), variable], capture_output=True,
                            text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    text = json.loads(result.stdout.strip().splitlines()[-1])["result"]
    if variable == "ACCELERATE_USE_FSDP":
        assert text.startswith("fair_cast is not supported with FSDP1"), text
        assert "fair_cast='off'" in text
    else:
        assert text.startswith("duet is not supported with DeepSpeed ZeRO-3"), text
        assert "duet=False" in text

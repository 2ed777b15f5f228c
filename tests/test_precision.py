"""precision='auto' with the GPU faked: decided from the compute capability (never is_bf16_supported()), resolved
before TRL's __post_init__, contradictions refused naming both fields, the vLLM dtype and Fair Cast's served copy
following fp16, and one log line."""

import logging
from types import SimpleNamespace

import pytest
import torch

import trl_fp8.precision as precision
from trl_fp8 import GRPOConfig, _trl
from trl_fp8.precision import decide, resolve_precision, vllm_dtype
from trl_fp8.registry import CAPABILITIES

T4 = ("Tesla T4", (7, 5))
V100 = ("Tesla V100-SXM2-16GB", (7, 0))
A100 = ("NVIDIA A100-SXM4-40GB", (8, 0))
L4 = ("NVIDIA L4", (8, 9))


@pytest.fixture(autouse=True)
def _fresh_log():
    precision._logged.clear()
    yield
    precision._logged.clear()


def _fake_cuda(monkeypatch, *gpus):
    """torch.cuda as on a machine with these GPUs; is_bf16_supported says True (as on a T4, through emulation)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(gpus))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: gpus[i][0])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: gpus[i][1])
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)


def _args(**kw):
    base = dict(precision="auto", bf16=None, fp16=False, use_cpu=False, fair_cast="off", served_dtype="bfloat16",
                use_vllm=False, vllm_mode="colocate")
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.mark.parametrize("gpus, expected", [
    ((A100,), "bf16"), ((L4,), "bf16"), ((T4,), "fp16"), ((V100,), "fp16"), ((), "fp32"),
    ((A100, T4), "fp16"),  # every rank of a mixed node decides alike: the weakest GPU
])
def test_decided_from_the_compute_capability_not_is_bf16_supported(monkeypatch, gpus, expected):
    _fake_cuda(monkeypatch, *gpus)
    assert decide(_args())[0] == expected


def test_use_cpu_means_fp32_even_with_a_gpu(monkeypatch):
    _fake_cuda(monkeypatch, A100)
    assert decide(_args(use_cpu=True)) == ("fp32", "use_cpu=True")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    assert decide(_args())[0] == "fp32"


@pytest.mark.parametrize("gpus, bf16, fp16", [((A100,), True, False), ((T4,), False, True), ((), False, False)])
def test_auto_sets_bf16_and_fp16(monkeypatch, gpus, bf16, fp16):
    _fake_cuda(monkeypatch, *gpus)
    args = _args()
    resolve_precision(args, CAPABILITIES)
    assert (args.bf16, args.fp16) == (bf16, fp16)


def test_t4_gets_fp16_a_half_vllm_engine_and_a_float16_fair_cast_copy(monkeypatch, caplog):
    _fake_cuda(monkeypatch, T4)
    args = _args(fair_cast="stochastic", use_vllm=True)
    with caplog.at_level(logging.INFO, logger="trl_fp8.precision"):
        assert resolve_precision(args, CAPABILITIES) == "fp16"
        resolve_precision(_args(fair_cast="stochastic", use_vllm=True), CAPABILITIES)  # the same decision again: not logged again
    assert (args.bf16, args.fp16, args.served_dtype, vllm_dtype(args)) == (False, True, "float16", "half")
    [record] = caplog.records
    assert record.getMessage() == (
        "precision='auto': Tesla T4 (compute capability 7.5) has no native bf16 (it needs 8.0) -> fp16 autocast over "
        "fp32 master weights (fp16=True), Fair Cast served_dtype='float16', a colocated vLLM engine in dtype 'half'.")


def test_a_vllm_server_is_told_how_to_start(monkeypatch, caplog):
    _fake_cuda(monkeypatch, T4)
    with caplog.at_level(logging.INFO, logger="trl_fp8.precision"):
        resolve_precision(_args(use_vllm=True, vllm_mode="server"))
    assert "start the vLLM server with `trl vllm-serve --dtype half`" in caplog.records[0].getMessage()


def test_bf16_and_fp32_leave_vllm_and_fair_cast_alone(monkeypatch):
    _fake_cuda(monkeypatch, A100)
    args = _args(fair_cast="stochastic", use_vllm=True)
    resolve_precision(args, CAPABILITIES)
    assert (args.served_dtype, vllm_dtype(args)) == ("bfloat16", None)
    assert vllm_dtype(SimpleNamespace(precision=None, fp16=True)) is None  # fp16 given by hand: TRL's behaviour
    assert vllm_dtype(SimpleNamespace(fp16=True)) is None  # a plain TRL config


@pytest.mark.parametrize("gpus, given, field", [
    ((T4,), {"bf16": True}, "bf16=True"), ((A100,), {"bf16": False}, "bf16=False"),
    ((A100,), {"fp16": True}, "fp16=True"), ((), {"bf16": True}, "bf16=True"), ((), {"fp16": True}, "fp16=True"),
])
def test_a_contradicting_explicit_field_is_refused_naming_both(monkeypatch, gpus, given, field):
    _fake_cuda(monkeypatch, *gpus)
    with pytest.raises(ValueError, match=rf"^precision='auto' means \w+ here \(.*\), but {field} was given"):
        resolve_precision(_args(**given))


def test_an_agreeing_explicit_field_is_fine(monkeypatch):
    _fake_cuda(monkeypatch, T4)
    args = _args(bf16=False, fp16=True)
    assert resolve_precision(args, CAPABILITIES) == "fp16" and (args.bf16, args.fp16) == (False, True)


@pytest.mark.parametrize("asked, bf16, fp16", [("bf16", True, False), ("fp16", False, True), ("fp32", False, False)])
def test_explicit_values(monkeypatch, asked, bf16, fp16):
    _fake_cuda(monkeypatch, A100)
    args = _args(precision=asked)
    assert resolve_precision(args, CAPABILITIES) == asked and (args.bf16, args.fp16) == (bf16, fp16)


def test_explicit_bf16_on_a_t4_warns(monkeypatch, caplog):
    _fake_cuda(monkeypatch, T4)
    with caplog.at_level(logging.WARNING, logger="trl_fp8.precision"):
        resolve_precision(_args(precision="bf16"))
    assert "Tesla T4, which has no native bf16" in caplog.records[0].getMessage()


def test_none_leaves_everything_as_given(monkeypatch):
    _fake_cuda(monkeypatch, T4)
    args = _args(precision=None, bf16=True)
    assert resolve_precision(args, CAPABILITIES) is None and (args.bf16, args.fp16) == (True, False)


def test_other_accelerators_keep_trls_fields(monkeypatch):
    _fake_cuda(monkeypatch)
    monkeypatch.setattr(precision, "_other_accelerator", lambda: "mps")
    args = _args()
    assert resolve_precision(args, CAPABILITIES) is None and args.bf16 is None


# -- through GRPOConfig (the real __post_init__ chain; the GPU faked at trl_fp8's seam, so that transformers' own
# device set-up still sees this CPU machine) -------------------------------------------------------------------------
def _cfg(tmp_path, **kw):
    return GRPOConfig(output_dir=str(tmp_path / "out"), report_to="none", **kw)


def test_config_auto_on_this_cpu_machine_is_fp32(tmp_path):
    cfg = _cfg(tmp_path, precision="auto")  # without precision, TRL's bf16 default fails here without use_cpu=True
    assert (cfg.bf16, cfg.fp16, cfg.mixed_precision) == (False, False, "no")


def test_config_auto_on_a_faked_t4(tmp_path, monkeypatch):
    monkeypatch.setattr(precision, "cuda_devices", lambda: [T4])
    cfg = _cfg(tmp_path, precision="auto", fair_cast="stochastic")
    assert (cfg.bf16, cfg.fp16, cfg.mixed_precision, cfg.served_dtype) == (False, True, "fp16", "float16")
    with pytest.raises(ValueError, match=r"precision='auto' means fp16 here \(Tesla T4 .*\), but bf16=True"):
        _cfg(tmp_path, precision="auto", bf16=True)


def test_config_refuses_an_unknown_precision(tmp_path):
    with pytest.raises(ValueError, match=r"precision='int8' is not valid; allowed values: 'auto', 'bf16', 'fp16', "):
        _cfg(tmp_path, precision="int8", use_cpu=True)


def test_config_default_is_trls(tmp_path):
    cfg = _cfg(tmp_path, use_cpu=True)
    assert cfg.precision is None and cfg.bf16 is True  # TRL's default: bf16 unless fp16


def test_a_colocated_engine_is_started_in_half_when_precision_chose_fp16(monkeypatch):
    import trl.generation.vllm_generation as trl_vllm

    calls = []
    monkeypatch.setattr(trl_vllm, "LLM", lambda *a, **kw: calls.append(kw), raising=False)
    monkeypatch.setattr(_trl.vllm_engine, "vllm_platform_is_cpu", lambda: False)
    from trl_fp8 import sampling

    def decided(**args):
        return sampling.decide(SimpleNamespace(use_vllm=True, vllm_mode="colocate", **args), sampling.ModelFacts(), ())

    with _trl.engine_context(decided(precision="auto", fp16=True)):
        trl_vllm.LLM(model="m")
        trl_vllm.LLM(model="m", dtype="float32")  # an explicit dtype is kept
    with _trl.engine_context(decided(precision="auto", fp16=False)):
        trl_vllm.LLM(model="m")
    with _trl.engine_context(decided(precision=None, fp16=True)):
        trl_vllm.LLM(model="m")  # fp16 by hand: TRL's engine as it is
    trl_vllm.LLM(model="m")  # outside the context
    assert [c.get("dtype") for c in calls] == ["half", "float32", None, None, None]


@pytest.mark.parametrize("features, bf16, warned", [
    (["avx", "avx2", "fma"], None, True),  # TRL's default (an unset bf16 becomes True) on an AVX2-only CPU
    (["avx", "avx2", "fma"], True, True),
    (["avx", "avx2", "fma"], False, False),  # fp32: nothing to say
    (["avx2", "avx512f", "avx512_bf16"], None, False),  # native bf16 (Cooper Lake, Zen 4)
    (["avx2", "amx_bf16", "amx_tile"], None, False),  # AMX (Sapphire Rapids)
    ([], None, False),  # features unknown: nothing claimed
])
def test_bf16_on_a_cpu_without_native_bf16_is_said_once(monkeypatch, caplog, features, bf16, warned):
    import platform

    import trl_fp8.native as native

    _fake_cuda(monkeypatch)
    monkeypatch.setattr(native, "vector_extensions", lambda: features)
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    with caplog.at_level(logging.WARNING, logger="trl_fp8.precision"):
        for _ in range(2):
            assert resolve_precision(_args(precision=None, bf16=bf16, use_cpu=True)) is None
    said = [r.getMessage() for r in caplog.records if "without native bf16" in r.getMessage()]
    assert len(said) == (1 if warned else 0), said
    if warned:
        assert "precision='auto' (or bf16=False) trains in fp32" in said[0]


def test_precision_bf16_asked_on_a_cpu_without_native_bf16_is_said(monkeypatch, caplog):
    import platform

    import trl_fp8.native as native

    _fake_cuda(monkeypatch)
    monkeypatch.setattr(native, "vector_extensions", lambda: ["avx2"])
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    with caplog.at_level(logging.WARNING, logger="trl_fp8.precision"):
        assert resolve_precision(_args(precision="bf16", use_cpu=True)) == "bf16"
    assert any("without native bf16" in r.getMessage() for r in caplog.records)


def test_no_claim_about_bf16_on_a_cpu_whose_features_it_does_not_read(monkeypatch):
    import platform

    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert precision.cpu_has_native_bf16() is None

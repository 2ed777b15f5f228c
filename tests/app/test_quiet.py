import enum
import logging
import os
import subprocess
import sys

import pytest

from trl_fp8.app import quiet as _quiet
from trl_fp8.app.quiet import KNOWN_NOTICES, VERBOSE_ENV, installed_filters, quiet_third_party

NOTICE_MARKERS = ("Failed to load", "is an Enum subclass", "gemm_4bit_forward", "Triton not available",
                  "Setting accelerator to CPU")


@pytest.fixture
def clean_filters(monkeypatch):
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    _quiet.restore()
    yield
    _quiet.restore()


class _Catch(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _emit(logger_name, level, msg, *args):
    logger = logging.getLogger(logger_name)
    catch = _Catch()
    logger.addHandler(catch)
    old_propagate, logger.propagate = logger.propagate, False
    try:
        logger.log(level, msg, *args)
    finally:
        logger.removeHandler(catch)
        logger.propagate = old_propagate
    return catch.messages


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


class _TorchaoEnum(enum.Enum):
    A = 1


_TorchaoEnum.__module__ = "torchao.quantization.quantize_.common.kernel_preference"


class _OtherEnum(enum.Enum):
    B = 2


def test_only_the_known_notices_are_dropped(clean_filters):
    _cuda()  # torch imported first: the CUDA condition is read when a record is emitted (alone, nothing had)
    assert quiet_third_party() is True
    assert quiet_third_party() is True  # idempotent: one filter per logger
    assert len(installed_filters()) == len(KNOWN_NOTICES)

    so = "Failed to load /venv/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load"
    assert _emit("torchao", logging.WARNING, so) == ([so] if _cuda() else [])
    assert _emit("torchao", logging.ERROR, so) == [so]  # errors always pass
    assert _emit("torchao", logging.WARNING, "Failed to load my_model.bin") == ["Failed to load my_model.bin"]
    assert _emit("torchao.other", logging.WARNING, so) == [so]  # another logger

    enum_msg = "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type."
    assert _emit("torch.utils._pytree", logging.WARNING, enum_msg, _TorchaoEnum) == []
    assert len(_emit("torch.utils._pytree", logging.WARNING, enum_msg, _OtherEnum)) == 1  # not torchao's

    bnb = "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure ..."
    missing = ModuleNotFoundError("No module named 'kernels'", name="kernels")
    assert _emit("bitsandbytes.backends.cpu.ops", logging.WARNING, bnb, missing) == []
    assert len(_emit("bitsandbytes.backends.cpu.ops", logging.WARNING, bnb, RuntimeError("hub down"))) == 1


def test_deepspeeds_cpu_notice_is_dropped_without_cuda_only(clean_filters):
    _cuda()
    quiet_third_party()
    notice = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
    assert _emit("DeepSpeed", logging.WARNING, notice) == ([notice] if _cuda() else [])
    assert len(_emit("DeepSpeed", logging.WARNING, "Setting accelerator to CUDA")) == 1


def test_building_a_trainer_with_deepspeed_installed_prints_no_notice():
    """accelerate's extract_model_from_parallel (called by TRL's GRPOTrainer.__init__) imports deepspeed when it is
    installed; deepspeed then prints its accelerator notice to stdout before the progress bar."""
    pytest.importorskip("deepspeed")
    code = ("from trl_fp8.app.quiet import quiet_third_party; quiet_third_party(); import torch; "
            "from accelerate.utils import extract_model_from_parallel; "
            "extract_model_from_parallel(torch.nn.Linear(2, 2)); import sys; print('deepspeed' in sys.modules)")
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "True"  # the path that prints it did run
    if not _cuda():
        assert "Setting accelerator to CPU" not in proc.stdout + proc.stderr, proc.stdout


def test_verbose_env_installs_no_filter(clean_filters, monkeypatch):
    monkeypatch.setenv(VERBOSE_ENV, "1")
    assert quiet_third_party() is False
    assert installed_filters() == []
    for notice in KNOWN_NOTICES:
        assert not any(isinstance(f, _quiet.KnownNoticeFilter) for f in logging.getLogger(notice.logger).filters)


def _run(code, **env):
    full_env = {k: v for k, v in os.environ.items() if k != VERBOSE_ENV}
    full_env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **env)
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=300)


def test_cli_entry_shows_no_known_notice():
    """`trl-fp8 demo --help` imports the whole stack (torch, torchao, bitsandbytes, trl) and prints nothing else."""
    proc = _run("import sys; from trl_fp8.app.cli import main; sys.exit(main(['demo', '--help']))")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--fair-cast" in proc.stdout
    for marker in NOTICE_MARKERS:
        assert marker not in proc.stderr, proc.stderr


@pytest.mark.parametrize("verbose, expected", [(None, len(KNOWN_NOTICES)), ("1", 0)])
def test_cli_entry_installs_the_filters_unless_verbose(verbose, expected):
    code = ("from trl_fp8.app.cli import main; main(['--version']); "
            "from trl_fp8.app.quiet import installed_filters; print('filters', len(installed_filters()))")
    proc = _run(code, **({VERBOSE_ENV: verbose} if verbose else {}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"filters {expected}" in proc.stdout

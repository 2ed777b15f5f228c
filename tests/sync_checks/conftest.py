"""Fixtures of the weight-sync checks' tests."""

import pytest

from trl_fp8.sync_checks import compare


@pytest.fixture(params=["native", "memcmp", "torch"])
def compare_path(request, monkeypatch):
    """Every way of comparing bits: the compiled kernels' batched comparison, the C library's memcmp on host tensors,
    and torch's (as off the host)."""
    if request.param == "native":
        if compare._native_lib() is None:
            pytest.skip("no C compiler here: the compiled comparison is not built")
        return request.param
    monkeypatch.setattr(compare, "_native_lib", lambda: None)
    if request.param == "torch":
        monkeypatch.setattr(compare, "_MEMCMP", None)
    else:
        assert compare._MEMCMP is not None
    return request.param


@pytest.fixture(params=["native", "torch"])
def stats_path(request, monkeypatch):
    """Both ways of computing the logprob check's token statistics: one call into the compiled kernels (CPU), and
    the tensor operations (every device)."""
    if request.param == "native":
        if compare._native_lib() is None:
            pytest.skip("no C compiler here: the compiled statistics are not built")
    else:
        monkeypatch.setattr(compare, "_native_lib", lambda: None)
    return request.param

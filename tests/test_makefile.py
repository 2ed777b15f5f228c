"""`make test` runs both suites whatever the first gives, and fails if either failed."""

import os
import shutil
import subprocess
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("main, vllm, expected", [("false", "true", 2), ("true", "false", 2), ("true", "true", 0)])
def test_make_test_runs_both_suites_and_fails_if_either_fails(tmp_path, main, vllm, expected):
    stamps = [tmp_path / "stamp", tmp_path / "vllm_stamp"]
    time.sleep(0.01)
    for stamp in stamps:  # newer than pyproject.toml: make installs nothing
        stamp.touch()
    ran = tmp_path / "ran"
    done = subprocess.run(
        ["make", "-s", "-C", ROOT, "test", f"STAMP={stamps[0]}", f"VLLM_STAMP={stamps[1]}",
         f"PYTEST_MAIN=echo main >> {ran}; {main}", f"PYTEST_VLLM=echo vllm >> {ran}; {vllm}"],
        capture_output=True, text=True, timeout=120)
    assert ran.read_text().split() == ["main", "vllm"]  # the vLLM suite ran after a failed main suite too
    assert (done.returncode != 0) == (expected != 0), done.stdout + done.stderr
    said = "main suite exit {}, vLLM suite exit {}".format(0 if main == "true" else 2, 0 if vllm == "true" else 2)
    assert f"make test: {said}" in done.stdout, done.stdout

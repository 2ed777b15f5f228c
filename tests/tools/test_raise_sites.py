"""tools/raise_sites.py: what it counts as a raise site, a message, and a message a test checks."""

import importlib.util
import os
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("raise_sites", os.path.join(ROOT, "tools", "raise_sites.py"))
raise_sites = importlib.util.module_from_spec(spec)
sys.modules["raise_sites"] = raise_sites  # its dataclass looks its module up
spec.loader.exec_module(raise_sites)

# made-up messages: this file is part of the tests text the real count reads, so it must match nothing in trl_fp8
PACKAGE = '''
def f(x, err):
    if x == 1:
        raise ValueError(f"widget_count must be > 0, got {x}")          # tested (a pytest.raises match)
    if x == 2:
        raise TypeError("frobnicate expects a quux tensor")  # untested
    if x == 3:
        raise WeightSyncError("freshness", f"tensor {x!r} wobbles unlike what the zork sent (max |d| {x})")  # tested
    if x == 4:
        raise ValueError(f"{x}: {err}")                            # unjudged: no long literal text
    if x == 5:
        raise ValueError(err)                                       # no message text
    if x == 6:
        raise                                                       # re-raise
    if x == 7:
        raise err from None                                         # forwards one built elsewhere
    raise RuntimeError("a message wrapped over "
                       "two source lines, tested")
'''

TESTS = r'''
def test_it():
    with pytest.raises(ValueError, match=r"widget_count must be > 0, got 0"):
        f(1, None)
    assert "wobbles unlike what the zork sent" in str(err)
    with pytest.raises(RuntimeError, match="wrapped over two source lines"):
        f(8, None)
'''


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(textwrap.dedent(PACKAGE))
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_m.py").write_text(TESTS)
    return tmp_path


def test_it_finds_every_kind_of_raise_site(tree):
    sites = raise_sites.raise_sites(str(tree / "pkg"))
    assert [s.kind for s in sites] == ["message", "message", "message", "message", "no_text", "reraise", "reraise",
                                       "message"]
    assert sites[0].fragments == ["widget_count must be > 0, got"] and sites[0].exception == "ValueError"
    assert sites[2].fragments[1] == "wobbles unlike what the zork sent (max |d|"  # the message, not the check's name
    assert sites[-1].fragments == ["a message wrapped over two source lines, tested"]


def test_it_judges_each_message_against_the_tests_text(tree):
    sites = raise_sites.raise_sites(str(tree / "pkg"))
    text = raise_sites.tests_text(str(tree / "tests"))
    verdicts = [raise_sites.judge(s, text, 12, 24) for s in sites if s.kind == "message"]
    assert verdicts == ["tested", "untested", "tested", "unjudged", "tested"]


def test_its_last_line_is_the_count(tree, capsys):
    assert raise_sites.main(["--package", str(tree / "pkg"), "--tests", str(tree / "tests"), "--list"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "raise_sites_without_a_message_test: 1 (of 5 raise sites with a message)"
    assert any(line.startswith("untested") and "m.py:6 TypeError" in line for line in out), out
    with pytest.raises(SystemExit):
        raise_sites.main(["--package", str(tree / "nowhere")])

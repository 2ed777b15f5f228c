"""trl_fp8._moved: the 0.1 import paths still work, give the same module objects, and say where the module went."""

import importlib
import os
import subprocess
import sys
import warnings

import pytest

from trl_fp8._moved import MOVED, _Alias, new_name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_every_new_name_exists_and_no_old_one_is_on_disk(old, new):
    assert importlib.util.find_spec(new) is not None
    path = os.path.join(ROOT, *old.split("."))
    assert not os.path.exists(path) and not os.path.exists(path + ".py"), f"{old} is still a real module"


def test_old_names_are_the_new_modules_with_a_warning_naming_the_new_path(monkeypatch):
    monkeypatch.setattr(_Alias, "warned", set())
    for name in [n for n in sys.modules if new_name(n) is not None]:  # imported by an earlier test: import afresh
        monkeypatch.delitem(sys.modules, name)
    from trl_fp8.capability import Capability
    from trl_fp8.time_budget import core

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from trl_fp8.budget import core as old_core
        from trl_fp8.components import Capability as OldCapability
        old_layers = importlib.import_module("trl_fp8.qlora.layers")
        importlib.import_module("trl_fp8.qlora.cache")  # a second module under the same old name: no second warning
    assert old_core is core and OldCapability is Capability
    assert old_layers is importlib.import_module("trl_fp8.fast_qlora.layers")
    assert old_layers.__spec__.name == "trl_fp8.fast_qlora.layers"  # the module's own spec is kept
    messages = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert messages == [
        "trl_fp8.budget was renamed trl_fp8.time_budget: import it from there (the old name will be removed in a "
        "later release)",
        "trl_fp8.components was renamed trl_fp8.capability: import it from there (the old name will be removed in a "
        "later release)",
        "trl_fp8.qlora was renamed trl_fp8.fast_qlora: import it from there (the old name will be removed in a "
        "later release)",
    ]
    assert all(w.filename == __file__ for w in caught)  # attributed to the importing line, not to importlib


def test_new_name():
    assert new_name("trl_fp8.sync.checks") == "trl_fp8.sync_checks.checks"
    assert new_name("trl_fp8.sync_checks.checks") is None
    assert new_name("trl_fp8.tasks") == "trl_fp8.app.tasks"
    assert new_name("trl_fp8.trainer") is None


def test_python_dash_m_under_the_old_name_runs_the_script():
    result = subprocess.run([sys.executable, "-m", "trl_fp8.scripts.grpo", "--help"], capture_output=True, text=True,
                            timeout=300, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--fair_cast" in result.stdout
    assert "trl_fp8.scripts was renamed trl_fp8.app.scripts" in result.stderr

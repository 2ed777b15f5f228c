"""Old import paths of renamed modules keep working, with a ``FutureWarning`` that names the new path.

The names are data (:data:`MOVED`): an import of an old name, or of anything under it, returns the module at the new
name — the same object, so classes and module state are not duplicated — and ``python -m <old>.<module>`` runs the
new module's code. Installed once by ``import trl_fp8``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
import warnings

# old dotted name -> new dotted name (0.2: names that say what they hold; the app under trl_fp8.app)
MOVED: dict[str, str] = {
    "trl_fp8.budget": "trl_fp8.time_budget",
    "trl_fp8.qlora": "trl_fp8.fast_qlora",
    "trl_fp8.sync": "trl_fp8.sync_checks",
    "trl_fp8.components": "trl_fp8.capability",
    "trl_fp8.capabilities": "trl_fp8.registry",
    "trl_fp8.cli": "trl_fp8.app.cli",
    "trl_fp8.report": "trl_fp8.app.report",
    "trl_fp8.demo": "trl_fp8.app.demo",
    "trl_fp8.tasks": "trl_fp8.app.tasks",
    "trl_fp8.scripts": "trl_fp8.app.scripts",
}


def new_name(fullname: str) -> str | None:
    """The current name of ``fullname`` (a module under an old name), or None when it was not moved."""
    if not fullname.startswith("trl_fp8."):  # the finder sees every import of the process: leave others at once
        return None
    for old, new in MOVED.items():
        if fullname == old or fullname.startswith(old + "."):
            return new + fullname[len(old):]
    return None


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds old names first (before the path finder, which would load a second copy of a submodule through the
    aliased package's ``__path__``) and loads them as the module at the new name."""

    warned: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        new = new_name(fullname)
        if new is None:
            return None
        real = importlib.util.find_spec(new)
        if real is None:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=real.submodule_search_locations is not None)

    def create_module(self, spec):
        new = new_name(spec.name)
        top = next(old for old in MOVED if spec.name == old or spec.name.startswith(old + "."))
        if top not in self.warned:
            self.warned.add(top)
            warnings.warn(f"{top} was renamed {MOVED[top]}: import it from there (the old name will be removed in a "
                          "later release)", FutureWarning, stacklevel=_importer_level())
        module = importlib.import_module(new)
        self._spec = module.__spec__  # importlib sets __spec__ to the alias spec; exec_module puts it back
        return module

    def exec_module(self, module):
        module.__spec__ = self._spec

    def get_code(self, fullname):
        """``python -m <old name>``: runpy runs this code as ``__main__`` (with the old package as ``__package__``,
        which the new module's relative imports cannot use), so it runs the new module the same way."""
        new = new_name(fullname)
        return compile(f"import runpy\nrunpy.run_module({new!r}, run_name='__main__', alter_sys=True)\n",
                       f"<{fullname}: moved to {new}>", "exec")


def _importer_level() -> int:
    """The ``stacklevel`` of the code that imported the old name, for the warning. ``warnings`` itself skips
    importlib's bootstrap frames when it counts, so only the others are counted here; ``importlib.import_module``'s
    own frame is passed over too."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None:
        frame = frame.f_back
        name = frame.f_code.co_filename
        if "importlib" in name and "_bootstrap" in name:
            continue
        level += 1
        if name != __file__ and os.sep + "importlib" + os.sep not in name:
            return level
    return 1


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())

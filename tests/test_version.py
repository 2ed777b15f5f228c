"""trl_fp8._version: one place for the version, which nothing inside the package imports from its ``__init__``."""

import ast
import pathlib
import tomllib

import trl_fp8
from trl_fp8 import _version

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_version_is_the_projects():
    with open(ROOT / "pyproject.toml", "rb") as f:
        assert tomllib.load(f)["project"]["version"] == _version.__version__ == trl_fp8.__version__


def test_no_module_imports_the_version_from_the_package_init():
    upward = []
    for path in sorted((ROOT / "trl_fp8").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and any(a.name == "__version__" for a in node.names):
                package_init = node.level and not node.module or node.module == "trl_fp8"
                if package_init and path != ROOT / "trl_fp8" / "__init__.py":
                    upward.append(str(path.relative_to(ROOT)))
    assert upward == []

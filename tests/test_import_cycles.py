"""No import cycle between trl_fp8's top-level units (each subpackage, each top-level module), counting imports made
inside functions too: a lazy import is still a dependency (docs/architecture.md). Read from the source with ``ast``."""

import ast
import pathlib

import trl_fp8

ROOT = pathlib.Path(trl_fp8.__file__).parent


def _unit(path: pathlib.Path) -> str:
    first = path.relative_to(ROOT).parts[0]
    return first.removesuffix(".py")


def _module(path: pathlib.Path) -> list[str]:
    parts = ["trl_fp8", *path.relative_to(ROOT).with_suffix("").parts]
    return parts[:-1] if parts[-1] == "__init__" else parts


def _imported(path: pathlib.Path):
    """Every ``trl_fp8.<unit>`` named by an import anywhere in ``path`` (``from . import x`` names unit ``x``)."""
    here = _module(path)
    package = here if path.name == "__init__.py" else here[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            stem = ".".join(base + ([node.module] if node.module else [])) if node.level else (node.module or "")
            names = [stem] + [f"{stem}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if len(parts) > 1 and parts[0] == "trl_fp8" and (
                    (ROOT / parts[1]).is_dir() or (ROOT / f"{parts[1]}.py").is_file()):
                yield parts[1]


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        unit = _unit(path)
        if unit == "__init__":
            continue  # the package's own __init__ re-exports the public API: it is the top, not a unit
        graph.setdefault(unit, set()).update(u for u in _imported(path) if u not in (unit, "__init__"))
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components with more than one unit (each one holds a cycle)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_between_trl_fp8_units():
    assert strongly_connected(import_graph()) == []


def test_the_detector_finds_a_cycle():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    graph = import_graph()
    assert "capability" in graph["fair_cast"] and "_trl" in graph["trainer"]  # it reads real imports

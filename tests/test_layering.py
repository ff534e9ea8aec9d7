"""The package layering docs/architecture.md draws, checked on the code: no import runs up a
layer and no two modules import each other round a circle (at any depth, including imports
inside functions, which Python allows but which still tie the packages together)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "orchestrator"

# Lowest first. A module may import its own layer's modules and any layer below, never above.
LAYERS = [
    {"errors", "sizes", "settings", "actor_names", "ray_private"},
    {"spec", "lifecycle", "home", "definitions", "templates"},
    {"storage", "cluster"},
    {"node"},
    {"agents"},
    {"scheduler", "serving", "books"},
    {"controller"},
    {"client"},
    {"cli", "__main__", "__init__"},
]
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def imports() -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("orchestrator.")}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module == "orchestrator":  # `from orchestrator import settings`
                    found |= {f"orchestrator.{a.name}" for a in node.names}
                elif node.module.startswith("orchestrator."):
                    found.add(node.module)
        graph[name] = found - {name}
    return graph


def unit(module: str) -> str:
    """`orchestrator.storage.records` -> "storage"; the top package itself -> "__init__"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_package_has_a_layer():
    units = {unit(m) for m in imports()}
    assert units <= set(LAYER), f"give these a layer in LAYERS: {sorted(units - set(LAYER))}"


def test_no_import_runs_up_a_layer():
    upward = sorted(
        f"{module} imports {target}"
        for module, targets in imports().items()
        for target in targets
        if unit(target) in LAYER and LAYER[unit(target)] > LAYER[unit(module)]
    )
    assert not upward, "\n".join(upward)


def test_no_circle_of_imports_between_modules():
    graph = imports()
    circles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if target not in graph:
                continue  # a name imported from a module, not a module of its own
            if state.get(target) == 1:
                circles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "\n".join(circles)


def test_a_submodule_import_from_the_package_loads_no_spec():
    """`from orchestrator import settings` (every controller and node agent does such imports)
    must not go through the package's lazy names, which load the spec's pydantic models."""
    import subprocess
    import sys

    probe = (
        "import sys; from orchestrator import settings, actor_names; "
        "print(sorted(m for m in sys.modules if m.startswith('orchestrator.spec')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


MAX_LINES = 450  # a module a newcomer reads in one sitting (../shared/STYLE.md)


def test_no_module_is_longer_than_a_sitting():
    long = sorted(
        f"{path.relative_to(PACKAGE.parent)}: {n} lines"
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    )
    assert not long, "split these: " + "; ".join(long)

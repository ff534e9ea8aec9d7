"""The example jobs in `recipes/`, shipped for `orchestrator init --examples`."""

from __future__ import annotations

import shutil
from pathlib import Path

from orchestrator.errors import OrchestratorError

_PACKAGE_DIR = Path(__file__).resolve().parents[1]
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints")


def recipes_dir() -> Path:
    """`orchestrator/_recipes` in an installed wheel, the repository's `recipes/` in a checkout."""
    for candidate in (_PACKAGE_DIR / "_recipes", _PACKAGE_DIR.parent / "recipes"):
        if candidate.is_dir():
            return candidate
    raise OrchestratorError("no recipes are installed with this copy of orchestrator")


def list_recipes() -> dict[str, str]:
    """Recipe name to its one-line description (the first line of its config's docstring)."""
    found = {}
    for config in sorted(recipes_dir().glob("*/config.py")):
        found[config.parent.name] = _first_doc_line(config)
    return found


def copy_recipe(name: str, target: Path) -> Path:
    available = list_recipes()
    if name not in available:
        raise OrchestratorError(
            f"no recipe named {name!r}; available: {', '.join(available) or 'none'} "
            "(see `orchestrator init --list-examples`)"
        )
    dest = target / name
    if dest.exists():
        raise OrchestratorError(f"{dest} already exists: choose another --target-directory")
    shutil.copytree(recipes_dir() / name, dest, ignore=_IGNORE)
    return dest


def _first_doc_line(config: Path) -> str:
    import ast

    doc = ast.get_docstring(ast.parse(config.read_text()))
    return doc.strip().splitlines()[0] if doc else ""

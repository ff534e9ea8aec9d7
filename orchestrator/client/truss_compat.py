"""Configs written for Baseten run unchanged.

Without the `truss` package, `import truss_train` and `from truss.base import truss_config` resolve
to our own definitions while a config runs. With `truss` installed, its objects are converted.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import ValidationError

from orchestrator import definitions
from orchestrator.errors import ConfigError, PushWhileLoading
from orchestrator.spec.training import TrainingProject
from orchestrator.spec.validation import describe_validation_error

_TRUSS_CONFIG_NAMES = (
    "Accelerator",
    "AcceleratorSpec",
    "DockerAuthType",
    "WeightsSource",
    "WeightsAuth",
    "WeightsAuthMethod",
)


def _refuse_push(*args: Any, **kwargs: Any) -> Any:
    """`truss_train.push` while a config loads: loading never submits anything (`validate` would
    push a job, and `push` two, the inner one packaging whatever directory it was run from)."""
    raise PushWhileLoading(
        "the config calls truss_train.push(...) while it loads; `orchestrator push config.py` "
        "pushes it. To keep `python config.py` pushing too, put the call under "
        '`if __name__ == "__main__":`'
    )


def truss_installed() -> bool:
    try:
        return importlib.util.find_spec("truss_train") is not None
    except (ImportError, ValueError):
        return False


def _shim_modules() -> dict[str, types.ModuleType]:
    def module(name: str, attrs: dict[str, Any], package: bool = False) -> types.ModuleType:
        mod = types.ModuleType(name, f"orchestrator's stand-in for {name}")
        mod.__dict__.update(attrs)
        if package:
            mod.__path__ = []
        return mod

    spec = {n: getattr(definitions, n) for n in definitions.__all__}
    truss_config = module(
        "truss.base.truss_config", {n: getattr(definitions, n) for n in _TRUSS_CONFIG_NAMES}
    )
    base = module("truss.base", {"truss_config": truss_config}, package=True)
    truss = module("truss", {"base": base}, package=True)
    train_defs = module("truss_train.definitions", spec)
    truss_train = module(
        "truss_train", {**spec, "definitions": train_defs, "push": _refuse_push}, package=True
    )
    return {
        "truss": truss,
        "truss.base": base,
        "truss.base.truss_config": truss_config,
        "truss_train": truss_train,
        "truss_train.definitions": train_defs,
    }


class _Installed:
    """What `baseten_imports` put in place, kept while any config loads: a count of the loads
    in progress, so a load that ends never takes the stand-ins from one still running (pushes
    from a thread pool)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.loads = 0
        self.shims: dict[str, types.ModuleType] = {}
        self.real_push: Any = None


_installed = _Installed()


@contextmanager
def baseten_imports() -> Iterator[None]:
    """While active (a config loading), Baseten's import paths resolve to our definitions, and
    `truss_train.push` refuses, the real one too if truss is installed. Safe from many threads
    at once: the first to enter installs, the last to leave removes."""
    with _installed.lock:
        if _installed.loads == 0:
            _install()
        _installed.loads += 1
    try:
        yield
    finally:
        with _installed.lock:
            _installed.loads -= 1
            if _installed.loads == 0:
                _uninstall()


def _install() -> None:
    if truss_installed():
        import truss_train

        _installed.real_push = truss_train.push
        truss_train.push = _refuse_push
        return
    shims = {name: mod for name, mod in _shim_modules().items() if name not in sys.modules}
    sys.modules.update(shims)
    _installed.shims = shims


def _uninstall() -> None:
    if _installed.real_push is not None:
        import truss_train

        truss_train.push = _installed.real_push
        _installed.real_push = None
    for name, mod in _installed.shims.items():
        if sys.modules.get(name) is mod:
            del sys.modules[name]
    _installed.shims = {}


def is_truss_project(obj: object) -> bool:
    cls = type(obj)
    return cls.__name__ == "TrainingProject" and cls.__module__.startswith("truss_train")


def from_truss_project(obj: Any) -> TrainingProject:
    """Convert a real `truss_train.TrainingProject` (its `job` is excluded from its own dump)."""
    data = {
        "name": obj.name,
        "team_name": getattr(obj, "team_name", None),
        "job": obj.job.model_dump(mode="json"),
    }
    try:
        return TrainingProject.model_validate(data, strict=False)
    except ValidationError as e:
        raise ConfigError(
            "The truss_train project cannot run on orchestrator:",
            describe_validation_error(e, TrainingProject, prefix=""),
        ) from None

"""Loads a user's `config.py` into a validated `TrainingProject`."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, ModuleType
from typing import Any, NoReturn

from pydantic import BaseModel, ValidationError

from orchestrator import definitions, settings
from orchestrator.client.truss_compat import (
    baseten_imports,
    from_truss_project,
    is_truss_project,
)
from orchestrator.errors import ConfigError, PushWhileLoading
from orchestrator.spec.deploy import DeployCheckpointsConfig
from orchestrator.spec.training import TrainingProject
from orchestrator.spec.validation import describe_validation_error

LOAD_TIMEOUT_ENV = settings.CONFIG_LOAD_TIMEOUT_S.name
# A config runs against the process's sys.path, sys.modules and os._exit: two at once (pushes
# from a thread pool) would import each other's sibling modules and restore each other's swaps.
# Loading takes milliseconds; configs load one at a time.
_LOADING = threading.Lock()


@dataclass(frozen=True)
class LoadedConfig:
    project: TrainingProject
    config_path: Path
    source_dir: Path  # the config's directory: what gets packaged unless a Workspace says otherwise


def load_config(path: str | Path) -> LoadedConfig:
    """Run `config.py` and return its one `TrainingProject`, fully validated.

    The config's directory is importable while it runs, so it can import sibling modules.
    """
    config_path = Path(path).expanduser().resolve()
    if not config_path.is_file() or config_path.suffix != ".py":
        raise ConfigError(
            f"{path} must point to a python file (a config.py defining a TrainingProject)"
        )
    module = _execute(config_path)
    project = validate_project(_find_project(module, config_path))
    return LoadedConfig(project=project, config_path=config_path, source_dir=config_path.parent)


def validate_project(project: object) -> TrainingProject:
    """Validate the whole project again, so edits made after construction are checked too."""
    if is_truss_project(project):
        return from_truss_project(project)
    if not isinstance(project, TrainingProject):
        raise ConfigError(f"expected a TrainingProject, got {type(project).__name__}")
    try:
        # A Python-mode dump keeps whatever was assigned after construction, so validation
        # (not serialisation) reports a bad value, with its path.
        return TrainingProject.model_validate(project.model_dump(warnings=False))
    except ValidationError as e:
        raise ConfigError(
            "The TrainingProject is invalid:", describe_validation_error(e, TrainingProject, "")
        ) from None


def _execute(config_path: Path) -> ModuleType:
    with _LOADING:
        return _execute_alone(config_path)


def _execute_alone(config_path: Path) -> ModuleType:
    digest = hashlib.sha1(str(config_path).encode()).hexdigest()[:10]
    name = f"_orchestrator_config_{digest}"
    spec = importlib.util.spec_from_file_location(name, config_path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{config_path} cannot be imported as a python module")
    module = importlib.util.module_from_spec(spec)
    config_dir = str(config_path.parent)
    modules_before = set(sys.modules)
    sys.modules[name] = module
    sys.path.insert(0, config_dir)
    try:
        # Compile from source: a cached .pyc could be stale when a script rewrites the config
        # within the same second (a sweep), and the user must get what the file says now.
        code = compile(config_path.read_bytes(), str(config_path), "exec")
        _run(code, module.__dict__, config_path)
    except PushWhileLoading as e:
        raise ConfigError(f"{config_path.name}{_where(e, config_path)}: {e}") from None
    except ConfigError:
        raise
    except ValidationError as e:
        raise ConfigError(
            f"{config_path.name}{_where(e, config_path)}: invalid {e.title}",
            describe_validation_error(e, _model_named(e.title)),
        ) from None
    except (_ExitCalled, SystemExit) as e:
        how = f"os._exit({e.args[0]})" if isinstance(e, _ExitCalled) else f"sys.exit({e.code!r})"
        raise ConfigError(
            f"{config_path.name}{_where(e, config_path)} called {how} while loading: a config "
            "defines a TrainingProject and returns; it must not end the process"
        ) from None
    except Exception as e:
        raise ConfigError(
            f"{config_path.name}{_where(e, config_path)} raised {type(e).__name__}: {e}"
        ) from e
    finally:
        sys.path.remove(config_dir)
        # Sibling modules imported by this config must not leak into the next config's imports.
        for mod_name in set(sys.modules) - modules_before:
            if mod_name == name or _lives_in(sys.modules[mod_name], config_dir):
                del sys.modules[mod_name]
    return module


class _ExitCalled(BaseException):
    """os._exit, called by a config while it loads: refused, or the process ends in silence."""


def load_timeout() -> float:
    return settings.CONFIG_LOAD_TIMEOUT_S.get()


def _run(code: CodeType, namespace: dict[str, Any], config_path: Path) -> None:
    """Run a config's code in a thread of its own, within the load time limit, with os._exit
    raising instead of ending the process."""
    timeout = load_timeout()
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            exec(code, namespace)
        except BaseException as e:
            outcome.append(e)
        else:
            outcome.append(None)

    def refuse_exit(status: int = 0) -> NoReturn:
        raise _ExitCalled(status)

    real_exit = os._exit
    os._exit = refuse_exit
    try:
        # The stand-ins go when this load ends, not when the config's thread does: a config
        # still running past the time limit must not leave `truss` importable for the rest of
        # the process.
        with baseten_imports():
            thread = threading.Thread(target=run, name=f"load {config_path.name}", daemon=True)
            thread.start()
            thread.join(timeout)
    finally:
        os._exit = real_exit
    if not outcome:
        raise ConfigError(
            f"{config_path} did not finish loading in {timeout:g} s ({LOAD_TIMEOUT_ENV}): a "
            "config defines a TrainingProject and returns; long work belongs in start_commands"
        )
    if outcome[0] is not None:
        raise outcome[0]


def _lives_in(module: ModuleType, directory: str) -> bool:
    """A module or (namespace) package loaded from `directory`."""
    places = [getattr(module, "__file__", None) or "", *getattr(module, "__path__", [])]
    return any(str(p).startswith(directory + "/") for p in places)


def _where(error: BaseException, config_path: Path) -> str:
    """` line N` of the innermost frame inside the config file, if any."""
    frames = [
        f for f in traceback.extract_tb(error.__traceback__) if f.filename == str(config_path)
    ]
    return f" line {frames[-1].lineno}" if frames else ""


def _model_named(title: str) -> type[BaseModel] | None:
    cls = getattr(definitions, title, None)
    return cls if isinstance(cls, type) and issubclass(cls, BaseModel) else None


def _find_project(module: ModuleType, config_path: Path) -> object:
    found: dict[int, tuple[object, list[str]]] = {}
    for var, value in vars(module).items():
        if isinstance(value, TrainingProject) or is_truss_project(value):
            found.setdefault(id(value), (value, []))[1].append(var)
    if not found:
        raise ConfigError(
            f"{config_path} defines no TrainingProject: assign one at module level, e.g. "
            "`project = TrainingProject(name=..., job=TrainingJob(...))`"
        )
    if len(found) > 1:
        names = "; ".join(" = ".join(names) for _, names in found.values())
        raise ConfigError(
            f"{config_path} defines {len(found)} TrainingProjects ({names}): keep exactly one "
            "at module level"
        )
    return next(iter(found.values()))[0]


def load_deploy_config(path: str | Path) -> DeployCheckpointsConfig:
    """Run a deploy config file and return its one `DeployCheckpointsConfig`, validated."""
    config_path = Path(path).expanduser().resolve()
    if not config_path.is_file() or config_path.suffix != ".py":
        raise ConfigError(f"{path} must point to a python file defining a DeployCheckpointsConfig")
    module = _execute(config_path)
    found = {id(v): v for v in vars(module).values() if isinstance(v, DeployCheckpointsConfig)}
    if len(found) != 1:
        raise ConfigError(
            f"{config_path} defines {len(found)} DeployCheckpointsConfigs: keep exactly one at "
            "module level, e.g. `deploy = DeployCheckpointsConfig(model_name=...)`"
        )
    config = next(iter(found.values()))
    try:
        return DeployCheckpointsConfig.model_validate(config.model_dump(warnings=False))
    except ValidationError as e:
        raise ConfigError(
            "The DeployCheckpointsConfig is invalid:",
            describe_validation_error(e, DeployCheckpointsConfig, ""),
        ) from None

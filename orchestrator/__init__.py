"""orchestrator: Baseten-Training-style jobs on your own Ray cluster.

`from orchestrator import TrainingProject, push, ...` works as usual, but the names load on
first use: node agents and controllers import `orchestrator.<module>` in every new Ray worker,
on every job's critical path, and must not pay for the spec and client they do not use.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

__version__ = "0.1.0"

_CLIENT_API = ("push", "dry_run", "get_job", "list_jobs", "list_projects")
_QUEUE_API = ("set_capacity", "capacity", "queue", "update_priority")
_DEPLOY_API = ("deploy_checkpoints", "list_deployments", "get_deployment", "stop_deployment")
_AUDIT_API = ("events",)
_ERRORS = (
    "ConfigError", "OrchestratorError", "PushWhileLoading", "SettingError",
    "UnsupportedFeatureError", "WorkspaceError",
)  # fmt: skip
# For training scripts on the nodes: light, no Ray, no spec.
_NODE_HELPERS = ("mark_checkpoint_complete",)
_PROGRESS = ("progress",)  # the stuck detector's beat (node/progress_beat.py)


def __getattr__(name: str) -> Any:
    if name == "__all__":  # `from orchestrator import *`
        return _public_names()
    if name == "definitions":
        return importlib.import_module("orchestrator.definitions")
    if name in _CLIENT_API:
        return getattr(importlib.import_module("orchestrator.client.api"), name)
    if name in _QUEUE_API:
        return getattr(importlib.import_module("orchestrator.client.queue"), name)
    if name in _DEPLOY_API:
        return getattr(importlib.import_module("orchestrator.client.deploy"), name)
    if name in _AUDIT_API:
        return getattr(importlib.import_module("orchestrator.client.audit"), name)
    if name in _ERRORS:
        return getattr(importlib.import_module("orchestrator.errors"), name)
    if name in _NODE_HELPERS:
        return getattr(importlib.import_module("orchestrator.storage.local_checkpoint"), name)
    if name in _PROGRESS:
        return getattr(importlib.import_module("orchestrator.node.progress_beat"), name)
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:
        # `from orchestrator import settings` asks here first: a submodule is for the import
        # system to load, without the spec's ~0.3 s of pydantic models on every worker's path.
        raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
    definitions = importlib.import_module("orchestrator.definitions")
    if name in definitions.__all__:
        return getattr(definitions, name)
    raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(_public_names())


def _public_names() -> list[str]:
    from orchestrator.definitions import __all__ as spec_names

    return [*_CLIENT_API, *_QUEUE_API, *_DEPLOY_API, *_AUDIT_API, *_ERRORS, *_NODE_HELPERS,
            *_PROGRESS, "definitions", *spec_names]  # fmt: skip

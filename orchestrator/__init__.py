"""orchestrator: Baseten-Training-style jobs on your own Ray cluster."""

from orchestrator import definitions
from orchestrator.client.api import get_job, list_jobs, list_projects, push
from orchestrator.definitions import *  # noqa: F403
from orchestrator.definitions import __all__ as _definitions_all
from orchestrator.errors import (
    ConfigError,
    OrchestratorError,
    UnsupportedFeatureError,
    WorkspaceError,
)

__version__ = "0.1.0"


__all__ = [
    "ConfigError",
    "OrchestratorError",
    "UnsupportedFeatureError",
    "WorkspaceError",
    "definitions",
    "get_job",
    "list_jobs",
    "list_projects",
    "push",
    *_definitions_all,
]

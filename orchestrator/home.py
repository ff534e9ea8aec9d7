"""Where orchestrator keeps its local state on this machine."""

from __future__ import annotations

from pathlib import Path

from orchestrator import settings

ORCHESTRATOR_HOME_ENV = settings.HOME.name


def orchestrator_home() -> Path:
    """`$ORCHESTRATOR_HOME`, else ~/.orchestrator (the local cluster's state, the storage root)."""
    configured = settings.HOME.get()
    return Path(configured).expanduser() if configured else Path.home() / ".orchestrator"

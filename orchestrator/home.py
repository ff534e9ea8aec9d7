"""Where orchestrator keeps its local state on this machine."""

from __future__ import annotations

import os
from pathlib import Path

ORCHESTRATOR_HOME_ENV = "ORCHESTRATOR_HOME"


def orchestrator_home() -> Path:
    """`$ORCHESTRATOR_HOME`, else ~/.orchestrator (the local cluster's state, the storage root)."""
    configured = os.environ.get(ORCHESTRATOR_HOME_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".orchestrator"

"""Where a node keeps what orchestrator puts on its local disk."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

NODE_ROOT_ENV = "ORCHESTRATOR_NODE_ROOT"


def node_root() -> Path:
    """Node-local base for jobs' working, scratch and checkpoint directories, and weights."""
    return Path(os.environ.get(NODE_ROOT_ENV) or Path(tempfile.gettempdir()) / "orchestrator")

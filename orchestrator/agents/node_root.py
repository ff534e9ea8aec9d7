"""Where a node keeps what orchestrator puts on its local disk."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

NODE_ROOT_ENV = "ORCHESTRATOR_NODE_ROOT"


def node_root() -> Path:
    """Node-local base for jobs' working, scratch and checkpoint directories, and weights."""
    return Path(os.environ.get(NODE_ROOT_ENV) or Path(tempfile.gettempdir()) / "orchestrator")


def job_node_dir(job_id: str, rank: int) -> Path:
    """A rank's directory on its node: workspace/, scratch/, checkpoints/ (the default
    $BT_CHECKPOINT_DIR), and what the agent leaves there for the rank's uploader."""
    return node_root() / "jobs" / job_id / f"rank-{rank}"

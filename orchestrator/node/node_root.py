"""Where a node keeps what orchestrator puts on its local disk."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from orchestrator import settings

NODE_ROOT_ENV = settings.NODE_ROOT.name


def node_root() -> Path:
    """Node-local base for jobs' working, scratch and checkpoint directories, and weights."""
    return Path(settings.NODE_ROOT.get() or Path(tempfile.gettempdir()) / "orchestrator")


def job_node_dir(job_id: str, rank: int) -> Path:
    """A rank's directory on its node: workspace/, scratch/, checkpoints/ (the default
    $BT_CHECKPOINT_DIR), and what the agent leaves there for the rank's uploader."""
    return node_root() / "jobs" / job_id / f"rank-{rank}"


@dataclass(frozen=True)
class RankDirs:
    """A rank's directories on its node: the node-disk twin of storage/layout.py, used by the
    agent that makes them and the controller that names them in the job's environment."""

    base: Path

    @classmethod
    def of(cls, job_id: str, rank: int) -> RankDirs:
        return cls(job_node_dir(job_id, rank))

    @classmethod
    def around(cls, workspace: str | Path) -> RankDirs:
        """From the workspace a node reported: its root may differ from this machine's."""
        return cls(Path(workspace).parent)

    @property
    def workspace(self) -> Path:
        return self.base / "workspace"

    @property
    def scratch(self) -> Path:
        return self.base / "scratch"

    @property
    def checkpoints(self) -> Path:
        """The default $BT_CHECKPOINT_DIR."""
        return self.base / "checkpoints"

    @property
    def loaded_checkpoints(self) -> Path:
        """Baseten's default download_folder, made private to the job."""
        return self.base / "loaded_checkpoints"

    @property
    def cache(self) -> Path:
        """The training cache's links, unless mount_base_path is set."""
        return self.base / "cache"

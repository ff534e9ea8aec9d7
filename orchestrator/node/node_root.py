"""Where a node keeps what orchestrator puts on its local disk.

`RANK_DIR` declares what a rank's directory holds, whichever module writes it; `RankDirs` names
those paths for the code. docs/architecture.md's node-local layout lists exactly RANK_DIR's
entries, in its order (tests/test_docs_layout.py checks it, that RankDirs names nothing else,
and that what a prepare leaves there is declared).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from orchestrator import settings
from orchestrator.storage.local_checkpoint import EARLIER_CHECKPOINTS, TOP_LEVEL_NAME

NODE_ROOT_ENV = settings.NODE_ROOT.name

# A rank's directory, `<node root>/jobs/<job_id>/rank-<n>/`: each entry's name (a directory's
# ends with `/`; `<...>` is one path segment) and who writes it.
RANK_DIR: tuple[tuple[str, str], ...] = (
    ("workspace/", "the unpacked archive, $BT_WORKING_DIR (NodePreparer)"),
    ("scratch/", "$BT_SCRATCH_DIR (NodePreparer)"),
    ("checkpoints/", "the default $BT_CHECKPOINT_DIR (NodePreparer; the job writes into it)"),
    ("loaded_checkpoints/", "the default download_folder's private copy (NodePreparer)"),
    ("cache/", "the training cache's links for the default mount_base_path (mount_caches)"),
    ("set-aside/attempt-<a>/<name>/", "checkpoints moved aside before a retry (the uploader)"),
    (EARLIER_CHECKPOINTS, "what the checkpoint directory held before the job (NodePreparer)"),
    (TOP_LEVEL_NAME, "the name its top-level files have as a checkpoint (the uploader)"),
    ("workspace.tar", "the downloaded archive, while prepare unpacks it (NodePreparer)"),
    ("failed", "container runtime: the failed command and memory kills (the container's shell)"),
    ("oom", "container runtime: left by podman's conmon after a kill for memory"),
    ("shell-<id>.pid", "container runtime: a shell command's pid inside (podman.exec_argv)"),
    ("shell-<id>.exit", "container runtime: that command's exit code (podman.exec_argv)"),
)
_DECLARED = frozenset(name.split("/")[0] for name, _ in RANK_DIR)  # top-level names


def _declared(name: str) -> str:
    """`name` if RANK_DIR declares it (at the top of the rank's directory): RankDirs can name
    no path the layout does not list."""
    if name not in _DECLARED:
        raise ValueError(f"{name!r} is not in node_root.RANK_DIR")
    return name


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
        return self.base / _declared("workspace")

    @property
    def scratch(self) -> Path:
        return self.base / _declared("scratch")

    @property
    def checkpoints(self) -> Path:
        """The default $BT_CHECKPOINT_DIR."""
        return self.base / _declared("checkpoints")

    @property
    def loaded_checkpoints(self) -> Path:
        """Baseten's default download_folder, made private to the job."""
        return self.base / _declared("loaded_checkpoints")

    @property
    def cache(self) -> Path:
        """The training cache's links, unless mount_base_path is set."""
        return self.base / _declared("cache")

    def set_aside(self, attempt: int) -> Path:
        """Where checkpoints not to resume from are moved before `attempt` (kept on the node)."""
        return self.base / _declared("set-aside") / f"attempt-{attempt}"

    @property
    def earlier_checkpoints(self) -> Path:
        """What the checkpoint directory held before the job: not the job's to upload."""
        return self.base / _declared(EARLIER_CHECKPOINTS)

    @property
    def top_level_name(self) -> Path:
        """The name the uploader gave the files at the top of the checkpoint directory."""
        return self.base / _declared(TOP_LEVEL_NAME)

    @property
    def archive(self) -> Path:
        """The code archive as downloaded; removed once unpacked."""
        return self.base / _declared("workspace.tar")

    @property
    def failed(self) -> Path:
        """In a container: which command failed, and how many processes the kernel killed for
        memory (the container's shell writes it; node/podman.py)."""
        return self.base / _declared("failed")

    @property
    def oom(self) -> Path:
        """What podman's conmon leaves in its working directory (this one) after the kernel
        killed a process of the container for memory."""
        return self.base / _declared("oom")

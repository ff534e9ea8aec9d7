"""Where a Ray Train job's checkpoints are written: each node's own `$BT_CHECKPOINT_DIR`.

Train writes a run to `<storage_path>/<name>/`: every worker copies its files of a round into
`checkpoint_<date>/` there, and the controller writes the run's snapshot beside them. On a
cluster without a shared disk, a local `storage_path` is a disk no other node sees, and one in
the storage root makes training wait on storage. So the job's driver hands Train this
filesystem instead (`redirect`): the same path on every node, which each process resolves to
its own node's checkpoint directory, the one that node's uploader watches. Training waits
only for a local copy; the uploader ships a checkpoint once Train has committed it
(agents/ray_train_callback.py). Train's storage check file is answered without being kept, so
that it is no file of any checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from orchestrator.node.node_root import RankDirs

PREFIX = "/orchestrator-job"  # the storage_path Train is given: every run lives under it
MARKER = ".validate_storage_marker"  # Train's storage check (VALIDATE_STORAGE_MARKER_FILENAME)


class NotOnTheJobsNodes(RuntimeError):
    """A process of the run is on a node the job was not admitted to."""


def node_rank(group: str) -> int | None:
    """The rank of this process's node in the job's placement group: the bundle it holds
    (one per node, so bundle i is node rank i); None on a node that holds none."""
    import ray
    from ray.util import placement_group_table

    node = ray.get_runtime_context().get_node_id()
    for entry in placement_group_table().values():
        if entry.get("name") != group or entry.get("state") == "REMOVED":
            continue
        ranks = sorted(int(i) for i, n in entry["bundles_to_node_id"].items() if n == node)
        return ranks[0] if ranks else None
    raise NotOnTheJobsNodes(f"the job's placement group {group!r} is not there (given back)")


class NodeCheckpointDirs(pafs.FileSystemHandler):
    """`<PREFIX>/<run name>/<rel>` on this node is `<this rank's checkpoint dir>/<rel>`.

    `checkpoint_path`: the job's checkpointing_config.checkpoint_path (the same on every node),
    or None for each rank's own directory. `attempt`: a job without checkpointing's, whose
    Train writes go to a directory of that attempt's in each rank's scratch instead (nothing
    stored, nothing resumed: a retry starts over). `driver_dir`: rank 0's, as the driver has it, for
    the processes of the run on a node that holds none of the job's group: Train's controller
    and the driver itself, which run on the driver's node (rank 0's) on a real cluster but, in
    a cluster simulated on one machine, join its head node. Pickled to Train's controller and
    workers; each process resolves its node once, on first use."""

    def __init__(self, job_id: str, group: str, run: str, checkpoint_path: str | None,
                 driver_dir: str, attempt: int | None = None) -> None:  # fmt: skip
        self.job_id, self.group, self.run = job_id, group, run
        self.checkpoint_path, self.driver_dir, self.attempt = checkpoint_path, driver_dir, attempt
        self.prefix = f"{PREFIX}/{run}"
        self._dir: Path | None = None
        self._local = pafs.LocalFileSystem()

    def __getstate__(self) -> dict[str, Any]:
        keys = ("job_id", "group", "run", "checkpoint_path", "driver_dir", "attempt")
        return {k: self.__dict__[k] for k in keys}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NodeCheckpointDirs) and self.__getstate__() == other.__getstate__()

    def __hash__(self) -> int:
        return hash(tuple(self.__getstate__().values()))

    @property
    def directory(self) -> Path:
        """This node's checkpoint directory (made if it is not there yet)."""
        if self._dir is None:
            rank = node_rank(self.group)
            place = Path(self.driver_dir) if rank is None else self.rank_dir(rank)
            place.mkdir(parents=True, exist_ok=True)
            self._dir = place
        return self._dir

    def rank_dir(self, rank: int) -> Path:
        """Where rank `rank`'s node keeps the run (as that node's root has it)."""
        if self.attempt is not None:
            return RankDirs.of(self.job_id, rank).scratch / "ray-train" / f"attempt-{self.attempt}"
        if self.checkpoint_path:
            return Path(self.checkpoint_path)
        return RankDirs.of(self.job_id, rank).checkpoints

    # --- paths ---------------------------------------------------------------------------------

    def _rel(self, path: str) -> str | None:
        """The path below the run's directory ("" for the run's own), None for the check file;
        an ancestor of the run's directory stands for it."""
        path = "/" + path.strip("/")
        if path == self.prefix or self.prefix.startswith(path.rstrip("/") + "/"):
            return ""
        if not path.startswith(self.prefix + "/"):
            raise ValueError(f"{path}: outside the job's Ray Train storage {self.prefix}")
        rel = path[len(self.prefix) + 1 :]
        return None if rel == MARKER else rel

    def _local_path(self, path: str) -> str:
        rel = self._rel(path)
        if rel is None:  # written by the controller: kept nowhere, answered as there
            return os.devnull
        return str(self.directory / rel) if rel else str(self.directory)

    def _theirs(self, local: str) -> str:
        rel = os.path.relpath(local, self.directory)
        return self.prefix if rel == "." else f"{self.prefix}/{Path(rel).as_posix()}"

    def _info(self, path: str, local: pafs.FileInfo) -> pafs.FileInfo:
        size = local.size if local.type == pafs.FileType.File else None
        return pafs.FileInfo(path, local.type, mtime=local.mtime, size=size)

    # --- FileSystemHandler ---------------------------------------------------------------------

    def get_type_name(self) -> str:
        return "orchestrator-node-checkpoints"

    def normalize_path(self, path: str) -> str:
        return path

    def equals(self, other: Any) -> bool:
        return self == other

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        infos = []
        for path in paths:
            if self._rel(path) is None:
                infos.append(pafs.FileInfo(path, pafs.FileType.File, size=0))
                continue
            (local,) = self._local.get_file_info([self._local_path(path)])
            infos.append(self._info(path, local))
        return infos

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        local = pafs.FileSelector(self._local_path(selector.base_dir),
                                  allow_not_found=selector.allow_not_found,
                                  recursive=selector.recursive)  # fmt: skip
        return [self._info(self._theirs(i.path), i) for i in self._local.get_file_info(local)]

    def create_dir(self, path: str, recursive: bool) -> None:
        if self._rel(path) is not None:
            self._local.create_dir(self._local_path(path), recursive=recursive)

    def delete_dir(self, path: str) -> None:
        self._local.delete_dir(self._local_path(path))

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self._local.delete_dir_contents(self._local_path(path), missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        raise PermissionError("the job's checkpoint directory is not Train's to empty")

    def delete_file(self, path: str) -> None:
        if self._rel(path) is not None:
            self._local.delete_file(self._local_path(path))

    def move(self, src: str, dest: str) -> None:
        self._local.move(self._local_path(src), self._local_path(dest))

    def copy_file(self, src: str, dest: str) -> None:
        self._local.copy_file(self._local_path(src), self._local_path(dest))

    def open_input_stream(self, path: str) -> Any:
        return self._local.open_input_stream(self._local_path(path))

    def open_input_file(self, path: str) -> Any:
        return self._local.open_input_file(self._local_path(path))

    def open_output_stream(self, path: str, metadata: Any = None) -> Any:
        return self._local.open_output_stream(self._local_path(path), metadata=metadata)

    def open_append_stream(self, path: str, metadata: Any = None) -> Any:
        return self._local.open_append_stream(self._local_path(path), metadata=metadata)


def redirect(run_config: Any, job_id: str, group: str, checkpoint_path: str | None,
             attempt: int | None) -> str | None:  # fmt: skip
    """In the driver (on rank 0's node): point the script's RunConfig at the nodes' checkpoint
    directories (`NodeCheckpointDirs`), before anything of Train has read it. What the script
    had asked for, when it was not Train's default, for the job's log."""
    from ray.train.constants import DEFAULT_STORAGE_PATH

    asked = None
    if run_config.storage_filesystem is not None or run_config.storage_path != DEFAULT_STORAGE_PATH:
        asked = str(run_config.storage_path)
    handler = NodeCheckpointDirs(job_id, group, run_config.name, checkpoint_path, "", attempt)
    handler.driver_dir = str(handler.rank_dir(0))
    run_config.storage_path = PREFIX
    run_config.storage_filesystem = pafs.PyFileSystem(handler)
    run_config.__dict__.pop("storage_context", None)  # a cached StorageContext of the old path
    return asked

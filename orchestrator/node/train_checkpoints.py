"""A Ray Train job's checkpoints on a node: what the uploader does with Train's directories that
no other job's need (agents/checkpoint_uploader.py calls these).

Train writes a checkpoint's parts into `checkpoint_<date>/` on each node whose workers saved
one; it is complete once Train commits it (every worker reported the round), which the node's
uploader is told and marks on disk. Before a retry every node gets the other nodes' parts of
the checkpoint it resumes from, and the driver's node Train's run snapshot naming it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from orchestrator.storage.checkpoints import CheckpointStore, Manifest
from orchestrator.storage.local_checkpoint import COMPLETE_MARKER

SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's run snapshot, at the top


def mark_committed(local_dir: Path, name: str, parts: list[int]) -> bool:
    """Mark this node's part of `name` complete, the marker holding the nodes with a part (for
    its manifest: a retry knows it whole from the store alone); False when the node has none."""
    directory = local_dir / name
    if "/" in name or not directory.is_dir():
        return False
    (directory / COMPLETE_MARKER).write_text(json.dumps({"ray_train_parts": parts}))
    return True


def committed_parts(directory: Path) -> list[int] | None:
    """The nodes with a part of the checkpoint in `directory`, if Train committed it here."""
    try:
        parts = json.loads((directory / COMPLETE_MARKER).read_text())["ray_train_parts"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return [int(p) for p in parts]


def merge_parts(store: CheckpointStore, local_dir: Path, parts: list[Manifest]) -> None:
    """Other nodes' parts of one checkpoint put in beside this node's: the files it lacks."""
    target = local_dir / parts[0].name
    for part in parts:
        missing = [f for f in part.files if not _same_size(target / f.path, f.size)]
        if missing:
            store.download(part.model_copy(update={"files": missing}), target)


def write_snapshot(local_dir: Path, text: str, attempt: int) -> str | None:
    """Train's run snapshot as the resume point says ("": none, the run starts over); what was
    done, for the job's log."""
    path = local_dir / SNAPSHOT
    if not text:
        if not path.exists():
            return None
        path.unlink()
        return f"Ray Train's {SNAPSHOT} removed: attempt {attempt} starts over"
    local_dir.mkdir(parents=True, exist_ok=True)
    tmp = local_dir / f".{SNAPSHOT}.tmp"
    tmp.write_text(text)
    os.replace(tmp, path)
    return (f"Ray Train's {SNAPSHOT} written for attempt {attempt}: ray.train.get_checkpoint() "
            "returns the resume point")  # fmt: skip


def _same_size(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except FileNotFoundError:
        return False

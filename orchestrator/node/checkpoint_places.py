"""Where each checkpoint of a rank's `$BT_CHECKPOINT_DIR` lies on its node: a directory under its
own name, or the regular files at the top, which are one checkpoint together (TOP_LEVEL, another
name only where a directory there already has that one). Every place the uploader reads, moves,
deletes or restores a checkpoint by name asks here, so the top-level one is handled in one spot.
docs/architecture.md#the-checkpoint-uploader states the rule.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from orchestrator.node.checkpoint_rules import EntryKind, top_level
from orchestrator.storage.local_checkpoint import (
    COMPLETE_MARKER,
    TOP_LEVEL,
    LocalFile,
    Snapshot,
    snapshot,
    top_level_name,
    top_snapshot,
)


class CheckpointPlaces:
    """The checkpoints of one directory by name; `top` is the top-level files' name."""

    def __init__(self, local_dir: Path, temporary: Iterable[str]) -> None:
        self.local_dir, self.temporary = local_dir, tuple(temporary)
        self.top = TOP_LEVEL
        self._kept: Path | None = None

    def choose(self, kept: Path, say: Callable[[str], None]) -> None:
        """Name the top-level files for the job: the name kept in `kept` (by an uploader before
        this one on the node), else TOP_LEVEL unless an entry of the directory has it now (the
        listing the node agent named an earlier job's top-level files from, before the job)."""
        self._kept = kept
        with contextlib.suppress(FileNotFoundError):
            self.top = kept.read_text().strip() or TOP_LEVEL
            return
        entries = top_level(self.local_dir, self.temporary)
        self.adopt(top_level_name(n for n, k in entries.items() if k != EntryKind.FILE))
        if self.top != TOP_LEVEL:
            say(f"the files at the top of $BT_CHECKPOINT_DIR are checkpoint {self.top} in this "
                f"job: a directory there is named {TOP_LEVEL}")  # fmt: skip

    def adopt(self, name: str) -> None:
        """Give the top-level files `name` from now on (a restored copy's), and keep it."""
        self.top = name
        if self._kept is not None:
            with contextlib.suppress(OSError):
                self._kept.write_text(name)

    def is_top(self, name: str) -> bool:
        return name == self.top

    def kinds(self, entries: dict[str, EntryKind]) -> dict[str, EntryKind]:
        """`entries` with a directory that has the top-level files' name marked TAKEN."""
        if entries.get(self.top) == EntryKind.CHECKPOINT:
            return {**entries, self.top: EntryKind.TAKEN}
        return entries

    def checkpoints(self, entries: dict[str, EntryKind]) -> list[str]:
        """The checkpoints a listing (`kinds`'s) shows: each directory, and the top-level files'
        when there is one."""
        names = [n for n, k in entries.items() if k == EntryKind.CHECKPOINT]
        if EntryKind.FILE in entries.values():
            names.append(self.top)
        return sorted(names)

    def owner(self, path: str) -> str | None:
        """The checkpoint a path under the directory belongs to (a file at the top: `top`)."""
        top = f"{os.path.realpath(self.local_dir)}{os.sep}"
        if not path.startswith(top):
            return None
        first, sep, _ = path[len(top) :].partition(os.sep)
        return first if sep else self.top

    def snapshot(self, name: str) -> Snapshot:
        """Its files as they are now; FileNotFoundError if it is gone."""
        if self.is_top(name):
            return top_snapshot(self.local_dir, self.temporary)
        return snapshot(self.local_dir / name)

    def exists(self, name: str) -> bool:
        if not self.is_top(name):
            return (self.local_dir / name).is_dir()
        try:
            return bool(self.snapshot(name).files)
        except FileNotFoundError:
            return False

    def restore_target(self, name: str, top_level: bool) -> Path:
        """Where a stored copy is downloaded: the directory itself for top-level files."""
        if top_level:
            self.adopt(name)
            return self.local_dir
        return self.local_dir / name

    def move(self, name: str, place: Path) -> None:
        """Move the checkpoint to `place` (a directory made for it: the top-level files go in)."""
        if not self.is_top(name):
            place.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(self.local_dir / name, place)
            return
        place.mkdir(parents=True, exist_ok=True)
        for f in self._files_and_marker():
            shutil.move(f, place / os.path.basename(f))

    def remove(self, name: str, uploaded: Snapshot) -> None:
        """Delete the local copy of what was uploaded (delete_local): a directory whole; of the
        top-level files, those still as uploaded (one written since is not stored yet)."""
        if not self.is_top(name):
            shutil.rmtree(self.local_dir / name, ignore_errors=True)
            return
        for f in uploaded.files:
            if _unchanged(f):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(f.path)

    def _files_and_marker(self) -> list[str]:
        files = [f.path for f in top_snapshot(self.local_dir, self.temporary).files]
        marker = self.local_dir / COMPLETE_MARKER
        return [*files, str(marker)] if marker.is_file() else files


def _unchanged(f: LocalFile) -> bool:
    try:
        st = os.stat(f.path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (st.st_size, st.st_mtime_ns, st.st_ino) == f.stamp

"""What a checkpoint directory on a node is made of: its files, as one consistent snapshot.

A snapshot lists every regular file under the directory with the size, mtime and inode it had
when it was seen, so an upload can tell a file that changed underneath it. Symbolic links are
judged here, once: a link to a file inside the checkpoint stands for that file; any other link
(pointing outside, to a directory, or nowhere) is skipped with the reason, never followed.
The completion marker is noted and left out of the files.

The regular files directly in `$BT_CHECKPOINT_DIR` (nanoGPT's `ckpt.pt`, `save_pretrained` into
it) are one checkpoint of their own, named TOP_LEVEL: `top_snapshot` is theirs.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# Written last by a script that wants its checkpoint uploaded at once (mark_checkpoint_complete).
COMPLETE_MARKER = ".orchestrator-complete"
# In a rank's job directory on its node: what its checkpoint directory held before the job.
EARLIER_CHECKPOINTS = "checkpoints-before.json"
# Beside it: the name the uploader gave the top-level files (a restarted one gives the same).
TOP_LEVEL_NAME = "top-level-name"
# The checkpoint made of the files at the top of $BT_CHECKPOINT_DIR (another name only where a
# directory there has this one: top_level_name).
TOP_LEVEL = "top-level"
_TOP_LEVEL_ELSE = ("top-level-files", "files-at-the-top")


def top_level_name(taken: Iterable[str]) -> str:
    """The name for the top-level files' checkpoint that no entry in `taken` (the directory's
    other entries) has."""
    taken = set(taken)
    for name in (TOP_LEVEL, *_TOP_LEVEL_ELSE):
        if name not in taken:
            return name
    return next(f"top-level-files-{n}" for n in range(2, len(taken) + 3)
                if f"top-level-files-{n}" not in taken)  # fmt: skip


@dataclass(frozen=True)
class LocalFile:
    rel: str  # posix path inside the checkpoint, as stored
    path: str  # what is read: the file itself, or the file a link inside the checkpoint names
    size: int
    mtime_ns: int
    ino: int

    @property
    def stamp(self) -> tuple[int, int, int]:
        return self.size, self.mtime_ns, self.ino


@dataclass(frozen=True)
class Snapshot:
    dir_ino: int
    files: tuple[LocalFile, ...]
    skipped_links: tuple[tuple[str, str], ...] = ()  # (rel, why)
    marker_ns: int | None = None  # the completion marker's mtime, if it is there

    @property
    def fingerprint(self) -> str:
        """Equal fingerprints: nothing was written, replaced, added or removed in between."""
        digest = hashlib.sha256(str(self.dir_ino).encode())
        for f in self.files:
            digest.update(f"\0{f.rel}\0{f.size}\0{f.mtime_ns}\0{f.ino}".encode())
        digest.update(f"\0{self.marker_ns}".encode())
        return digest.hexdigest()[:32]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def newest_ns(self) -> int:
        return max((f.mtime_ns for f in self.files), default=0)

    @property
    def marked_complete(self) -> bool:
        """The marker is there and no file was written after it."""
        return self.marker_ns is not None and bool(self.files) and self.marker_ns >= self.newest_ns

    def names(self) -> set[str]:
        return {f.rel for f in self.files}


def mark_checkpoint_complete(directory: str | os.PathLike[str]) -> Path:
    """Say a checkpoint directory under `$BT_CHECKPOINT_DIR` is whole (or, given
    `$BT_CHECKPOINT_DIR` itself, the files at its top): its upload starts now, with no settle
    wait. Call it after its last file is written and closed.

    It writes the marker file `.orchestrator-complete` (never uploaded). A file written into
    the checkpoint after it makes the checkpoint incomplete again until it is marked anew.
    """
    marker = Path(directory) / COMPLETE_MARKER
    marker.write_bytes(b"")
    return marker


def snapshot(directory: Path) -> Snapshot:
    """Walk `directory` without following links. Raises FileNotFoundError if it is gone.

    Entries that vanish during the walk are left out: the next snapshot differs, which is
    what a caller waiting for the directory to settle needs to know.
    """
    top = os.stat(directory, follow_symlinks=False)
    real_top = os.path.realpath(directory)
    files: list[LocalFile] = []
    links: list[tuple[str, str]] = []
    marker_ns = None
    pending = [(str(directory), "")]
    while pending:
        path, prefix = pending.pop()
        try:
            entries = list(os.scandir(path))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            rel = f"{prefix}{entry.name}"
            try:
                if entry.is_symlink():
                    linked = _linked_file(entry.path, rel, real_top)
                    if isinstance(linked, LocalFile):
                        files.append(linked)
                    else:
                        links.append((rel, linked))
                elif entry.is_dir(follow_symlinks=False):
                    pending.append((entry.path, f"{rel}/"))
                elif entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    if rel == COMPLETE_MARKER:
                        marker_ns = st.st_mtime_ns
                        continue
                    files.append(LocalFile(rel, entry.path, st.st_size, st.st_mtime_ns, st.st_ino))
            except FileNotFoundError:
                continue
    files.sort(key=lambda f: f.rel)
    return Snapshot(top.st_ino, tuple(files), tuple(sorted(links)), marker_ns)


def top_snapshot(directory: Path, temporary: Iterable[str] = ()) -> Snapshot:
    """The regular files directly in `directory` (hidden ones too: torch.distributed.checkpoint's
    `.metadata`), not links and not names matching `temporary`; rel is the file's name.
    Raises FileNotFoundError if `directory` is gone."""
    top = os.stat(directory, follow_symlinks=False)
    patterns = tuple(temporary)
    files: list[LocalFile] = []
    marker_ns = None
    for entry in os.scandir(directory):
        if any(fnmatch.fnmatchcase(entry.name, p) for p in patterns):
            continue
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if entry.name == COMPLETE_MARKER:
            marker_ns = st.st_mtime_ns
        else:
            files.append(LocalFile(entry.name, entry.path, st.st_size, st.st_mtime_ns, st.st_ino))
    files.sort(key=lambda f: f.rel)
    return Snapshot(top.st_ino, tuple(files), (), marker_ns)


def _linked_file(path: str, rel: str, real_top: str) -> LocalFile | str:
    """The file a link inside the checkpoint stands for, or why the link is skipped."""
    target = os.path.realpath(path)
    if not target.startswith(real_top + os.sep):
        return f"it points outside the checkpoint ({os.readlink(path)})"
    try:
        st = os.stat(target)
    except FileNotFoundError:
        return f"it points nowhere ({os.readlink(path)})"
    if not Path(target).is_file():
        return "it points to a directory (its files are uploaded under their own path)"
    return LocalFile(rel, target, st.st_size, st.st_mtime_ns, st.st_ino)

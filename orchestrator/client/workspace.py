"""Packages a job's code directory into the tar archive that is uploaded to the nodes.

Follows truss_train's workspace rules (root, external dirs, exclude dirs, `.truss_ignore`) and
refuses archives over a size cap, because large data belongs in weights or the training cache.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tarfile
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from pathspec import GitIgnoreSpec

from orchestrator import settings
from orchestrator.errors import WorkspaceError
from orchestrator.spec.workspace import Workspace

MAX_ARCHIVE_BYTES_ENV = settings.MAX_ARCHIVE_BYTES.name
IGNORE_FILE = ".truss_ignore"
# Used only when a tree has no `.truss_ignore`; `.env` is here because it usually holds secrets.
DEFAULT_IGNORE_PATTERNS = (
    ".git/", ".hg/", ".svn/", "__pycache__/", "*.pyc", "*.pyo", ".venv/", "venv/", "*.egg-info/",
    ".pytest_cache/", ".mypy_cache/", ".ruff_cache/", ".tox/", ".nox/", ".cache/",
    ".ipynb_checkpoints/", "*.log", ".DS_Store", ".env", "node_modules/", "wandb/",
)  # fmt: skip
_DEFAULT_SPEC = GitIgnoreSpec.from_lines(DEFAULT_IGNORE_PATTERNS)
_COPY_BUFSIZE = 1024 * 1024


@dataclass(frozen=True)
class WorkspaceFile:
    """One archive entry: a regular file, or a symlink kept as a relative link."""

    source: Path
    arcname: str
    size: int
    link_target: str | None = None


@dataclass(frozen=True)
class WorkspacePlan:
    """Everything that will go into the archive, decided before any byte is written."""

    root: Path
    config_relpath: str
    files: tuple[WorkspaceFile, ...]
    skipped: tuple[str, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def file_count(self) -> int:
        return len(self.files)


@dataclass(frozen=True)
class ArchiveInfo:
    """A written archive; `sha256` lets the nodes check what they downloaded."""

    path: Path
    size_bytes: int
    file_count: int
    sha256: str


def plan_workspace(
    source_dir: Path, workspace: Workspace | None = None, *, max_bytes: int | None = None
) -> WorkspacePlan:
    """Decide which files to upload for a config living in `source_dir`.

    Raises WorkspaceError for a misconfigured `Workspace` or a workspace over the size cap
    (`max_bytes`, else $ORCHESTRATOR_MAX_ARCHIVE_BYTES, else 5 GiB).
    """
    workspace = workspace or Workspace()
    source_dir = Path(source_dir).resolve()
    if not source_dir.is_dir():
        raise WorkspaceError(f"config directory {source_dir} does not exist or is not a directory")
    root = _resolve_root(source_dir, workspace.workspace_root)
    skipped: list[str] = []
    excluded = _excluded_names(source_dir, root, workspace.exclude_dirs, skipped)
    files = _Tree(root, "", skipped).walk(excluded)
    taken = {f.arcname.split("/", 1)[0] for f in files}
    for ext in _external_dirs(source_dir, root, workspace.external_dirs, skipped):
        if ext.name in taken:
            raise WorkspaceError(
                f"external dir {ext} would be added as {ext.name}/, which the workspace has",
                [f"rename one of them, or list the existing {ext.name!r} in exclude_dirs"],
            )
        taken.add(ext.name)
        files += _Tree(ext, ext.name + "/", skipped).walk()
    config_relpath = source_dir.relative_to(root).as_posix()
    files.sort(key=lambda f: f.arcname)
    plan = WorkspacePlan(root, config_relpath, tuple(files), tuple(skipped))
    _check_size(plan, _max_bytes(max_bytes))
    return plan


def write_archive(plan: WorkspacePlan, dest: Path) -> ArchiveInfo:
    """Write `plan` as an uncompressed, reproducible tar at `dest`, atomically."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as raw:
            out = _HashingWriter(raw)
            with tarfile.TarFile(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
                tar.copybufsize = _COPY_BUFSIZE
                for entry in plan.files:
                    _add_entry(tar, entry)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return ArchiveInfo(dest, out.size, plan.file_count, out.sha256.hexdigest())


def _resolve_root(source_dir: Path, workspace_root: str | None) -> Path:
    if not workspace_root:
        return source_dir
    root = (source_dir / workspace_root).resolve()
    if not root.is_dir():
        raise WorkspaceError(f"workspace_root {workspace_root!r} ({root}) is not a directory")
    if not source_dir.is_relative_to(root):
        raise WorkspaceError(
            f"config directory {source_dir} is not inside workspace_root {root}",
            ["workspace_root must be the config's directory or one of its parents"],
        )
    return root


def _excluded_names(
    source_dir: Path, root: Path, exclude_dirs: list[str], skipped: list[str]
) -> frozenset[str]:
    names = set()
    for entry in exclude_dirs:
        # normpath, not resolve: excluding a top-level symlink must not chase its target.
        path = Path(os.path.normpath(source_dir / entry))
        if path.parent != root:
            raise WorkspaceError(
                f"exclude_dirs entry {entry!r} ({path}) is not a direct child of {root}",
                ["only top-level directories of the workspace can be excluded; use a "
                 f"{IGNORE_FILE} file in {root} for deeper paths"],
            )  # fmt: skip
        if not os.path.lexists(path):
            skipped.append(f"exclude_dirs entry {entry!r}: {path} does not exist")
        names.add(path.name)
    return frozenset(names)


def _external_dirs(
    source_dir: Path, root: Path, external_dirs: list[str], skipped: list[str]
) -> list[Path]:
    dirs: list[Path] = []
    for entry in external_dirs:
        path = (source_dir / entry).resolve()
        if not path.is_dir():
            raise WorkspaceError(f"external_dirs entry {entry!r} ({path}) is not a directory")
        if path.is_relative_to(root):
            skipped.append(
                f"external_dirs entry {entry!r} is inside the workspace; already included"
            )
        elif root.is_relative_to(path):
            raise WorkspaceError(f"external_dirs entry {entry!r} ({path}) contains the workspace")
        elif path not in dirs:
            dirs.append(path)
    return dirs


class _Tree:
    """One directory tree (the root or an external dir) walked under its own ignore rules."""

    def __init__(self, path: Path, prefix: str, skipped: list[str]) -> None:
        self.path, self.prefix, self.skipped = path, prefix, skipped
        ignore_file = path / IGNORE_FILE  # replaces the defaults entirely, as in truss_train
        self.spec = (
            GitIgnoreSpec.from_lines(ignore_file.read_text(encoding="utf-8").splitlines())
            if ignore_file.is_file()
            else _DEFAULT_SPEC
        )

    def walk(self, excluded: frozenset[str] = frozenset()) -> list[WorkspaceFile]:
        """Kept files; ignored directories are pruned and directory symlinks never followed."""
        files: list[WorkspaceFile] = []
        kept: set[str] = set()  # relpaths of walked dirs and kept files: what a link may target
        links: list[tuple[str, str]] = []
        stack = [""]
        while stack:
            rel_dir = stack.pop()
            try:
                with os.scandir(self.path / rel_dir) as it:
                    entries = list(it)
            except OSError as exc:
                raise WorkspaceError(
                    f"cannot read {self.path / rel_dir}: {exc}",
                    [f"fix its permissions or list it in {IGNORE_FILE}"],
                ) from exc
            venv = self.spec is _DEFAULT_SPEC and any(e.name == "pyvenv.cfg" for e in entries)
            if rel_dir and venv:
                self._note(rel_dir + "/", "a virtualenv (has pyvenv.cfg), not uploaded")
                continue
            kept.add(rel_dir)
            for e in entries:
                rel = f"{rel_dir}/{e.name}" if rel_dir else e.name
                if not rel_dir and e.name in excluded:
                    continue
                if e.is_symlink():
                    links.append((rel, e.path))
                elif e.is_dir(follow_symlinks=False):
                    if not self.spec.match_file(rel + "/"):
                        stack.append(rel)
                elif e.is_file(follow_symlinks=False):
                    if not self.spec.match_file(rel):
                        size = e.stat(follow_symlinks=False).st_size
                        files.append(WorkspaceFile(Path(e.path), self.prefix + rel, size))
                        kept.add(rel)
                else:
                    self._note(rel, "not a regular file, directory or symlink")
        files += filter(None, (self._link(rel, Path(p), kept) for rel, p in links))
        return files

    def _link(self, rel: str, path: Path, kept: set[str]) -> WorkspaceFile | None:
        """A link within the tree stays a link, one to a file outside is copied, else noted."""
        target = Path(os.path.realpath(path))  # not Path.resolve: it raises on loops before 3.13
        if not target.exists():
            return self._note(rel, "broken symlink (missing target or a loop)")
        is_dir = target.is_dir()
        if self.spec.match_file(rel + "/" if is_dir else rel):
            return None
        if not target.is_relative_to(self.path):
            if not is_dir:
                return WorkspaceFile(target, self.prefix + rel, target.stat().st_size)
            return self._note(
                rel, f"symlink to directory {target} outside the workspace; add it to "
                "Workspace.external_dirs to upload it",
            )  # fmt: skip
        target_rel = "" if target == self.path else target.relative_to(self.path).as_posix()
        if target_rel not in kept:  # it would dangle on the nodes
            return self._note(rel, f"symlink to {target_rel or '.'}, which is not uploaded")
        link = Path(os.path.relpath(target, path.parent)).as_posix()
        return WorkspaceFile(path, self.prefix + rel, 0, link)

    def _note(self, rel: str, why: str) -> None:
        self.skipped.append(f"{self.prefix}{rel}: {why}")


def _max_bytes(explicit: int | None) -> int:
    if explicit is not None:
        return explicit
    return settings.MAX_ARCHIVE_BYTES.get()


def _check_size(plan: WorkspacePlan, max_bytes: int) -> None:
    total = plan.total_bytes
    if total <= max_bytes:
        return
    by_entry: Counter[str] = Counter()
    for f in plan.files:
        top, sep, _ = f.arcname.partition("/")
        by_entry[top + sep] += f.size
    largest = [f"{name} {_human(size)}" for name, size in by_entry.most_common(5)]
    raise WorkspaceError(
        f"workspace {plan.root} is {_human(total)}, over the {_human(max_bytes)} limit "
        f"({MAX_ARCHIVE_BYTES_ENV}); its largest entries:",
        [
            *largest,
            f"exclude what the job does not need: list it in {plan.root / IGNORE_FILE} "
            "(gitignore syntax; it replaces the default ignore rules) or in "
            "Workspace.exclude_dirs; large data belongs in `weights` (s3://, gs://, hf://) "
            "or the training cache, not the workspace",
        ],
    )


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _add_entry(tar: tarfile.TarFile, entry: WorkspaceFile) -> None:
    # Owner fields stay at TarInfo's zero defaults so the archive does not depend on who built it.
    info = tarfile.TarInfo(entry.arcname)
    if entry.link_target is not None:
        info.type, info.linkname, info.mode = tarfile.SYMTYPE, entry.link_target, 0o777
        tar.addfile(info)
        return
    try:
        with open(entry.source, "rb") as src:
            st = os.fstat(src.fileno())
            info.size, info.mtime = st.st_size, int(st.st_mtime)
            info.mode = stat.S_IMODE(st.st_mode)  # keeps run.sh executable on the nodes
            tar.addfile(info, src)
    except OSError as exc:
        raise WorkspaceError(
            f"cannot archive {entry.source}: {exc}",
            ["was it changed or removed while packaging? re-run, or exclude it"],
        ) from exc


class _HashingWriter:
    """The tar's file object: hashes and counts bytes on their way to disk."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self._raw.write(data)
        self.sha256.update(data)
        self.size += len(data)
        return len(data)

    def tell(self) -> int:
        return self.size

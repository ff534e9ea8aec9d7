"""The weight mirror's layout under the storage root: one immutable set per source revision.

weights/<key>/files/<path>     the selected files of the source, as the source names them
weights/<key>/manifest.json    WeightSet, written last: a set without one does not exist

The key covers what decides the content: the source (without its revision), the resolved revision
and the patterns. A new commit or a changed object gives a new key; nothing is ever overwritten.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import time

from pydantic import Field

from orchestrator import settings
from orchestrator.storage.root import StorageRoot
from orchestrator.storage.stored import Stored


class WeightFile(Stored):
    path: str  # relative, "/"-separated
    size: int


class WeightSet(Stored):
    """A mirrored source: exactly these files, committed at `created_at`."""

    key: str
    source: str
    revision: str
    allow_patterns: list[str] | None = None
    ignore_patterns: list[str] | None = None
    files: list[WeightFile]
    created_at: float = Field(default_factory=time.time)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def set_key(source: str, revision: str, allow: list[str] | None, ignore: list[str] | None) -> str:
    ident = json.dumps([source, revision, allow, ignore])
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


def select(paths: list[str], allow: list[str] | None, ignore: list[str] | None) -> list[str]:
    """The paths `allow` keeps and `ignore` does not drop, as huggingface_hub filters them.

    A pattern ending in "/" means everything below that directory.
    """

    def expand(patterns: list[str] | None) -> list[str] | None:
        if patterns is None:
            return None
        return [p + "*" if p.endswith("/") else p for p in patterns]

    allow_, ignore_ = expand(allow), expand(ignore)
    return [
        p
        for p in paths
        if (allow_ is None or any(fnmatch.fnmatch(p, a) for a in allow_))
        and not (ignore_ and any(fnmatch.fnmatch(p, i) for i in ignore_))
    ]


CONCURRENCY_ENV = settings.WEIGHTS_CONCURRENCY.name


def copy_concurrency() -> int:
    """Files of a set copied at once (by the mirror, and by a node filling its cache)."""
    return settings.WEIGHTS_CONCURRENCY.get()


def set_dir(key: str) -> str:
    return f"weights/{key}"


def file_path(key: str, path: str) -> str:
    return f"weights/{key}/files/{path}"


def manifest_path(key: str) -> str:
    return f"weights/{key}/manifest.json"


class MirrorStore:
    """Reads and commits weight sets in a storage root."""

    def __init__(self, root: StorageRoot) -> None:
        self.root = root

    def manifest(self, key: str) -> WeightSet | None:
        try:
            return WeightSet.model_validate(self.root.read_json(manifest_path(key)))
        except FileNotFoundError:
            return None

    def commit(self, weight_set: WeightSet) -> None:
        self.root.write_json(manifest_path(weight_set.key), weight_set.model_dump(mode="json"))

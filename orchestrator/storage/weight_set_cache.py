"""Complete weight sets on a local (or shared) disk under a byte budget, least recently used out.

<dir>/<key>/files/...   one set, read-only once complete
<dir>/index.json        {key: {bytes, last_used, holders, pending}}: what is here (or being
                        filled), when it was last asked for, and who is using it now (a set in
                        use is never evicted)
<dir>/.lock             taken (flock) around every index change

Several processes may share a directory (simulated nodes on one machine, a restarted node cache
actor, the nodes of a cluster over a shared filesystem): sets appear by rename, so a reader sees
a whole set or none, and two fills of one key keep the first.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INDEX = "index.json"


@dataclass(frozen=True)
class Put:
    path: Path
    evicted: list[str]  # keys removed to make room
    over_budget: bool  # the budget could not be met: every other set is in use


class WeightSetCache:
    def __init__(self, directory: Path, budget_bytes: int) -> None:
        self.directory = directory
        self.budget_bytes = budget_bytes
        directory.mkdir(parents=True, exist_ok=True)

    def files(self, key: str) -> Path:
        return self.directory / key / "files"

    def get(self, key: str, holder: str) -> Path | None:
        """The set's files if it is here (marking it used, and in use by `holder`)."""
        with self._index() as index:
            entry = index.get(key)
            if entry is None or entry.get("pending"):
                return None
            if not self.files(key).is_dir():
                del index[key]
                return None
            entry["last_used"] = time.time()
            if holder not in entry["holders"]:
                entry["holders"].append(holder)
        return self.files(key)

    def put(
        self,
        key: str,
        size: int,
        fill: Callable[[Path], None],
        holder: str,
        alive: Callable[[str], bool] = lambda _: True,
    ) -> Put:
        """Make room for `size` bytes, let `fill` write the set into a fresh directory, add it.

        The room is reserved (a pending entry) while `fill` runs, so fills running at once do
        not all count on the same free space. Holders for which `alive` is false no longer
        protect their sets (nor a crashed fill its reservation).
        """
        with self._index() as index:
            evicted, over = self._make_room(index, size, alive)
            reserved = key not in index
            if reserved:
                index[key] = {"bytes": size, "last_used": time.time(), "holders": [holder],
                              "pending": True}  # fmt: skip
        staging = self.directory / f".{key}.{uuid.uuid4().hex[:8]}.partial"
        try:
            fill(staging / "files")
            _read_only(staging / "files")
            with self._index() as index:
                entry = index.get(key)
                if entry is not None and not entry.get("pending") and self.files(key).is_dir():
                    _remove(staging)  # another process filled it meanwhile
                else:
                    _remove(self.directory / key)
                    os.replace(staging, self.directory / key)
                    entry = index[key] = {"bytes": size, "holders": []}
                entry["last_used"] = time.time()
                if holder not in entry["holders"]:
                    entry["holders"].append(holder)
        except BaseException:
            with self._index() as index:
                if reserved and index.get(key, {}).get("pending"):
                    del index[key]
            raise
        finally:
            if staging.exists():
                _remove(staging)
        return Put(self.files(key), evicted, over)

    def release(self, holder: str) -> None:
        with self._index() as index:
            for entry in index.values():
                if holder in entry["holders"]:
                    entry["holders"].remove(holder)

    def usage(self) -> dict[str, Any]:
        with self._index() as index:
            return {
                "budget_bytes": self.budget_bytes,
                "used_bytes": sum(e["bytes"] for e in index.values()),
                "sets": {k: dict(e) for k, e in index.items()},
            }

    def _make_room(
        self, index: dict[str, Any], size: int, alive: Callable[[str], bool]
    ) -> tuple[list[str], bool]:
        used = sum(e["bytes"] for e in index.values())
        evicted: list[str] = []
        for key, entry in sorted(index.items(), key=lambda kv: kv[1]["last_used"]):
            if used + size <= self.budget_bytes:
                break
            entry["holders"] = [h for h in entry["holders"] if alive(h)]
            if entry["holders"]:
                continue
            _remove(self.directory / key)
            used -= entry["bytes"]
            evicted.append(key)
        for key in evicted:
            del index[key]
        return evicted, used + size > self.budget_bytes

    @contextlib.contextmanager
    def _index(self) -> Iterator[dict[str, Any]]:
        """The index, read and written back under an exclusive lock."""
        with open(self.directory / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            path = self.directory / INDEX
            try:
                index = json.loads(path.read_text())
            except (FileNotFoundError, ValueError):
                index = {}
            yield index
            tmp = path.with_name(f".{INDEX}.{uuid.uuid4().hex[:8]}")
            tmp.write_text(json.dumps(index))
            os.replace(tmp, path)


def _read_only(root: Path) -> None:
    """Files 0444 and directories 0555: an accidental write fails instead of spoiling the set."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o444)
    for dirpath, _, _ in os.walk(root, topdown=False):
        os.chmod(dirpath, 0o555)


def _remove(path: Path) -> None:
    if not path.exists():
        return
    for dirpath, _, _ in os.walk(path):
        with contextlib.suppress(OSError):
            os.chmod(dirpath, os.stat(dirpath).st_mode | stat.S_IWUSR | stat.S_IXUSR)
    shutil.rmtree(path, ignore_errors=True)

"""The checkpoint uploader: a Ray actor per node, a process apart from the training.

It watches the node's `$BT_CHECKPOINT_DIR` (every 0.1 s). Each top-level directory there is a
checkpoint; once it is unchanged between two scans and its newest write is `settle_s` old (or
when the job ends) it is uploaded through fsspec and committed by its manifest. One rewritten in
place after that is uploaded again. Training never waits on it: it only ever reads the files.
Directories whose names start with '.' are skipped (write there, then rename into place).
A restarted uploader skips checkpoints whose manifest exists and redoes the others.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

from orchestrator.storage.checkpoints import CheckpointStore, UploadSettings
from orchestrator.storage.root import StorageRoot

SCAN_S = 0.1
RECHECK_S = 2.0  # how often the volume size and uploaded checkpoints are checked again
WARN_FRACTION = 0.9


class CheckpointUploader:
    def __init__(
        self,
        project: str,
        job_id: str,
        rank: int,
        storage_root: str,
        local_dir: str,
        settings: dict[str, Any],
        volume_size_gib: int | None = None,
        not_before: float = 0.0,
    ) -> None:
        self.project, self.job_id, self.rank = project, job_id, rank
        self.store = CheckpointStore(StorageRoot(storage_root))
        self.local_dir = Path(local_dir)
        self.settings = UploadSettings.model_validate(settings)
        self.volume_bytes = volume_size_gib * 2**30 if volume_size_gib else None
        # A reused checkpoint_path may hold an earlier job's checkpoints: not this job's to upload.
        self.not_before_ns = int(not_before * 1e9)
        self.stale: set[str] = set()
        self.uploaded: dict[str, float] = {}  # name -> seconds the upload took
        self.failed: dict[str, str] = {}
        self.events: list[str] = []
        self.over_volume: str | None = None
        self._warned = False
        self._seen: dict[str, tuple[tuple[int, int, int], float]] = {}
        # What an uploaded checkpoint looked like, so one rewritten in place is uploaded again.
        self._marks: dict[str, tuple[int, int, int]] = {}
        self._last_recheck = 0.0
        self._lock = threading.Lock()  # one scan (and upload) at a time
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    # --- called by the controller ------------------------------------------------------------

    def poll(self, since: int) -> dict[str, Any]:
        """Events after index `since`, and whether the directory is over its volume size."""
        if since > len(self.events):  # a restarted uploader starts a new list
            since = 0
        return {"events": self.events[since:], "next": len(self.events),
                "over_volume": self.over_volume}  # fmt: skip

    def flush(self, timeout: float | None = None) -> dict[str, Any]:
        """Upload everything still local (the job has ended), within `timeout` seconds."""
        self._stop.set()
        self._thread.join(timeout=5)
        deadline = time.monotonic() + (timeout or self.settings.flush_timeout_s)
        self._scan(final=True, deadline=deadline)
        pending = [
            n
            for n in self._local_checkpoints()
            if n not in self.uploaded and n not in self.failed and n not in self.stale
        ]
        return {"uploaded": sorted(self.uploaded), "pending": pending, "failed": self.failed,
                "events": self.events}  # fmt: skip

    # --- the watch loop ----------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(SCAN_S):
            try:
                self._scan(final=False)
            except Exception as e:  # keep watching; the final flush reports what is left
                self._event(f"checkpoint scan failed: {type(e).__name__}: {e}")

    def _local_checkpoints(self) -> list[str]:
        if not self.local_dir.is_dir():
            return []
        return sorted(
            p.name for p in self.local_dir.iterdir() if p.is_dir() and not p.name.startswith(".")
        )

    def _scan(self, final: bool, deadline: float | None = None) -> None:
        with self._lock:
            now = time.monotonic()
            # Walking every file is for the slower checks: sizes and in-place rewrites.
            recheck = final or now - self._last_recheck >= RECHECK_S
            if recheck:
                self._last_recheck = now
                self._check_volume()
            for name in self._local_checkpoints():
                if name in self.stale or (not final and name in self.failed):
                    continue
                path = self.local_dir / name
                if name in self.uploaded and (
                    not recheck or self._marks.get(name) == _signature(path)
                ):
                    continue  # uploaded and untouched since (checked every RECHECK_S)
                if deadline is not None and time.monotonic() > deadline:
                    self._event(f"checkpoint flush deadline passed; {name} not uploaded")
                    return
                if (
                    name not in self._seen
                    and name not in self.uploaded
                    and self.store.is_uploaded(self.project, self.job_id, self.rank, name)
                ):
                    self.uploaded[name] = 0.0  # a restarted uploader: already committed
                    self._marks[name] = _signature(path)
                    continue
                signature = _signature(path)
                if signature[2] < self.not_before_ns:
                    self.stale.add(name)
                    self._event(f"skipping {name}: written before this job started")
                    continue
                previous = self._seen.get(name)
                self._seen[name] = (signature, now)
                quiet_s = time.time() - signature[2] / 1e9  # since its newest write
                settled = previous is not None and previous[0] == signature
                if final or (settled and quiet_s >= self.settings.settle_s):
                    self._upload(name)

    def _upload(self, name: str) -> None:
        start = time.monotonic()
        signature = _signature(self.local_dir / name)  # what is uploaded: a later change redoes it
        try:
            manifest = self.store.upload(
                self.local_dir / name, self.project, self.job_id, self.rank, self.settings
            )
        except Exception as e:
            self.failed[name] = f"{type(e).__name__}: {e}"
            self._event(f"checkpoint {name} upload failed: {self.failed[name]}")
            return
        took = time.monotonic() - start
        self.uploaded[name] = took
        self._marks[name] = signature
        self.failed.pop(name, None)
        size_mb = manifest.size_bytes / 1e6
        self._event(
            f"checkpoint {name} uploaded: {len(manifest.files)} files, {size_mb:.1f} MB "
            f"in {took:.1f} s"
        )
        if self.settings.delete_local:
            shutil.rmtree(self.local_dir / name, ignore_errors=True)

    def _check_volume(self) -> None:
        if self.volume_bytes is None or not self.local_dir.is_dir():
            return
        used = sum(p.stat().st_size for p in self.local_dir.rglob("*") if p.is_file())
        limit_gib = self.volume_bytes / 2**30
        if used > self.volume_bytes:
            self.over_volume = (
                f"checkpoint directory on rank {self.rank} holds {used / 2**30:.2f} GiB, over "
                f"volume_size_gib={limit_gib:g}: delete old checkpoints or raise volume_size_gib"
            )
        elif used > WARN_FRACTION * self.volume_bytes and not self._warned:
            self._warned = True
            self._event(
                f"warning: checkpoint directory uses {used / 2**30:.2f} GiB of "
                f"volume_size_gib={limit_gib:g}"
            )

    def _event(self, message: str) -> None:
        self.events.append(
            f"[rank {self.rank} {time.strftime('%H:%M:%S')}] [checkpoints] {message}"
        )


def _signature(path: Path) -> tuple[int, int, int]:
    """(files, bytes, newest mtime in ns): unchanged between scans means the writer is done."""
    files = size = newest = 0
    for p in path.rglob("*"):
        if p.is_file():
            st = p.stat()
            files, size, newest = files + 1, size + st.st_size, max(newest, st.st_mtime_ns)
    return files, size, newest

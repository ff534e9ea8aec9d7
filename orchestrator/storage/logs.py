"""Job logs as numbered segments: appendable on any store, readable after the cluster is gone."""

from __future__ import annotations

import threading
import time

from orchestrator.storage import layout
from orchestrator.storage.root import StorageRoot


class LogWriter:
    """Buffers tagged lines and writes them as a new segment at most every `interval` seconds."""

    def __init__(self, root: StorageRoot, job_id: str, interval: float = 0.25) -> None:
        self._root, self._job_id, self._interval = root, job_id, interval
        existing = root.list_names(layout.logs_dir(job_id))
        self._seq = max((int(n.split(".")[0]) for n in existing), default=-1) + 1
        self._buffer: list[str] = []
        self._lock = threading.Lock()
        self._last_flush = 0.0

    def write(self, lines: list[str]) -> None:
        with self._lock:
            self._buffer.extend(lines)
        if time.monotonic() - self._last_flush >= self._interval:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            if not self._buffer:
                return
            data = "".join(line + "\n" for line in self._buffer).encode()
            self._buffer.clear()
            seq, self._seq = self._seq, self._seq + 1
            self._last_flush = time.monotonic()
            self._root.write_bytes(layout.log_segment(self._job_id, seq), data)


def read_logs(root: StorageRoot, job_id: str, after: int = -1) -> tuple[list[str], int]:
    """Lines of the segments numbered above `after`, and the last segment number read."""
    names = [n for n in root.list_names(layout.logs_dir(job_id)) if n.endswith(".log")]
    lines: list[str] = []
    last = after
    for name in names:
        seq = int(name.split(".")[0])
        if seq <= after:
            continue
        lines += (
            root.read_bytes(layout.log_segment(job_id, seq)).decode(errors="replace").splitlines()
        )
        last = seq
    return lines, last

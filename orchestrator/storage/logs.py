"""Job logs as numbered segments: appendable on any store, readable after the cluster is gone."""

from __future__ import annotations

import threading
import time

from orchestrator.storage import layout
from orchestrator.storage.root import StorageRoot


class LogWriter:
    """Buffers tagged lines and writes them as a new segment at most every `interval` seconds.

    A background thread flushes what is buffered, so a line followed by silence still lands.
    """

    def __init__(self, root: StorageRoot, job_id: str, interval: float | None = None) -> None:
        self._root, self._job_id = root, job_id
        # Local writes are cheap, so lines land fast; on an object store each flush is a PUT.
        self._interval = interval if interval is not None else (0.05 if root.is_local else 0.5)
        existing = root.list_names(layout.logs_dir(job_id))
        self._seq = max((int(n.split(".")[0]) for n in existing if n.endswith(".log")), default=-1)
        self._seq += 1
        self._buffer: list[str] = []
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()  # segments are numbered and written in order
        self._last_flush = 0.0
        self._closed = threading.Event()
        self._flusher = threading.Thread(target=self._flush_periodically, daemon=True)
        self._flusher.start()

    def write(self, lines: list[str]) -> None:
        with self._lock:
            self._buffer.extend(lines)
        if time.monotonic() - self._last_flush >= self._interval:
            self.flush()

    def flush(self) -> None:
        with self._write_lock:
            with self._lock:
                if not self._buffer:
                    return
                data = "".join(line + "\n" for line in self._buffer).encode()
                self._buffer.clear()
                seq, self._seq = self._seq, self._seq + 1
                self._last_flush = time.monotonic()
            self._root.write_bytes(layout.log_segment(self._job_id, seq), data)

    def close(self) -> None:
        self._closed.set()
        self._flusher.join(timeout=5)
        self.flush()

    def _flush_periodically(self) -> None:
        while not self._closed.wait(self._interval):
            self.flush()


def read_logs(root: StorageRoot, job_id: str, after: int = -1) -> tuple[list[str], int]:
    """Lines of the segments numbered above `after`, and the last segment number read."""
    names = [n for n in root.list_names(layout.logs_dir(job_id)) if n.endswith(".log")]
    lines: list[str] = []
    last = after
    for name in names:
        seq = int(name.split(".")[0])
        if seq <= after:
            continue
        data = root.read_bytes(layout.log_segment(job_id, seq))
        lines += data.decode(errors="replace").splitlines()
        last = seq
    return lines, last

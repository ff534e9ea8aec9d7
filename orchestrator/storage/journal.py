"""What a controller stores as its job goes: log lines and status, in order, through outages.

One thread writes; callers never wait on storage. Lines become numbered segments (storage/logs.py)
and a status is written only after every line queued before it. While the storage root is
unreachable, lines wait (in memory up to MEMORY_BYTES, then in a spill file on this machine) and
the latest status waits; once it is back they are written in order, each line once. A segment is
retried with the same number and content until it is stored, so a reader never sees it twice.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from orchestrator.storage import layout
from orchestrator.storage.logs import next_segment
from orchestrator.storage.records import JobStatus
from orchestrator.storage.retry import describe
from orchestrator.storage.root import StorageRoot

MEMORY_BYTES = 8 * 2**20  # lines held in memory while storage is away; then the spill file
SEGMENT_BYTES = 4 * 2**20  # a backlog is stored as segments of at most this size
RETRY_PROBLEM_S = 30.0  # after a permanent error (or a spent outage budget): tried this often


class LineSpool:
    """Lines waiting to be stored, oldest first: in memory up to `memory_bytes`, then in a file.

    Thread-safe; one consumer (`pop`) and any number of producers (`add`).
    """

    def __init__(self, spill_path: Path, memory_bytes: int = MEMORY_BYTES) -> None:
        self.spill_path = spill_path
        self._memory_bytes = memory_bytes
        self._memory = bytearray()
        self._spilled = 0  # bytes in the spill file not yet popped
        self._offset = 0  # where the unpopped part of the spill file starts
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._memory) + self._spilled

    def add(self, data: bytes) -> None:
        with self._lock:
            self._memory += data
            if len(self._memory) > self._memory_bytes:
                self._spill()

    def pop(self, max_bytes: int) -> bytes:
        """Up to `max_bytes` of the oldest lines (whole lines unless one line is longer)."""
        with self._lock:
            if self._spilled:
                with open(self.spill_path, "rb") as f:
                    f.seek(self._offset)
                    data = _whole_lines(f.read(min(max_bytes, self._spilled)))
                self._offset += len(data)
                self._spilled -= len(data)
                if not self._spilled:
                    self.spill_path.unlink(missing_ok=True)
                    self._offset = 0
                return data
            data = _whole_lines(bytes(self._memory[:max_bytes]))
            del self._memory[: len(data)]
            return data

    def keep(self, head: bytes = b"") -> Path | None:
        """Everything still waiting (after `head`, a popped chunk not stored) into the spill
        file, left in place for a person to read; its path, or None if nothing waits."""
        with self._lock:
            if not head and not len(self):
                return None
            rest = b""
            if self._spilled:
                with open(self.spill_path, "rb") as f:
                    f.seek(self._offset)
                    rest = f.read()
            self.spill_path.parent.mkdir(parents=True, exist_ok=True)
            self.spill_path.write_bytes(head + rest + bytes(self._memory))
            self._memory.clear()
            self._spilled, self._offset = 0, 0
            return self.spill_path

    def _spill(self) -> None:
        self.spill_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.spill_path, "ab") as f:
            f.write(self._memory)
        self._spilled += len(self._memory)
        self._memory.clear()


def _whole_lines(data: bytes) -> bytes:
    cut = data.rfind(b"\n") + 1
    return data[:cut] if cut else data


class JobJournal:
    """The job's log segments and status, written in order by one thread (see the module)."""

    def __init__(
        self,
        root: StorageRoot,
        job_id: str,
        spill_dir: Path,
        say: Callable[[str], None],
        interval: float | None = None,
    ) -> None:
        """`say`: where the journal's own problems go (the controller's lines)."""
        self._root, self._job_id, self._say = root, job_id, say
        # Local writes are cheap, so lines land fast; on an object store each segment is a PUT.
        self._interval = interval if interval is not None else (0.05 if root.is_local else 0.5)
        self._seq = next_segment(root, job_id)
        self._spool = LineSpool(spill_dir / "logs.txt")
        self._inflight: tuple[int, bytes] | None = None  # a segment tried and not yet stored
        self._status: JobStatus | None = None  # the latest status not yet stored
        self._status_after = 0  # lines queued before it
        self._queued = 0  # lines queued in all
        self._stored = 0  # lines stored in all
        self._versions = [0, 0]  # statuses queued, statuses stored
        self.problem: str | None = None  # why storing stopped (a permanent error), while it lasts
        self._last_write = 0.0
        self._cond = threading.Condition()
        self._wake = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="job-journal", daemon=True)
        self._thread.start()

    # --- what callers do ---------------------------------------------------------------------

    def lines(self, lines: list[str]) -> None:
        if not lines:
            return
        with self._cond:
            self._spool.add("".join(line + "\n" for line in lines).encode())
            self._queued += len(lines)
        if self.problem is None and time.monotonic() - self._last_write >= self._interval:
            self._wake.set()  # the first line after a quiet spell goes at once

    def status(self, status: JobStatus) -> None:
        """Queue `status`: stored after the lines queued before it (a newer one replaces it)."""
        with self._cond:
            self._status, self._status_after = status, self._queued
            self._versions[0] += 1
        self._wake.set()

    def wait_stored(self, timeout: float) -> bool:
        """Until everything queued so far is stored; returns early (False) while storage is
        away, so a caller carries on with the job."""
        deadline = time.monotonic() + timeout
        with self._cond:
            target, lines = self._versions[0], self._queued
            while self._versions[1] < target or self._stored < lines:
                left = deadline - time.monotonic()
                if left <= 0 or self.problem or self._root.retry.in_outage:
                    return False
                self._cond.wait(min(left, 0.5))
        return True

    def close(self, timeout: float) -> list[str]:
        """Store what waits, trying for up to `timeout` s; what could not be stored, each in a
        line (lines kept on this machine say where)."""
        self._root.retry.give_up_at = time.monotonic() + timeout
        self._closing = True
        self._wake.set()
        self._thread.join(timeout + 30)
        unstored: list[str] = []
        with self._cond:
            if self._status is not None:
                unstored.append(f"the job's status ({self._status.state.value})")
            waiting = self._queued - self._stored
            head = self._inflight[1] if self._inflight else b""
        kept = self._spool.keep(head) if waiting else None
        if waiting:
            unstored.append(f"{waiting} log line(s), kept in {kept}")
        return unstored

    # --- the writer --------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.wait(RETRY_PROBLEM_S if self.problem else self._interval)
            self._wake.clear()
            closing = self._closing
            stored = self._store_pending()
            if closing or (self._closing and not stored):
                return

    def _store_pending(self) -> bool:
        """Store the waiting segments, then the waiting status; False on a storage error."""
        try:
            while self._store_segment():
                pass
            self._store_status()
        except Exception as e:
            if self.problem is None:
                self.problem = describe(e)
                self._say(
                    f"the job's logs and status cannot be stored in {self._root.url} "
                    f"({self.problem}); the job goes on, they wait on this machine and are "
                    "stored once the storage root takes them"
                )
            with self._cond:
                self._cond.notify_all()
            return False
        if self.problem is not None:
            self.problem = None
            self._say(f"the job's logs and status are stored in {self._root.url} again")
        return True

    def _store_segment(self) -> bool:
        if self._inflight is None:
            with self._cond:
                data = self._spool.pop(SEGMENT_BYTES)
            if not data:
                return False
            self._inflight = (self._seq, data)
            self._seq += 1
        seq, data = self._inflight
        self._root.write_bytes(layout.log_segment(self._job_id, seq), data)
        self._last_write = time.monotonic()
        with self._cond:
            self._inflight = None
            self._stored += data.count(b"\n")
            self._cond.notify_all()
        return True

    def _store_status(self) -> None:
        with self._cond:
            status, version = self._status, self._versions[0]
            if status is None or self._stored < self._status_after:
                return
        self._root.write_json(layout.status(self._job_id), status.model_dump(mode="json"))
        with self._cond:
            if self._versions[0] == version:
                self._status = None
            self._versions[1] = version
            self._cond.notify_all()


def spill_dir(home: Path, job_id: str) -> Path:
    """Where a job's unstored lines wait on the controller's machine."""
    return home / "unstored" / job_id

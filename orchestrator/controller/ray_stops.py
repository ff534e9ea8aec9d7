"""`ray job stop` for hosted jobs: the stops Ray's dashboard answered, read from its access log.

Ray's Job API stops a job by signalling its JobSupervisor actor; a hosted job has none (its
controller is a thread of the controller host), so Ray finds nothing to signal and its CLI then
waits for the job's row to end, for as long as the job runs. The dashboard on the head logs
every request it answers (`dashboard.log`, aiohttp's access log), after authenticating it: a
`'POST /api/jobs/<id>/stop HTTP/1.1' 200` line is a stop that Ray accepted from someone allowed
to make it. The controller host follows that file and stops those of its jobs, as `orchestrator
stop` does; the row then ends STOPPED and Ray's CLI returns. Writing that file takes Ray's user
on the head, who can stop any job anyway.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

# aiohttp's access line as Ray's dashboard writes it; a refused request (401, 404) is not a stop.
STOP_LINE = re.compile(r"'POST /api/jobs/(?P<job_id>[^/\s']+)/stop HTTP/[\d.]+' 200 ")
POLL_S = 0.5


def stops_in(line: str) -> str | None:
    """The job id a dashboard access line accepted a stop for, if it is one."""
    found = STOP_LINE.search(line)
    return found.group("job_id") if found else None


def follow_stops(
    path: Path, on_stop: Callable[[str], None], closed: threading.Event, poll_s: float = POLL_S
) -> None:
    """Call `on_stop(job_id)` for each stop the dashboard accepts from now on, until `closed`.
    Follows the file across Ray's rotation (renamed, a new one made) and waits for it to exist."""
    reader: _Reader | None = None
    from_end = True  # the file as it is now holds only stops from before the host
    while not closed.is_set():
        if reader is None:
            reader = _Reader.opened(path, from_end)
            from_end = False  # a file made from here on is read whole
            if reader is None:  # not made yet
                closed.wait(poll_s)
                continue
        replaced = reader.replaced()  # before reading: what was written up to the rename is read
        for line in reader.new_lines():
            job_id = stops_in(line)
            if job_id is not None:
                on_stop(job_id)
        if replaced:
            reader.close()
            reader = None
        else:
            closed.wait(poll_s)
    if reader is not None:
        reader.close()


class _Reader:
    """Whole new lines of one file (one inode), from where it was opened."""

    def __init__(self, handle: TextIO, path: Path) -> None:
        self.handle, self.path, self.partial = handle, path, ""
        self.inode = os.fstat(handle.fileno()).st_ino

    @classmethod
    def opened(cls, path: Path, at_end: bool) -> _Reader | None:
        try:
            reader = cls(open(path, encoding="utf-8", errors="replace"), path)  # noqa: SIM115
        except FileNotFoundError:
            return None
        if at_end:
            reader.handle.seek(0, os.SEEK_END)
        return reader

    def new_lines(self) -> list[str]:
        text = self.partial + self.handle.read()
        lines = text.split("\n")
        self.partial = lines.pop()
        return lines

    def replaced(self) -> bool:
        try:
            return os.stat(self.path).st_ino != self.inode
        except FileNotFoundError:
            return False  # renamed, the new one not made yet

    def close(self) -> None:
        self.handle.close()

"""Showing a job's log lines as they arrive: a progress bar's states replace each other.

The node agents store a bar's latest state as a line tagged `progress` (storage/logs.py), one per
second at most. On a terminal each state is drawn over the one before, as the bar would be drawn
on the node; anywhere else (a pipe, a file, JSON) every line is printed as it is stored. A
follower that prints each line as a new one (a notebook cell) gets a bar's state less often.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterable, Iterator
from typing import TextIO

from orchestrator.storage.logs import is_progress

FOLLOW_PROGRESS_S = 10.0  # `job.logs(follow=True)`: a bar's state at most this often per rank
_ERASE_LINE = "\r\x1b[2K"


class LineRenderer:
    """Prints log lines; on a terminal (`in_place`) a progress state is drawn over the last."""

    def __init__(self, out: TextIO, in_place: bool) -> None:
        self.out, self.in_place = out, in_place
        self._open = False  # a progress state is on the terminal's last row, not ended

    def show(self, line: str) -> None:
        if not self.in_place:
            self.out.write(line + "\n")
        else:
            if self._open:
                self.out.write(_ERASE_LINE)
            self._open = is_progress(line)
            # A state wider than the terminal would wrap, and only its last row be redrawn.
            width = shutil.get_terminal_size().columns - 1
            self.out.write(line[:width] if self._open else line + "\n")
        self.out.flush()

    def close(self) -> None:
        """Leave the last state on screen, the cursor on a new line."""
        if self._open:
            self.out.write("\n")
            self.out.flush()
            self._open = False


def thin_progress(
    batches: Iterable[list[str]], every_s: float, clock=time.monotonic
) -> Iterator[str]:
    """Every line of each batch, in order, except progress states: of those, a rank's latest in a
    batch, and only if `every_s` has passed since the last one of that rank given (0: all).
    A state that a line of its rank follows in the batch is dropped: the line is newer."""
    given: dict[str, float] = {}
    for batch in batches:
        if every_s <= 0:
            yield from batch
            continue
        latest: dict[str, str] = {}
        for line in batch:
            rank = line.split(" ", 2)[1] if line.startswith("[rank ") else ""
            if is_progress(line):
                latest[rank] = line
                continue
            latest.pop(rank, None)
            yield line
        now = clock()
        for rank, line in latest.items():
            if now - given.get(rank, -1e18) >= every_s:
                given[rank] = now
                yield line

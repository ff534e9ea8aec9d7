"""Job logs as numbered segments: appendable on any store, readable after the cluster is gone.

The controller's journal (storage/journal.py) writes them; anyone reads them. A line never
holds a newline (a rank's output is cut into lines and progress states where it runs,
node/output_splitter.py), so segments split on `\n` alone: a stray form feed or other
separator `str.splitlines` knows stays inside its line.
"""

from __future__ import annotations

import re

from orchestrator.storage import layout
from orchestrator.storage.root import StorageRoot

PROGRESS = "progress"  # the tag's mark on a progress state: `[rank 0 12:00:01 progress] ...`
_PROGRESS_TAG = re.compile(r"\[rank \d+ \d\d:\d\d:\d\d progress\] ")


def rank_line(rank: int, clock: str, text: str, progress: bool = False) -> str:
    """A line a rank printed, as stored: tagged with the rank and the node's time; a progress
    bar's latest state (a line still being rewritten, node/output_splitter.py) marked so."""
    return f"[rank {rank} {clock}{' ' + PROGRESS if progress else ''}] {text}"


def is_progress(line: str) -> bool:
    """Whether a stored line is a progress state, which the next state of its bar replaces."""
    return _PROGRESS_TAG.match(line) is not None


def next_segment(root: StorageRoot, job_id: str) -> int:
    """The number the job's next log segment takes (after every stored one)."""
    names = root.list_names(layout.logs_dir(job_id))
    return 1 + max((int(n.split(".")[0]) for n in names if n.endswith(".log")), default=-1)


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
        lines += data.decode(errors="replace").removesuffix("\n").split("\n") if data else []
        last = seq
    return lines, last

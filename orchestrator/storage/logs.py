"""Job logs as numbered segments: appendable on any store, readable after the cluster is gone.

The controller's journal (storage/journal.py) writes them; anyone reads them.
"""

from __future__ import annotations

from orchestrator.storage import layout
from orchestrator.storage.root import StorageRoot


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

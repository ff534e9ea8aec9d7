"""`orchestrator.progress(step)`: a training script's explicit beat, for the stuck detector.

Optional: a job is watched without it (its output, CPU, GPUs and checkpoints count,
controller/stuck.py). A loop that is silent for long stretches by design calls it now and
then. On a node, the rank's agent gives the commands PROGRESS_FILE_ENV, and a beat rewrites that
file (at most once a second); its resource samples carry the latest beat to the controller.
Outside a job (no variable) it does nothing. Light: no Ray, no spec.
"""

from __future__ import annotations

import os
import time

PROGRESS_FILE_ENV = "ORCHESTRATOR_PROGRESS_FILE"
MIN_INTERVAL_S = 1.0  # beats closer together are not written

_last_written = 0.0


def progress(step: int | None = None) -> None:
    """Say that the job moved (to `step`, if given). A no-op outside an orchestrator job."""
    global _last_written
    path = os.environ.get(PROGRESS_FILE_ENV)
    if not path:
        return
    now = time.time()
    if now - _last_written < MIN_INTERVAL_S:
        return
    _last_written = now
    try:
        with open(path, "w") as f:
            f.write("" if step is None else str(int(step)))
    except OSError:  # the beat is a hint: training never fails for it
        pass


def read_beat(path: str) -> tuple[float, int | None] | None:
    """The latest beat written to `path`: when (the file's mtime) and its step; None: none."""
    try:
        at = os.stat(path).st_mtime
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return at, int(text) if text.lstrip("-").isdigit() else None

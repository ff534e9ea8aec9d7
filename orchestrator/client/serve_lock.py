"""One writer at a time of a cluster's Ray Serve applications (`serve_applications_lock`).

Serve's REST API (PUT /api/serve/applications/) takes the whole set of applications, deletes
every one it is not sent, and has no version to compare before a write: two deploys that read
the set at once would each write it back without the other's application, and one would be
lost. Every read-modify-write of the set is made under this lock: a thread lock for this
process and a lock file in ORCHESTRATOR_HOME, per cluster address, for other processes on this
machine. Writers on other machines are not held by it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import threading
from collections.abc import Iterator

from orchestrator.home import orchestrator_home

_thread_locks: dict[str, threading.Lock] = {}
_thread_locks_guard = threading.Lock()


@contextlib.contextmanager
def serve_applications_lock(address: str) -> Iterator[None]:
    """Held while Serve's applications on the cluster at `address` are read and written back."""
    key = hashlib.sha256(address.rstrip("/").encode()).hexdigest()[:16]
    path = orchestrator_home() / "locks" / f"serve-applications-{key}.lock"
    with _thread_locks_guard:
        in_process = _thread_locks.setdefault(str(path), threading.Lock())
    path.parent.mkdir(parents=True, exist_ok=True)
    with in_process, open(path, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released by the kernel if this process dies
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)

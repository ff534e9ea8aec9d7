"""A storage root's first push without a Ray job, where the client shares the head's machine
(the bootstrap's first way: client/bootstrap.py).

The queue service watches the roots it was told of. A root's first push elsewhere tells it by
submitting the job's controller as a Ray job (a JobSupervisor and an interpreter: 2-3 s on a
2-core machine), as a laptop reaches the cluster through the Job API only. The embedded
cluster's client runs on the head's machine as the cluster's user, so it asks through a
directory instead: `<state dir>/roots-inbox` (mode 0700, named to the cluster's processes by
ORCHESTRATOR_ROOTS_INBOX). The service polls it, watches each root asked for, and the job is
queued there as every later push of that root is.

The service says it polls (`service.json`: its Ray session and when); a client asks only a
fresh one of the session it pushes to, and one that does not take the root in time leaves the
job to a Ray job after all. Only the cluster's user can write the directory: what it asks, a
root to watch, that user can have done through the Job API anyway.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from pathlib import Path

SERVICE_FILE = "service.json"
BEAT_S = 2.0  # how often the polling service says so
FRESH_S = 10.0  # a service that said so longer ago is not asked
POLL_S = 0.05  # how often the service looks for requests


def _write(path: Path, body: dict[str, object]) -> None:
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    partial.write_text(json.dumps(body))
    partial.replace(path)  # whole or absent, for a reader polling the directory


def ask(inbox: Path, root_url: str, session: str) -> bool:
    """Ask the service of `session` polling `inbox` to watch `root_url`; False (nothing asked)
    where no such service has said lately that it polls."""
    try:
        said = json.loads((inbox / SERVICE_FILE).read_text())
        fresh = said["session"] == session and time.time() - float(said["at"]) <= FRESH_S
    except (OSError, ValueError, KeyError, TypeError):  # none, or not one we can read
        return False
    if not fresh:
        return False
    _write(inbox / f"{uuid.uuid4().hex}.root.json", {"root": root_url})
    return True


class Inbox:
    """The service's side: it says it polls, and takes the roots asked for."""

    def __init__(self, path: Path, session: str) -> None:
        self.path, self.session = path, session
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.said_at = 0.0

    def say(self) -> None:
        """Every BEAT_S: this service polls (clients ask only a service that said so)."""
        if time.monotonic() - self.said_at >= BEAT_S:
            _write(self.path / SERVICE_FILE, {"session": self.session, "at": time.time()})
            self.said_at = time.monotonic()

    def take(self) -> list[str]:
        """The roots asked for since the last call, each request removed as it is read."""
        roots = []
        for name in sorted(os.listdir(self.path)):
            if not name.endswith(".root.json"):
                continue
            request = self.path / name
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                roots.append(str(json.loads(request.read_text())["root"]))
            request.unlink(missing_ok=True)
        return roots

    def close(self) -> None:
        """Clients stop asking at once (the service ends)."""
        (self.path / SERVICE_FILE).unlink(missing_ok=True)

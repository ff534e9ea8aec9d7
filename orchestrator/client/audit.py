"""Each change a client makes through us leaves one audit event (storage/audit.py): the verbs
wrap what they do in `audited`, which records how it ended, also when it failed.

The event is written after the change, by the client that made it: a failed write of the event
is said on stderr and never undoes or fails the change it describes.
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

from orchestrator.storage.audit import AuditEvent, append, read
from orchestrator.storage.root import StorageRoot

log = logging.getLogger(__name__)
_FIELDS = ("job", "project", "team", "target", "detail")


@contextlib.contextmanager
def audited(root: StorageRoot, verb: str, **target: Any) -> Iterator[dict[str, Any]]:
    """Run the change in the `with` block and record it. `target`: job, project, team, target,
    detail; the block may add what it learns to the dict it is given (the id a push made)."""
    found = {k: v for k, v in target.items() if v is not None}
    try:
        yield found
    except BaseException as e:
        record(root, verb, found, f"failed: {_why(e)}")
        raise
    record(root, verb, found, "ok")


def record(root: StorageRoot, verb: str, target: dict[str, Any], result: str) -> None:
    unknown = set(target) - set(_FIELDS)
    assert not unknown, f"audit fields {unknown}"
    event = AuditEvent(
        at=time.time(), verb=verb, result=result, user=_user(), host=socket.gethostname(),
        **{k: str(v) for k, v in target.items() if v is not None},
    )  # fmt: skip
    try:
        append(root, event)
    except Exception as e:
        log.warning("could not record the audit event of %s in %s: %s", verb, root.url, e)


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container's user)
        return f"uid {os.getuid()}"


def _why(error: BaseException) -> str:
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def events(
    *,
    job: str | None = None,
    project: str | None = None,
    team: str | None = None,
    since: float | None = None,
    storage_root: str | None = None,
) -> list[AuditEvent]:
    """The audit trail of the storage root, oldest first; each filter given must match."""
    from orchestrator.client.connection import storage

    return read(storage(storage_root), job=job, project=project, team=team, since=since)

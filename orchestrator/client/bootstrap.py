"""A storage root's first push to a cluster (the bootstrap): whether the cluster's queue service
takes this push's job, or the push must start the job's controller itself to start the service.

The queue service starts every admitted job's controller (scheduler/launcher.py), but only in
the storage roots it watches, and it learns of a root from a push or a controller. A push
whose root no service of its cluster watches (the cluster's first push to it, or a root let
go of after an idle minute) leaves its job to the queue only if a service will watch it soon:
- on the embedded cluster, whose client shares the head's machine, the running service is
  asked through its inbox (scheduler/roots_inbox.py), with no Ray job;
- another push may be starting the service already (its claim in `queue/starting/`): this one
  waits for that service rather than start a controller only to wait in the queue (a Ray job,
  RUNNING in the dashboard);
- else this push claims the start (`claim_service_start`), and its job's controller, submitted
  as a Ray job (client/submit.py), starts the service and the controller host.
"""

from __future__ import annotations

import time
from pathlib import Path

from orchestrator.client.connection import Connection
from orchestrator.scheduler import roots_inbox
from orchestrator.storage.queue_store import SERVICE_START_S, STARTING, QueueStore
from orchestrator.storage.root import StorageRoot

INBOX_WAIT_S = 5.0  # how long a push waits for the service it asked through the inbox
SERVICE_POLL_S = 0.25  # how often a push waiting for another's service looks for its beat


def service_takes_it(
    connection: Connection, queue: QueueStore, session: str, root: StorageRoot
) -> bool:
    """Whether `session`'s queue service watches the root, or will soon: then the job waits for
    it with no process of its own. False: no service will, and this push is to submit its job's
    controller, which starts one (a submission that fails gives the start up: `give_up_claim`)."""
    return (
        queue.watched_by(session)
        or _asked_service(connection, queue, session, root)
        or _service_starting(queue, session)
    )


def give_up_claim(root: StorageRoot, session: str) -> None:
    """This push's controller was not submitted: the next push starts the service at once."""
    root.discard(f"{STARTING}/{session}.json")


def _asked_service(
    connection: Connection, queue: QueueStore, session: str, root: StorageRoot
) -> bool:
    """Whether the running queue service, asked through the embedded cluster's inbox, watches
    the root now. False where there is no inbox or no service polls it, or the service did not
    take the root in time (then the push's controller starts the job)."""
    if connection.roots_inbox is None:
        return False
    if not roots_inbox.ask(Path(connection.roots_inbox), root.url, session):
        return False
    return _watched_by_then(queue, session, time.time() + INBOX_WAIT_S, roots_inbox.POLL_S)


def _service_starting(queue: QueueStore, session: str) -> bool:
    """Whether another push is starting this root's queue service: then ours waits for that
    service to watch the root. False if this push is to start it (its claim is made here), or
    that service did not come in time."""
    claimed_at = queue.claim_service_start(session)
    if claimed_at is None:
        return False
    return _watched_by_then(queue, session, claimed_at + SERVICE_START_S, SERVICE_POLL_S)


def _watched_by_then(queue: QueueStore, session: str, until: float, poll_s: float) -> bool:
    """Whether the session's queue service watches the root by `until` (a time.time())."""
    while time.time() < until:
        if queue.watched_by(session):
            return True
        time.sleep(poll_s)
    return queue.watched_by(session)

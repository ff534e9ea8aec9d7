"""Webhook notifications' durable state in the storage root: who is told of what, each event the
jobs' transitions made, and which deliveries are done.

notify/subscriptions/<id>.json             Subscription: a URL, a team (None: every team), the
                                           event kinds, and the name of the secret that signs
                                           (never its value); written by `notify add`
notify/outbox/<job_id>/<seq>.json          NotifyEvent: one event of the job (seq: its place in
                                           the job's order), created once, never rewritten
notify/delivered/<job_id>/<seq>-<id>.json  Delivery: that event delivered to subscription <id>
                                           (or given up), written once the try is over
notify/settled/<job_id>.json               the job ended, its events are queued and each of
                                           their deliveries is done: never looked at again
notify/deliverer.json                      DelivererLease: the queue service delivering here

The queue service derives events from jobs' statuses (scheduler/job_events.py) and delivers
them (scheduler/webhooks.py); a restarted service reads the outbox and the deliveries back, so
an event is queued once (its id: job, attempt, kind) and delivered once to each subscription.
"""

from __future__ import annotations

import contextlib
import enum
import json
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.storage.root import StorageRoot

NOTIFY = "notify"
SUBSCRIPTIONS = "notify/subscriptions"
OUTBOX = "notify/outbox"
DELIVERED = "notify/delivered"
SETTLED = "notify/settled"
LEASE = "notify/deliverer.json"
LEASE_RENEW_S = 10.0  # the delivering service rewrites its lease this often
LEASE_STALE_S = 30.0  # a lease not renewed this long: another service may take over


class EventKind(str, enum.Enum):
    """What a subscription may be told of."""

    FAILED = "failed"  # the job ended FAILED or DEPLOY_FAILED
    COMPLETED = "completed"
    PREEMPTED = "preempted"  # an attempt ended by a preemption (or the queue), or PREEMPTED
    STUCK = "stuck"  # an attempt ended because a rank made no progress


ALL_KINDS = tuple(k.value for k in EventKind)


class Subscription(BaseModel):
    """A webhook: JSON events POSTed to `url`, signed with the secret named `secret`."""

    model_config = ConfigDict(extra="ignore")

    id: str
    url: str
    team: str | None = None  # None: every team's jobs (and jobs without a team)
    events: list[str] = Field(default_factory=lambda: list(ALL_KINDS))
    secret: str  # a secret store name (orchestrator secrets set NAME); the value is never here
    created_at: float
    created_by: str

    def wants(self, event: NotifyEvent) -> bool:
        """Its kind, its team, and not before the subscription existed."""
        return (
            event.kind in self.events
            and (self.team is None or self.team == event.team)
            and event.at >= self.created_at
        )


class NotifyEvent(BaseModel):
    """One event of a job, as it is sent: the body is these fields as JSON (`body`)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str  # "<job_id>:<attempt>:<kind>": the same event is never queued twice
    seq: int = 0  # its place among the job's events (set when it is queued)
    kind: str
    job_id: str
    project: str
    team: str | None = None
    job_name: str | None = None
    state: str  # the job's state when the event was seen
    attempt: int  # the attempt's number (BT_RETRY_COUNT); 0 before any attempt ran
    cause: str | None = None  # the attempt's cause (preempted, preempted_by_job, stuck, ...)
    reason: str | None = None  # in words: the attempt's reason or the job's failure
    at: float  # when it happened
    final: bool = False  # the job ended with it
    links: dict[str, str] = Field(default_factory=dict)  # e.g. the job's dashboard page

    def body(self) -> bytes:
        """The bytes POSTed and signed: the same on every try."""
        fields = self.model_dump(exclude={"seq"})
        fields["sequence"] = self.seq
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


Outcome = Literal["delivered", "given up"]


class Delivery(BaseModel):
    """How one event's delivery to one subscription ended."""

    event: str
    subscription: str
    outcome: Outcome
    at: float
    tries: int
    answer: str  # "HTTP 200", "HTTP 404", "connection refused", ...


class DelivererLease(BaseModel):
    """Which queue service delivers this root's webhooks (two clusters may share a root)."""

    holder: str
    at: float


class NotifyStore:
    def __init__(self, root: StorageRoot) -> None:
        self.root = root

    # -- subscriptions ---------------------------------------------------------------------------

    def add_subscription(self, subscription: Subscription) -> bool:
        """Created only if its id is free; False if it was taken."""
        return self.root.create_bytes(
            _subscription(subscription.id), subscription.model_dump_json().encode()
        )

    def subscriptions(self) -> list[Subscription]:
        """Every subscription, oldest first."""
        found = []
        for name in self.root.list_names(SUBSCRIPTIONS):
            if name.endswith(".json"):
                with contextlib.suppress(FileNotFoundError):  # removed while listed
                    found.append(Subscription.model_validate_json(
                        self.root.read_bytes(f"{SUBSCRIPTIONS}/{name}")
                    ))  # fmt: skip
        return sorted(found, key=lambda s: (s.created_at, s.id))

    def subscription(self, subscription_id: str) -> Subscription | None:
        try:
            return Subscription.model_validate_json(
                self.root.read_bytes(_subscription(subscription_id))
            )
        except FileNotFoundError:
            return None

    def remove_subscription(self, subscription_id: str) -> bool:
        try:
            self.root.remove(_subscription(subscription_id))
        except FileNotFoundError:
            return False
        return True

    # -- the outbox ------------------------------------------------------------------------------

    def events(self, job_id: str) -> list[NotifyEvent]:
        """The job's queued events, in their order."""
        found = []
        for name in self.root.list_names(f"{OUTBOX}/{job_id}"):
            if name.endswith(".json"):
                found.append(NotifyEvent.model_validate_json(
                    self.root.read_bytes(f"{OUTBOX}/{job_id}/{name}")
                ))  # fmt: skip
        return sorted(found, key=lambda e: e.seq)

    def queue(self, job_id: str, events: list[NotifyEvent],
              queued: list[NotifyEvent] | None = None) -> list[NotifyEvent]:  # fmt: skip
        """Add each of `events` the outbox does not hold yet (by id), after those it holds;
        returns the job's events. `queued`: what the caller read of the outbox already. Each
        is created only if its place is free: a second writer's event at the same place is
        read back, and the rest placed after it."""
        current = self.events(job_id) if queued is None else list(queued)
        for event in events:
            while event.id not in {e.id for e in current}:
                seq = max((e.seq for e in current), default=-1) + 1
                placed = event.model_copy(update={"seq": seq})
                if self.root.create_bytes(_event(job_id, seq), placed.model_dump_json().encode()):
                    current.append(placed)
                else:  # taken meanwhile (or our own put, retried): what is there counts
                    current = self.events(job_id)
        return current

    # -- deliveries ------------------------------------------------------------------------------

    def deliveries(self, job_id: str) -> dict[tuple[int, str], Delivery]:
        """(seq, subscription id) -> how its delivery ended, for every one done."""
        found = {}
        for name in self.root.list_names(f"{DELIVERED}/{job_id}"):
            if name.endswith(".json"):
                delivery = Delivery.model_validate_json(
                    self.root.read_bytes(f"{DELIVERED}/{job_id}/{name}")
                )
                seq = int(name.split("-", 1)[0])
                found[(seq, delivery.subscription)] = delivery
        return found

    def record_delivery(self, job_id: str, seq: int, delivery: Delivery) -> None:
        self.root.write_bytes(_delivered(job_id, seq, delivery.subscription),
                              delivery.model_dump_json().encode())  # fmt: skip

    def settled(self) -> set[str]:
        return {n.removesuffix(".json") for n in self.root.list_names(SETTLED)
                if n.endswith(".json")}  # fmt: skip

    def settle(self, job_id: str, at: float) -> None:
        self.root.write_json(f"{SETTLED}/{job_id}.json", {"at": at})

    # -- the lease -------------------------------------------------------------------------------

    def hold(self, holder: str, now: float | None = None) -> bool:
        """Whether `holder` delivers here (asked every few seconds). Its own lease is renewed;
        none at all is created, by one of any number of services racing; another's that went
        stale is taken over, held from the next ask if no other service took it meanwhile.
        Two clusters sharing a root: the first delivers, the other waits."""
        now = time.time() if now is None else now
        mine = DelivererLease(holder=holder, at=now).model_dump_json().encode()
        try:
            lease = DelivererLease.model_validate_json(self.root.read_bytes(LEASE))
        except FileNotFoundError:
            return self.root.create_bytes(LEASE, mine)
        if lease.holder == holder:
            if now - lease.at >= LEASE_RENEW_S:
                self.root.write_bytes(LEASE, mine)
            return True
        if now - lease.at >= LEASE_STALE_S:
            self.root.write_bytes(LEASE, mine)
        return False


def _subscription(subscription_id: str) -> str:
    return f"{SUBSCRIPTIONS}/{subscription_id}.json"


def _event(job_id: str, seq: int) -> str:
    return f"{OUTBOX}/{job_id}/{seq:06d}.json"


def _delivered(job_id: str, seq: int, subscription_id: str) -> str:
    return f"{DELIVERED}/{job_id}/{seq:06d}-{subscription_id}.json"

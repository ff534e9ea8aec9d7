"""The job queue's durable state in the storage root: teams' quotas and each queued or admitted job.

queue/quotas.json             {team: {"GPU:H100": 16, "CPU": 128, "memory": bytes}}; written by
                              `capacity set` (the client), read by the service each tick
queue/entries/<job_id>.json   QueueEntry, rewritten on every change, removed when the job leaves
queue/incoming/<job_id>.json  QueueEntry written by `push`: the job is queued from that moment;
                              the service takes it into entries/ (no process waits for it)
queue/requests/<job_id>.json  PriorityRequest from `update --priority`, taken by the service
queue/stops/<job_id>.json     StopRequest from `stop` of a job that has no controller yet
queue/services/<session>.json ServiceBeat: a queue service of that Ray cluster session watches
                              this root (rewritten every few seconds)
queue/starting/<session>.json ServiceBeat: the push that found no service of that session here
                              and started one (through its own controller), and when
queue/view.json               QueueView: the service's last decision (positions, reasons) and
                              the cluster's nodes, for `queue` and `capacity view`

The queue service keeps its state in memory and writes each change here first, so a restarted
service (or head node) rebuilds the same queue: nothing admitted twice, nothing forgotten.
Clients never call the service (a laptop reaches only the dashboard and the storage root): they
write requests and read what the service wrote.
"""

from __future__ import annotations

import contextlib
import time
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.storage.root import StorageRoot

QUOTAS = "queue/quotas.json"
ENTRIES = "queue/entries"
INCOMING = "queue/incoming"
REQUESTS = "queue/requests"
STOPS = "queue/stops"
SERVICES = "queue/services"
STARTING = "queue/starting"
VIEW = "queue/view.json"

Quotas = dict[str, dict[str, float]]
BEAT_S = 2.0  # a watching service rewrites its beat this often
BEAT_STALE_S = 10.0  # a beat older than this: no service of that session watches the root
# How long pushes wait for the queue service another push is starting, before they start their
# own controllers: a Ray job's start plus the service actor's, on a busy head.
SERVICE_START_S = 60.0
_M = TypeVar("_M", bound=BaseModel)


class Launch(BaseModel):
    """How the service starts a job's controller once the job is admitted: a Ray job (the
    dashboard lists it) with this entrypoint and metadata, the job id its submission id."""

    entrypoint: str
    metadata: dict[str, str] = Field(default_factory=dict)
    # What a hosted controller is started with (the entrypoint's own arguments)
    storage_root: str | None = None
    scheduling_timeout_s: float | None = None


class QueueEntry(BaseModel):
    """A job the queue holds: waiting, or admitted and running."""

    model_config = ConfigDict(extra="ignore")

    job_id: str
    team: str | None = None
    priority: int = 0
    pushed_at: float
    bundle: dict[str, float]  # per node, in the policy's keys ("CPU", "memory", "GPU:H100")
    nodes: int = 1
    colocated: bool = False
    state: Literal["queued", "admitted"] = "queued"
    placed_on: list[str] = Field(default_factory=list)  # admitted: the node of each bundle
    borrowed: bool = False  # beyond its team's quota: recomputed by every decision
    admitted_at: float | None = None
    preemption: str | None = None  # asked to leave: "preempted by <job>: <why>"
    preempted_by: str | None = None  # the job it gave way to; kept when it is queued again
    resumable: bool = False  # it checkpoints: a preemption costs it little
    ray_job_id: str | None = None  # the controller's Ray driver: gone while listed = it died
    submission_id: str | None = None  # the Ray job (the dashboard's id) running the controller
    launch: Launch | None = None  # pushed: the service starts the controller when admitted
    launched_at: float | None = None  # when the service submitted that Ray job
    hosted: bool = False  # its controller is a thread of the controller host, not a Ray job
    hosted_by: str | None = None  # ... of that host's incarnation: another one = it is gone
    cluster: str | None = None  # the Ray session it was pushed to: only its service takes it
    queue_timeout_s: float | None = None  # pushed: the service ends it after waiting this long
    image: str | None = None  # its base_image, pulled ahead onto nodes while it waits
    image_registry: str | None = None  # docker_auth's REGISTRY_SECRET: the registry
    image_secret: str | None = None  # ... and the secret's name (resolved on the node)
    project: str | None = None  # its project's id: whose history its start estimate counts on
    max_duration_s: float | None = None  # how long it may hold its nodes (its max_duration)

    @property
    def awaits_controller(self) -> bool:
        """Pushed, and no controller of its own yet: the service speaks and acts for it."""
        return self.launch is not None and self.ray_job_id is None and self.launched_at is None


class PriorityRequest(BaseModel):
    job_id: str
    priority: int
    at: float


class StopRequest(BaseModel):
    job_id: str
    at: float


class ServiceBeat(BaseModel):
    """A queue service's sign of life in a root it watches."""

    session: str
    at: float
    runtime: str | None = None  # where its cluster runs jobs' commands: "host" or "container"


class WaitingView(BaseModel):
    job_id: str
    position: int
    reason: str
    estimated_start: float | None = None  # epoch seconds (scheduler/estimate.py)
    estimate: str = ""  # how it was estimated, or "cannot estimate: <why>"; "": not yet


class NodeView(BaseModel):
    node_id: str
    capacity: dict[str, float]
    free: dict[str, float]


class QueueView(BaseModel):
    """What the service decided last, as clients read it."""

    model_config = ConfigDict(extra="ignore")

    decided_at: float = 0.0
    waiting: list[WaitingView] = Field(default_factory=list)
    impossible: dict[str, str] = Field(default_factory=dict)  # job id -> why
    spared: dict[str, str] = Field(default_factory=dict)  # running job -> why not preempted
    reserved: dict[str, list[str]] = Field(default_factory=dict)  # held job -> nodes kept
    nodes: list[NodeView] = Field(default_factory=list)


class QueueStore:
    def __init__(self, root: StorageRoot) -> None:
        self.root = root

    def quotas(self) -> Quotas:
        if not self.root.exists(QUOTAS):
            return {}
        return {team: dict(limits) for team, limits in self.root.read_json(QUOTAS).items()}

    def set_quota(self, team: str, limits: dict[str, float] | None) -> Quotas:
        """Replace a team's limits (None or empty: no quota, unlimited); returns all quotas."""
        quotas = self.quotas()
        if limits:
            quotas[team] = dict(limits)
        else:
            quotas.pop(team, None)
        self.root.write_json(QUOTAS, quotas)
        return quotas

    def put(self, entry: QueueEntry) -> None:
        self.root.write_bytes(_entry(entry.job_id), entry.model_dump_json().encode())

    def remove(self, job_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.root.remove(_entry(job_id))

    def entries(self) -> list[QueueEntry]:
        """Every entry, oldest push first."""
        found = []
        for name in self.root.list_names(ENTRIES):
            if name.endswith(".json"):
                try:
                    found.append(QueueEntry.model_validate_json(
                        self.root.read_bytes(f"{ENTRIES}/{name}")
                    ))  # fmt: skip
                except FileNotFoundError:  # removed while listed
                    continue
        return sorted(found, key=lambda e: (e.pushed_at, e.job_id))

    def entry(self, job_id: str) -> QueueEntry | None:
        try:
            return QueueEntry.model_validate_json(self.root.read_bytes(_entry(job_id)))
        except FileNotFoundError:
            return None

    # -- requests and the view: between clients and the service -------------------------------

    def request_priority(self, job_id: str, priority: int, at: float) -> None:
        request = PriorityRequest(job_id=job_id, priority=priority, at=at)
        self.root.write_bytes(f"{REQUESTS}/{job_id}.json", request.model_dump_json().encode())

    def request_pending(self, job_id: str) -> bool:
        return self.root.exists(f"{REQUESTS}/{job_id}.json")

    def take_requests(self) -> list[PriorityRequest]:
        """The service's side: every request, removed as it is read."""
        return sorted(self._take(REQUESTS, PriorityRequest), key=lambda r: r.at)

    # -- pushed jobs, stops and the service's beat ----------------------------------------------

    def put_incoming(self, entry: QueueEntry) -> None:
        self.root.write_bytes(f"{INCOMING}/{entry.job_id}.json", entry.model_dump_json().encode())

    def incoming(self) -> list[QueueEntry]:
        """Pushed jobs no service has taken yet (a read: clients show them as queued)."""
        return self._read_all(INCOMING, QueueEntry)

    def incoming_entry(self, job_id: str) -> QueueEntry | None:
        try:
            return QueueEntry.model_validate_json(self.root.read_bytes(f"{INCOMING}/{job_id}.json"))
        except FileNotFoundError:
            return None

    def incoming_for(self, cluster: str | None) -> list[QueueEntry]:
        """The service's side: pushed jobs for `cluster` (or for any), oldest first; each is
        dropped (`drop_incoming`) once its entry is stored, so it is always in one of the two.
        Another cluster's are left to its service, unless no service of that cluster beats here
        and the job is older than a beat (that cluster's head restarted: a new session)."""
        now = time.time()
        mine = [
            e for e in self.incoming()
            if e.cluster in (None, cluster) or (
                e.launched_at is None and now - e.pushed_at > BEAT_STALE_S
                and not self.watched_by(e.cluster)
            )
        ]  # fmt: skip
        return sorted(mine, key=lambda e: (e.pushed_at, e.job_id))

    def drop_incoming(self, job_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.root.remove(f"{INCOMING}/{job_id}.json")

    def request_stop(self, job_id: str, at: float) -> None:
        request = StopRequest(job_id=job_id, at=at)
        self.root.write_bytes(f"{STOPS}/{job_id}.json", request.model_dump_json().encode())

    def take_stops(self) -> list[StopRequest]:
        return sorted(self._take(STOPS, StopRequest), key=lambda r: r.at)

    def arrivals(self) -> bool:
        """Whether anything waits for the service: a pushed job, a stop or a priority request."""
        return any(
            any(n.endswith(".json") for n in self.root.list_names(folder))
            for folder in (INCOMING, STOPS, REQUESTS)
        )

    def beat(self, session: str, at: float, runtime: str | None = None) -> None:
        beat = ServiceBeat(session=session, at=at, runtime=runtime)
        self.root.write_bytes(f"{SERVICES}/{session}.json", beat.model_dump_json().encode())

    def forget_beat(self, session: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.root.remove(f"{SERVICES}/{session}.json")

    def watched_by(self, session: str) -> bool:
        """Whether a queue service of that Ray cluster session beat here lately."""
        beat = self._beat_of(session)
        return beat is not None and time.time() - beat.at < BEAT_STALE_S

    def runtimes(self) -> set[str | None]:
        """Where the clusters whose queue services watch this root lately run jobs' commands,
        as each said in its beat (None: a service that did not say)."""
        found = set()
        for name in self.root.list_names(SERVICES):
            with contextlib.suppress(ValueError):  # a beat being written: the next push reads it
                beat = self._beat_of(name.removesuffix(".json"))
                if beat is not None and time.time() - beat.at < BEAT_STALE_S:
                    found.add(beat.runtime)
        return found

    def _beat_of(self, session: str) -> ServiceBeat | None:
        try:
            return ServiceBeat.model_validate_json(
                self.root.read_bytes(f"{SERVICES}/{session}.json")
            )
        except FileNotFoundError:
            return None

    def claim_service_start(self, session: str) -> float | None:
        """None if this push is the one to start the cluster session's queue service here (by
        submitting its controller at once): the first to find no service watching. Else when
        the push that is starting it claimed so; a claim older than SERVICE_START_S whose
        service never beat is taken over."""
        rel = f"{STARTING}/{session}.json"
        claim = ServiceBeat(session=session, at=time.time()).model_dump_json().encode()
        if self.root.create_bytes(rel, claim):
            return None
        try:
            at = ServiceBeat.model_validate_json(self.root.read_bytes(rel)).at
        except FileNotFoundError:  # given up meanwhile
            at = 0.0
        if time.time() - at < SERVICE_START_S:
            return at
        self.root.write_bytes(rel, claim)
        return None

    def write_view(self, view: QueueView) -> None:
        self.root.write_bytes(VIEW, view.model_dump_json().encode())

    def view(self) -> QueueView | None:
        """None: no service has decided anything in this storage root yet."""
        try:
            return QueueView.model_validate_json(self.root.read_bytes(VIEW))
        except FileNotFoundError:
            return None

    def _read_all(self, folder: str, model: type[_M]) -> list[_M]:
        return [item for _, item in self._read_named(folder, model)]

    def _read_named(self, folder: str, model: type[_M]) -> list[tuple[str, _M]]:
        found = []
        for name in self.root.list_names(folder):
            if not name.endswith(".json"):  # a local root's file still being written
                continue
            try:
                data = self.root.read_bytes(f"{folder}/{name}")
            except FileNotFoundError:  # taken while listed
                continue
            found.append((f"{folder}/{name}", model.model_validate_json(data)))
        return found

    def _take(self, folder: str, model: type[_M]) -> list[_M]:
        """Every item, removed as it is read (the service's side of a request folder)."""
        taken = self._read_named(folder, model)
        for rel, _ in taken:
            with contextlib.suppress(FileNotFoundError):
                self.root.remove(rel)
        return [item for _, item in taken]


def _entry(job_id: str) -> str:
    return f"{ENTRIES}/{job_id}.json"

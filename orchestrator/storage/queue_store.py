"""The job queue's durable state in the storage root: teams' quotas and each queued or admitted job.

queue/quotas.json             {team: {"GPU:H100": 16, "CPU": 128, "memory": bytes}}; written by
                              `capacity set` (the client), read by the service each tick
queue/entries/<job_id>.json   QueueEntry, rewritten on every change, removed when the job leaves
queue/requests/<job_id>.json  PriorityRequest from `update --priority`, taken by the service
queue/view.json               QueueView: the service's last decision (positions, reasons) and
                              the cluster's nodes, for `queue` and `capacity view`

The queue service keeps its state in memory and writes each change here first, so a restarted
service (or head node) rebuilds the same queue: nothing admitted twice, nothing forgotten.
Clients never call the service (a laptop reaches only the dashboard and the storage root): they
write requests and read what the service wrote.
"""

from __future__ import annotations

import contextlib
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.storage.root import StorageRoot

QUOTAS = "queue/quotas.json"
ENTRIES = "queue/entries"
REQUESTS = "queue/requests"
VIEW = "queue/view.json"

Quotas = dict[str, dict[str, float]]


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


class PriorityRequest(BaseModel):
    job_id: str
    priority: int
    at: float


class WaitingView(BaseModel):
    job_id: str
    position: int
    reason: str


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
        taken = []
        for name in self.root.list_names(REQUESTS):
            if not name.endswith(".json"):  # a local root's file still being written
                continue
            rel = f"{REQUESTS}/{name}"
            try:
                taken.append(PriorityRequest.model_validate_json(self.root.read_bytes(rel)))
            except FileNotFoundError:
                continue
            with contextlib.suppress(FileNotFoundError):
                self.root.remove(rel)
        return sorted(taken, key=lambda r: r.at)

    def write_view(self, view: QueueView) -> None:
        self.root.write_bytes(VIEW, view.model_dump_json().encode())

    def view(self) -> QueueView | None:
        """None: no service has decided anything in this storage root yet."""
        try:
            return QueueView.model_validate_json(self.root.read_bytes(VIEW))
        except FileNotFoundError:
            return None


def _entry(job_id: str) -> str:
    return f"{ENTRIES}/{job_id}.json"

"""The job queue's durable state in the storage root: teams' quotas and each queued or admitted job.

queue/quotas.json            {team: {"GPU:H100": 16, "CPU": 128, "memory": bytes}}
queue/entries/<job_id>.json  QueueEntry, rewritten on every change, removed when the job leaves

The queue service keeps its state in memory and writes each change here first, so a restarted
service (or head node) rebuilds the same queue: nothing admitted twice, nothing forgotten.
"""

from __future__ import annotations

import contextlib
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.storage.root import StorageRoot

QUOTAS = "queue/quotas.json"
ENTRIES = "queue/entries"

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
    borrowed: bool = False
    admitted_at: float | None = None
    preemption: str | None = None  # asked to leave: "preempted by <job>: <why>"


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
            self.root.retry.call(self.root.fs.rm, self.root.path(_entry(job_id)))

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


def _entry(job_id: str) -> str:
    return f"{ENTRIES}/{job_id}.json"

"""The job queue from a client: teams' quotas, what waits and why, a waiting job's priority.

Clients never call the queue service: they write quotas and priority requests into the storage
root and read the entries and the view the service writes there (`storage/queue_store.py`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from orchestrator.client.audit import audited
from orchestrator.client.connection import storage
from orchestrator.errors import ConfigError, OrchestratorError
from orchestrator.lifecycle import JobState
from orchestrator.scheduler.resources import GPU_PREFIX, Resources, describe, total
from orchestrator.spec.accelerators import Accelerator
from orchestrator.spec.base import parse_memory
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.queue_store import REQUESTS, QueueEntry, QueueStore, Quotas
from orchestrator.storage.root import StorageRoot

NO_TEAM = "(no team)"
NOT_CONSIDERED = "not yet considered by the queue service"
_POLL_S = 0.1


def accelerator_type(name: str) -> str:
    """An accelerator type as the queue keys it ("h100" -> "H100"); ConfigError if unknown."""
    for member in Accelerator:
        if name.strip().lower() in (member.value.lower(), member.name.lower()):
            return member.value
    valid = ", ".join(m.value for m in Accelerator)
    raise ConfigError(f"{name!r} is not an accelerator type: use one of {valid}")


def set_capacity(
    team: str,
    gpus: Mapping[str, float] | None = None,
    cpus: float | None = None,
    memory: str | int | None = None,
    *,
    storage_root: str | None = None,
) -> Quotas:
    """Replace `team`'s quota: GPUs per accelerator type (`{"H100": 16}`), CPUs, memory ("512Gi"
    or bytes). No limit at all removes the quota: the team is unlimited. Returns every quota."""
    if not team.strip():
        raise ConfigError("a quota needs a team name")
    limits: dict[str, float] = {}
    for name, count in (gpus or {}).items():
        limits[GPU_PREFIX + accelerator_type(name)] = _amount(f"gpus[{name}]", count)
    if cpus is not None:
        limits["CPU"] = _amount("cpus", cpus)
    if memory is not None:
        limits["memory"] = _amount("memory", _memory_bytes(memory))
    root = storage(storage_root)
    detail = ", ".join(f"{k.removeprefix(GPU_PREFIX)} {v:g}" for k, v in limits.items())
    with audited(root, "capacity set", team=team, detail=detail or "no limit"):
        return QueueStore(root).set_quota(team, limits or None)


def capacity(*, storage_root: str | None = None) -> dict[str, Any]:
    """Each team's quota, what its admitted jobs hold and its queued jobs ask for; the cluster's
    totals and free resources as the queue service last saw them (empty before it has)."""
    store = QueueStore(storage(storage_root))
    quotas = store.quotas()
    entries = all_entries(store)
    teams: dict[str, dict[str, Any]] = {}
    for team in sorted({*quotas, *(e.team or NO_TEAM for e in entries)}):
        mine = [e for e in entries if (e.team or NO_TEAM) == team]
        running = [e for e in mine if e.state == "admitted"]
        queued = [e for e in mine if e.state == "queued"]
        teams[team] = {
            "quota": quotas.get(team, {}),
            "in_use": dict(_demand(running).amounts),
            "queued": dict(_demand(queued).amounts),
            "jobs_running": len(running),
            "jobs_queued": len(queued),
        }
    view = store.view()
    nodes = view.nodes if view else []
    cluster_total = total(Resources(n.capacity) for n in nodes).amounts
    cluster_free = total(Resources(n.free) for n in nodes).amounts

    def amounts(key: str) -> dict[str, float]:
        return {"total": cluster_total.get(key, 0.0), "free": cluster_free.get(key, 0.0)}

    gpu_keys = [k for k in sorted(cluster_total) if k.startswith(GPU_PREFIX)]
    return {
        "teams": teams,
        "accelerators": {key.removeprefix(GPU_PREFIX): amounts(key) for key in gpu_keys},
        "cpus": amounts("CPU") if nodes else {},
        "memory": amounts("memory") if nodes else {},
        "decided_at": view.decided_at if view else None,
    }


def queue(*, include_running: bool = False, storage_root: str | None = None) -> list[dict]:
    """The jobs waiting, next to start first: each with its position, why it waits and what it
    needs; then the impossible ones (they fit no node). `include_running`: admitted jobs
    first. Each row names the job's project and name, from its record (None where it cannot
    be read)."""
    root = storage(storage_root)
    store = QueueStore(root)
    view = store.view()
    waiting = {w.job_id: w for w in view.waiting} if view else {}
    impossible = view.impossible if view else {}
    spared = view.spared if view else {}
    rows: list[tuple[tuple[int, int], dict]] = []  # (tier, position): sorted stably
    for e in all_entries(store):  # oldest push first
        if e.state == "admitted":
            if include_running:
                rows.append(((0, 0), _row(e, "admitted", None, _running_reason(e, spared))))
        elif e.job_id in impossible:
            rows.append(((3, 0), _row(e, "impossible", None, impossible[e.job_id])))
        elif e.job_id in waiting:
            w = waiting[e.job_id]
            row = _row(e, "queued", w.position, w.reason, w.estimated_start, w.estimate)
            rows.append(((1, w.position), row))
        else:
            rows.append(((2, 0), _row(e, "queued", None, NOT_CONSIDERED)))
    jobs = JobStore(root)
    return [_named(row, jobs) for _, row in sorted(rows, key=lambda r: r[0])]


def update_priority(
    job_id: str, priority: int, *, storage_root: str | None = None, timeout_s: float = 15.0
) -> int:
    """Change a PENDING job's priority while it waits in the queue (as Baseten's `truss train
    update`). The queue service applies it; this waits until it has, up to `timeout_s`."""
    root = storage(storage_root)
    record = JobStore(root).record(job_id)
    with audited(root, "update", job=job_id, project=record.project, team=record.team,
                 detail=f"priority {priority}"):  # fmt: skip
        return _update_priority(root, job_id, priority, timeout_s)


def _update_priority(root: StorageRoot, job_id: str, priority: int, timeout_s: float) -> int:
    state = JobStore(root).status(job_id).state
    store = QueueStore(root)
    entry = store.entry(job_id) or store.incoming_entry(job_id)
    waiting = state in (JobState.CREATED, JobState.PENDING)  # CREATED: pushed, not yet taken
    if not waiting or entry is None or entry.state != "queued":
        standing = state.value
        if waiting:
            standing += " but admitted already" if entry else " but not in the queue"
        raise OrchestratorError(f"job {job_id} is {standing}: only a PENDING job waiting in the "
                                "queue can be re-prioritised")  # fmt: skip
    store.request_priority(job_id, priority, time.time())
    deadline = time.monotonic() + timeout_s
    while store.request_pending(job_id):
        if time.monotonic() >= deadline:
            raise OrchestratorError(
                f"no queue service took the request within {timeout_s:g} s (is a job controller "
                f"running on the cluster?); it stays in {root.url}/{REQUESTS} and is applied "
                "when one does"
            )
        time.sleep(_POLL_S)
    # Taken: the service writes the entry just after, unless the job left the queue meanwhile.
    entry = store.entry(job_id)
    while _still_applying(entry, priority) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        entry = store.entry(job_id)
    if entry is not None and entry.priority == priority:
        return priority
    if entry is not None and entry.state == "queued":
        raise OrchestratorError(f"the queue service took the request but job {job_id}'s "
                                f"priority is still {entry.priority}")  # fmt: skip
    raise OrchestratorError(f"job {job_id} left the queue before its priority change was "
                            "applied: it has started or ended")  # fmt: skip


def all_entries(store: QueueStore) -> list[QueueEntry]:
    """The service's entries and the pushed jobs it has not taken yet, oldest push first."""
    entries = {e.job_id: e for e in store.incoming()}
    entries.update((e.job_id, e) for e in store.entries())
    return sorted(entries.values(), key=lambda e: (e.pushed_at, e.job_id))


def demand_text(entry: QueueEntry) -> str:
    """ "2 x (8 H100, 16 CPU, 64.0 GiB memory)": nodes and each one's share, as `validate`."""
    return f"{entry.nodes} x ({describe(entry.bundle)})"


def start_estimate(job_id: str, *, storage_root: str | None = None) -> dict | None:
    """A waiting job's estimated start as the queue service last wrote it: `estimated_start`
    (epoch seconds, None if it cannot say) and `estimate` (how, or why not); None when the
    job is not among the waiting jobs of the last decision."""
    view = QueueStore(storage(storage_root)).view()
    for w in view.waiting if view else []:
        if w.job_id == job_id:
            return {"estimated_start": w.estimated_start, "estimate": w.estimate}
    return None


def _row(
    entry: QueueEntry, state: str, position: int | None, reason: str,
    estimated_start: float | None = None, estimate: str = "",
) -> dict:  # fmt: skip
    return {
        "job_id": entry.job_id,
        "team": entry.team,
        "priority": entry.priority,
        "pushed_at": entry.pushed_at,
        "position": position,
        "reason": reason,
        "demand": demand_text(entry),
        "state": state,
        "estimated_start": estimated_start,  # epoch seconds; None: not estimated (see estimate)
        "estimate": estimate,  # how it was estimated, or "cannot estimate: <why>"
    }


def _named(row: dict, jobs: JobStore) -> dict:
    """The row with the job's project and name beside its id: one record read. A record gone or
    unreadable gives None for both rather than hiding the rest of the queue."""
    try:
        record = jobs.record(row["job_id"])
        project, job_name = record.project, record.job_name
    except (OrchestratorError, OSError, ValueError):  # ValueError: a record that is not one
        project, job_name = None, None
    return {"job_id": row["job_id"], "project": project, "job_name": job_name, **row}


def _running_reason(entry: QueueEntry, spared: Mapping[str, str]) -> str:
    """Why a running job was preempted, or was not (rules that protect it), or that it borrows."""
    if entry.preemption:
        return entry.preemption
    if entry.job_id in spared:
        return spared[entry.job_id]
    return "borrowed: it gives way first when the owners need their quota" if (
        entry.borrowed
    ) else ""  # fmt: skip


def _demand(entries: list[QueueEntry]) -> Resources:
    return total(Resources(e.bundle) * e.nodes for e in entries)


def _still_applying(entry: QueueEntry | None, priority: int) -> bool:
    return entry is not None and entry.state == "queued" and entry.priority != priority


def _memory_bytes(memory: str | int) -> int:
    if isinstance(memory, int):
        return memory
    try:
        return parse_memory(memory)
    except ValueError as e:
        raise ConfigError(f"memory: {e}") from None


def _amount(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(f"{name}: {value!r} is not a count: give a number, 0 or more")
    return float(value)

"""The shared cluster's books from a client: the operator's prices, and what jobs and teams used,
lost and cost (books/usage.py works the figures out of each job's own status)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from orchestrator.books.cost import per_hour, rates, unpriced
from orchestrator.books.usage import JobUsage, Usage, job_usage
from orchestrator.client.audit import audited
from orchestrator.client.connection import storage
from orchestrator.client.queue import NO_TEAM, accelerator_type
from orchestrator.errors import ConfigError
from orchestrator.scheduler.cluster_view import bundle_of
from orchestrator.spec.training import Compute
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.parallel import parallel_map
from orchestrator.storage.prices import Prices, read_prices, write_prices
from orchestrator.storage.records import JobRecord

_READ_WORKERS = 16


def set_prices(
    gpu: Mapping[str, float] | None = None,
    cpu_hour: float | None = None,
    memory_gib_hour: float | None = None,
    currency: str | None = None,
    *,
    clear: bool = False,
    storage_root: str | None = None,
) -> Prices:
    """Set the cluster's prices per hour: per GPU of a type (`{"H100": 2.49}`), per CPU and per
    GiB of memory; what is not given stays as it was (`clear`: start from none). Jobs admitted
    from now on are costed at these; what already ran keeps the prices of its admission."""
    root = storage(storage_root)
    now = Prices() if clear else read_prices(root)
    changes: dict[str, Any] = {}
    if gpu:
        changes["gpu"] = {**now.gpu, **{accelerator_type(k): _price(f"gpu {k}", v)
                                        for k, v in gpu.items()}}  # fmt: skip
    if cpu_hour is not None:
        changes["cpu_hour"] = _price("cpu-hour", cpu_hour)
    if memory_gib_hour is not None:
        changes["memory_gib_hour"] = _price("memory-gib-hour", memory_gib_hour)
    if currency is not None:
        changes["currency"] = currency.strip() or now.currency
    prices = now.model_copy(update=changes)
    with audited(root, "capacity price", detail=describe_prices(prices)):
        return write_prices(root, prices)


def prices(*, storage_root: str | None = None) -> Prices:
    return read_prices(storage(storage_root))


def describe_prices(prices: Prices) -> str:
    """`H100 2.49/GPU-hour, CPU 0.04/hour, memory 0.005/GiB-hour (USD)`; `none set`."""
    if prices.empty:
        return "none set"
    parts = [f"{kind} {price:g}/GPU-hour" for kind, price in sorted(prices.gpu.items())]
    if prices.cpu_hour:
        parts.append(f"CPU {prices.cpu_hour:g}/hour")
    if prices.memory_gib_hour:
        parts.append(f"memory {prices.memory_gib_hour:g}/GiB-hour")
    return ", ".join(parts) + f" ({prices.currency})"


def hourly_cost(compute: Compute, prices: Prices) -> dict[str, Any]:
    """What a job of `compute` costs an hour at `prices`: the figure, the currency, and the GPU
    types without a price (whose share is not in the figure)."""
    bundle, at = bundle_of(compute), rates(prices)
    return {
        "per_hour": round(per_hour(bundle, compute.node_count, at), 6),
        "currency": prices.currency,
        "unpriced": unpriced(bundle, at),
        "priced": not prices.empty,
    }


def cost_line(compute: Compute, prices: Prices) -> str | None:
    """`costs 4.98 USD an hour at the cluster's prices`, with the GPU types that have no price;
    None when no prices are set."""
    if prices.empty:
        return None
    cost = hourly_cost(compute, prices)
    line = f"costs {cost['per_hour']:.2f} {cost['currency']} an hour at the cluster's prices"
    if cost["unpriced"]:
        line += f" (no price for {', '.join(cost['unpriced'])}: not counted)"
    return line


def usage(
    *,
    team: str | None = None,
    project: str | None = None,
    since: float | None = None,
    until: float | None = None,
    storage_root: str | None = None,
) -> list[JobUsage]:
    """The books of every job of the storage root that matches (team, project: its name or
    id) and ran or waited between `since` and `until`, oldest push first; figures clipped to
    that window."""
    store = JobStore(storage(storage_root))
    records = [r for r in store.records()
               if (team is None or (r.team or NO_TEAM) == team)
               and (project is None or project in (r.project, r.project_key))
               and (until is None or r.created_at < until)]  # fmt: skip
    now = time.time()

    def books(record: JobRecord) -> JobUsage:
        return job_usage(record, store.status(record.job_id), now, since, until)

    found = parallel_map(books, records, _READ_WORKERS)
    return [u for u in found if since is None or u.ended_at is None or u.ended_at >= since]


def by_team(jobs: list[JobUsage]) -> dict[str, dict[str, Any]]:
    """Per team: its jobs' usage, lost usage and waiting added up."""
    teams: dict[str, dict[str, Any]] = {}
    for u in jobs:
        t = teams.setdefault(u.team or NO_TEAM, {"jobs": 0, "usage": Usage(), "lost": Usage(),
                                                 "waiting_s": 0.0})  # fmt: skip
        t["jobs"] += 1
        t["usage"] += u.usage
        t["lost"] += u.lost
        t["waiting_s"] += u.waiting_s
    return dict(sorted(teams.items()))


def _price(name: str, value: float) -> float:
    if not value >= 0:
        raise ConfigError(f"{name}: a price is 0 or more, not {value}")
    return float(value)

"""Where a job's bundles fit: on free resources, on empty nodes, after others leave.

Pure arithmetic on `{node id: Resources}` maps, shared by the policy's rules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from orchestrator.scheduler.model import Demand, Node, QueuedJob, RunningJob
from orchestrator.scheduler.resources import GPU_PREFIX, Resources


def needs(demand: Demand) -> tuple[Resources, int]:
    """What each node must hold and how many such nodes: a colocated job needs one node with
    all its bundles."""
    if demand.colocated:
        return demand.total, 1
    return demand.bundle, demand.nodes


def place(
    demand: Demand, free: Mapping[str, Resources], fitting: set[str] | None = None
) -> tuple[str, ...] | None:
    """Nodes for the bundles (best fit: the fullest node that fits first), or None.
    `fitting`: the nodes of `free` known to hold a bundle, if the caller knows them."""
    need, count = needs(demand)
    if fitting is None:
        fitting = {n for n, room in free.items() if need.fits_in(room)}
    if len(fitting) < count:
        return None
    key = _main_key(need)
    chosen = tuple(sorted(fitting, key=lambda n: (free[n].get(key), n))[:count])
    return chosen * demand.nodes if demand.colocated else chosen


def take(free: dict[str, Resources], demand: Demand, spot: tuple[str, ...]) -> None:
    for node in spot:
        free[node] = free[node] - demand.bundle


def released(free: Mapping[str, Resources], jobs: Sequence[RunningJob]) -> dict[str, Resources]:
    """`free` with what `jobs` hold added back, on the nodes `free` has."""
    out = dict(free)
    for job in jobs:
        for node in job.placed_on:
            if node in out:
                out[node] = out[node] + job.demand.bundle
    return out


def shortfall(need: Resources, room: Resources) -> float:
    """How far `room` is from holding `need`: the largest missing fraction of any resource."""
    have, worst = room.amounts, 0.0
    for key, amount in need.amounts.items():
        if amount > 0:
            worst = max(worst, (amount - have.get(key, 0.0)) / amount)
    return worst


def impossible(
    jobs: Sequence[QueuedJob], nodes: Sequence[Node], useful: Callable[[Demand], set[str]]
) -> dict[str, str]:
    """Rule 6: the jobs (id -> why) that fit no node even when the cluster is empty, asked once
    per demand. `useful(demand)`: the nodes whose capacity holds one of its bundles."""
    never: dict[str, str | None] = {}
    out: dict[str, str] = {}
    for job in jobs:
        if job.demand.key not in never:
            empty = len(useful(job.demand)) >= needs(job.demand)[1]
            never[job.demand.key] = None if empty else never_fits(job.demand, nodes)
        if (why := never[job.demand.key]) is not None:
            out[job.job_id] = why
    return out


def never_fits(demand: Demand, nodes: Sequence[Node]) -> str:
    need, count = needs(demand)
    fitting = sum(1 for n in nodes if need.fits_in(n.capacity))
    why = (
        f"needs {count} node{'s' if count > 1 else ''} with {need.describe()} each; "
        f"{fitting} of the cluster's {len(nodes)} node{'' if len(nodes) == 1 else 's'} "
        f"{'has' if fitting == 1 else 'have'} "
        "that much even when empty"
    )
    have = sorted({k for n in nodes for k, v in n.capacity.amounts.items()
                   if k.startswith(GPU_PREFIX) and v > 0})  # fmt: skip
    for key in need.amounts:
        if key.startswith(GPU_PREFIX) and key not in have:
            names = ", ".join(k.removeprefix(GPU_PREFIX) for k in have) or "no GPUs"
            why += f" (no node has {key.removeprefix(GPU_PREFIX)} GPUs; the cluster has {names})"
    return why


def _main_key(need: Resources) -> str:
    gpus = [k for k, v in need.amounts.items() if k.startswith(GPU_PREFIX) and v > 0]
    return gpus[0] if gpus else "CPU"


class Room:
    """Free resources on the nodes that could hold a job's bundles, and how many of them hold
    one now: each release or return updates only the nodes of that job, in place."""

    def __init__(
        self, demand: Demand, base: Mapping[str, Resources], nodes: set[str],
        fitting: set[str] | None = None,
    ) -> None:  # fmt: skip
        self.need, self.count = needs(demand)
        self.base, self.nodes = base, nodes  # not copied: a room only reads them
        self.changed: dict[str, dict[str, float]] = {}  # node -> its free resources now
        if fitting is None:
            fitting = {n for n in nodes if self.need.fits_in(base[n])}
        self.fitting = set(fitting)

    def release(self, job: RunningJob, back: bool = False) -> None:
        """What `job` holds becomes free (or, `back`, is held again)."""
        sign = -1.0 if back else 1.0
        bundle = job.demand.bundle.amounts
        for node in job.placed_on:
            if node not in self.nodes:
                continue
            room = self.changed.get(node)
            if room is None:
                room = self.changed[node] = dict(self.base[node].amounts)
            for key, amount in bundle.items():
                room[key] = room.get(key, 0.0) + sign * amount
            if holds(room, self.need.amounts):
                self.fitting.add(node)
            else:
                self.fitting.discard(node)

    def fits(self) -> bool:
        return len(self.fitting) >= self.count


def holds(room: Mapping[str, float], need: Mapping[str, float]) -> bool:
    """`Resources.fits_in` on plain amounts."""
    for key, amount in need.items():
        if amount > 0 and amount > room.get(key, 0.0) + 1e-9:
            return False
    return True


def node_kinds(nodes: Mapping[str, Resources]) -> list[tuple[Resources, list[str]]]:
    """`nodes` grouped by equal resources: a cluster has few kinds of node."""
    kinds: dict[frozenset, tuple[Resources, list[str]]] = {}
    for node, room in nodes.items():
        kinds.setdefault(frozenset(room.amounts.items()), (room, []))[1].append(node)
    return list(kinds.values())

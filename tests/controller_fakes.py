"""A job's nodes without Ray, for the controller's and the attempts' tests: the real `Placement`
and `FaultJudge` over a fake cluster (`FakeCluster`, `FakePlacementGroups`), and a rank group
whose ranks end as scripted (`FakeRanks`). Every call that matters is noted, in order, in one
list (`calls`) that the tests read."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from orchestrator.agents.messages import CommandsEnded, PreparedNode
from orchestrator.agents.node_agent import NodeAgent
from orchestrator.controller.fault_judge import FaultJudge
from orchestrator.controller.job_nodes import JobNodes
from orchestrator.controller.placement import Placement
from orchestrator.controller.plan import GroupPlan
from orchestrator.controller.rank_group import (
    GroupPoll,
    RankLostError,
    RankRun,
    follow,
    poll_runs,
)
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.records import CheckpointSummary, JobRecord

KEEP_RUNNING = None  # a rank's scripted ending: runs until the group is stopped
NODE = {"CPU": 8.0, "memory": 64 * 2**30, "GPU": 0.0}  # each fake node's resources


class FakeCluster:
    """Nodes that live until `kill`; each bundle sits on `node-<i>` until its node dies, then
    on `spare-<i>` (as Ray places a dead node's bundles again by itself)."""

    def __init__(self, size: int) -> None:
        self.alive = {f"node-{i}": True for i in range(size)}
        self.bundles = {i: f"node-{i}" for i in range(size)}
        self.drains: dict[str, float] = {}
        self.silent: set[str] = set()  # alive to the GCS, but their raylets do not answer

    def kill(self, node: str) -> None:
        self.alive[node] = False
        for i, on in self.bundles.items():
            if on == node:
                spare = f"spare-{i}"
                n = 1
                while spare in self.alive:
                    n += 1
                    spare = f"spare-{i}-{n}"
                self.bundles[i] = spare
                self.alive[spare] = True

    def table(self) -> list[dict[str, Any]]:
        return [
            {"NodeID": node, "Alive": up, "Resources": dict(NODE), "NodeManagerAddress": node,
             "NodeManagerPort": 1}
            for node, up in self.alive.items()
        ]  # fmt: skip

    def draining(self) -> dict[str, float]:
        return dict(self.drains)

    def raylet_answers(self, node: dict[str, Any]) -> bool:
        return node["NodeID"] not in self.silent


class FakePlacementGroups:
    """Placement groups that are placed at once, or never (`placeable = False`)."""

    def __init__(self, cluster: FakeCluster, calls: list[str]) -> None:
        self.cluster, self.calls = cluster, calls
        self.placeable = True

    def create(self, bundles, strategy, name, selector=None) -> str:
        self.calls.append("reserve")
        return name

    def ready(self, group: Any, timeout_s: float) -> bool:
        return self.placeable

    def where(self, group: Any) -> tuple[str, dict[int, str]]:
        return "CREATED", dict(self.cluster.bundles)

    def bundle(self, group: Any, index: int) -> None:
        return None

    def remove(self, group: Any) -> None:
        pass


class FakeUploaders:
    """Records the final flush and what the stored state was when it came."""

    def __init__(self, ranks: FakeRanks) -> None:
        self.ranks = ranks
        self.actors = [object()] * ranks.size
        self.flushed_with: list = []
        self.last_stored: dict = {}
        self.over_volume: str | None = None  # what the next poll says of the volume
        self.resumed_at: float | None = None

    flush_timeout_s = 5.0

    def wait_ready(self) -> None:
        self.ranks.calls.append("uploaders ready")

    def poll(self) -> tuple[list[str], str | None]:
        return [], self.over_volume

    def writer_ended(self, ending) -> None:
        pass

    def end_attempt(self, endings, timeout, lost) -> list[str]:
        self.ranks.calls.append(f"end attempt (lost {sorted(lost)})")
        return []

    def begin_attempt(self, number: int, check_stop) -> str | None:
        self.ranks.calls.append(f"begin attempt {number}")
        return self.ranks.latest_checkpoint

    def earlier(self) -> dict:
        return {}

    def carry(self, earlier: dict) -> None:
        pass

    def flush(self, endings, timeout=None):
        self.flushed_with = endings
        self.ranks.calls.append(f"flush (stored state {self.ranks.stored_state()})")
        return ["[checkpoints] nothing left to upload"], CheckpointSummary.of([], {})


class FakeRanks:
    """A RankGroup whose ranks end as scripted, attempt by attempt; a rank `lose`s its node
    in the fake cluster."""

    def __init__(
        self, store: JobStore, job_id: str, size: int, cluster: FakeCluster, calls: list[str]
    ) -> None:
        self.store, self.job_id, self.size, self.cluster = store, job_id, size, cluster
        self.calls = calls
        self.runs: list[RankRun] = []
        self.uploaders: FakeUploaders | None = None
        self.node_ids: dict[int, str] = {}
        self.plans: list[GroupPlan] = []
        self.endings: list[CommandsEnded | None] = [CommandsEnded(exit_code=0)] * size
        self.later_endings: list[list[CommandsEnded | None]] = []  # attempt 1, 2, ...
        self.lose: dict[int, int] = {}  # attempt -> the rank whose node is lost in it
        self.during_prepare: Callable[[], None] = lambda: None
        self.requests: list[list] = []  # each attempt's StartRequests
        self.latest_checkpoint: str | None = None
        self.replacements_lost = 0  # how many replacements die while being prepared
        self.groups: FakePlacementGroups | None = None  # the placement's, in `fake_nodes`

    def stored_state(self) -> str:
        return self.store.status(self.job_id).state.value

    def create(self, plan: GroupPlan) -> None:
        self.calls.append("create")
        self.plans.append(plan)

    def prepare(self, request, check_stop, ranks=None) -> list[PreparedNode]:
        self.calls.append("prepare" if ranks is None else f"prepare {ranks}")
        if ranks is not None and self.replacements_lost:
            self.replacements_lost -= 1
            for rank in ranks:  # its node goes too; Ray places the bundle elsewhere again
                self.cluster.kill(self.cluster.bundles[rank])
            raise RankLostError("preparing the node failed: ActorDiedError: its node died")
        self.during_prepare()
        check_stop()
        prepared = [
            PreparedNode(rank, self.cluster.bundles[rank], "10.0.0.1", f"host-{rank}",
                         f"/work/rank-{rank}")
            for rank in (range(self.size) if ranks is None else ranks)
        ]  # fmt: skip
        self.node_ids.update({p.rank: p.node_id for p in prepared})
        return prepared

    def start(self, requests, on_lines) -> None:
        self.calls.append("start")
        attempt = len(self.requests)
        self.requests.append(requests)
        endings = self.later_endings[attempt - 1] if attempt else self.endings
        self.runs = [RankRun(rank) for rank in range(self.size)]
        for run, ending in zip(self.runs, endings, strict=True):
            on_lines([f"[rank {run.rank}] started in {requests[run.rank].cwd}"])
            if attempt in self.lose and run.rank == self.lose[attempt]:
                self.cluster.kill(self.node_ids[run.rank])
                run.lost = RuntimeError("ActorDiedError: the node died\nnode 10.0.0.1 is gone")
                run.done.set()
            elif ending is not KEEP_RUNNING:
                run.ended = ending
                run.done.set()

    def poll(self) -> GroupPoll:
        return poll_runs(self.runs, self.uploaders)  # type: ignore[arg-type]

    def wait(self, timeout_s: float) -> None:
        running = next((r for r in self.runs if not r.done.is_set()), None)
        if running is not None:
            running.done.wait(timeout_s)

    def stacks(self, timeout_s: float) -> dict[int, str]:
        self.calls.append("stacks")
        running = [r.rank for r in self.runs if not r.done.is_set()]
        return {rank: f"rank {rank}: no stacks here\n" for rank in running}

    def stop(self, grace_s: float) -> str | None:
        self.calls.append("stop")
        for run in self.runs:
            if not run.done.is_set():
                run.ended = CommandsEnded(exit_code=-15, stopped=True)
                run.done.set()
        return None

    def drop(self, ranks: list[int]) -> None:
        pass

    def replace(self, ranks: list[int]) -> None:
        self.calls.append(f"replace {ranks}")
        for rank in ranks:
            self.node_ids.pop(rank, None)

    def write_back_cache(self, leader_node_id, wait_s):
        raise AssertionError("these jobs have no training cache")

    def release(self, keep_checkpoints: bool) -> None:
        self.calls.append(f"release (stored state {self.stored_state()})")


class InProcessRanks(FakeRanks):
    """Ranks whose programs really run, each in a NodeAgent of this process (no Ray, no
    rendezvous: each rank leads itself). Prepared only so far as to have its directories."""

    def __init__(
        self, store: JobStore, job_id: str, size: int, cluster: FakeCluster, calls: list[str]
    ) -> None:
        super().__init__(store, job_id, size, cluster, calls)
        self.agents = [NodeAgent(job_id, rank, store.root.url) for rank in range(size)]

    def prepare(self, request, check_stop, ranks=None) -> list[PreparedNode]:
        self.calls.append("prepare" if ranks is None else f"prepare {ranks}")
        check_stop()
        prepared = []
        for rank in range(self.size) if ranks is None else ranks:
            workspace = self.agents[rank].dirs.workspace
            workspace.mkdir(parents=True, exist_ok=True)
            prepared.append(PreparedNode(rank, self.cluster.bundles[rank], "127.0.0.1",
                                         f"host-{rank}", str(workspace)))  # fmt: skip
        self.node_ids.update({p.rank: p.node_id for p in prepared})
        return prepared

    def start(self, requests, on_lines) -> None:
        self.calls.append("start")
        self.requests.append(requests)
        self.runs = [RankRun(rank) for rank in range(self.size)]
        for agent, request, run in zip(self.agents, requests, self.runs, strict=True):
            request = dataclasses.replace(request, metrics=None)  # sampling asks Ray its node
            threading.Thread(target=follow, args=(agent.run_program(request), run, on_lines),
                             daemon=True).start()  # fmt: skip

    def stacks(self, timeout_s: float) -> dict[int, str]:
        self.calls.append("stacks")
        running = [r.rank for r in self.runs if not r.done.is_set()]
        return {rank: self.agents[rank].stacks() for rank in running}

    def stop(self, grace_s: float) -> str | None:
        self.calls.append("stop")
        for agent in self.agents:
            agent.stop(grace_s)
        for run in self.runs:
            run.done.wait(grace_s + 5)
        return None


def fake_nodes(
    store: JobStore, record: JobRecord, size: int, checkpointing: bool = False,
    ranks_class: type[FakeRanks] = FakeRanks,
) -> tuple[JobNodes, FakeRanks, FakePlacementGroups]:  # fmt: skip
    """A job's nodes on a fake cluster of `size` nodes: the real placement and fault judge,
    scripted ranks (or `InProcessRanks`)."""
    calls: list[str] = []
    cluster = FakeCluster(size)
    groups = FakePlacementGroups(cluster, calls)
    ranks = ranks_class(store, record.job_id, size, cluster, calls)
    ranks.groups = groups
    if checkpointing:
        ranks.uploaders = FakeUploaders(ranks)
    placement = Placement(record, lambda line: None, cluster, groups)
    judge = FaultJudge(cluster, death_wait_s=0.05, verdict_wait_s=0.5)
    return JobNodes(placement, ranks, judge), ranks, groups  # type: ignore[arg-type]


class OpenQueue:
    """A cluster's queue with room for every job (the queue's own tests use the real one)."""

    def wait_admitted(self, timeout_s, on_pending, check_stop) -> bool:
        return False

    def placed(self, node_ids) -> None:
        self.placed_on = node_ids

    def preemption(self) -> None:
        return None

    def requeue(self) -> None:
        raise AssertionError("nothing preempts a job here")

    def release(self) -> None:
        self.released = True


def in_process_controller(tmp_path, project, job_id: str, retry=None):
    """A controller for `project` stored in a local root under `tmp_path`, its ranks run in
    this process (`InProcessRanks`); the controller, its ranks and the job's handle. Set
    ORCHESTRATOR_NODE_ROOT (and ORCHESTRATOR_HOME) first."""
    from orchestrator.client.jobs import JobHandle
    from orchestrator.client.prepare import prepare_job
    from orchestrator.client.submit import store_job
    from orchestrator.controller.controller import JobController
    from orchestrator.storage.root import StorageRoot

    code = tmp_path / "code"
    code.mkdir(exist_ok=True)
    (code / "train.py").write_text("print('hi')\n")
    root = StorageRoot(str(tmp_path / "storage"))
    record = store_job(prepare_job(project, source_dir=code), root, job_id, None, retry=retry)
    store = JobStore(root)
    nodes, ranks, _ = fake_nodes(
        store, record, project.job.compute.node_count, ranks_class=InProcessRanks
    )
    controller = JobController(store, record.job_id, 5, nodes=lambda r, say: nodes,
                               queue=lambda r, say: OpenQueue())  # fmt: skip
    return controller, ranks, JobHandle(store, record)

"""`RayNodeGroup`: the Ray mechanics behind the controller's sequence.

It places the job's placement group (near the training cache when asked), starts the node
agents, rendezvous and uploaders, prepares the nodes, follows each rank's command stream,
stops and releases; between attempts it tells what a fault was and places a lost rank again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orchestrator import actor_names, ray_private, settings
from orchestrator.agents.command_runner import STREAM_BACKLOG
from orchestrator.agents.image_puller import image_puller
from orchestrator.agents.messages import (
    CacheWrittenBack,
    ImageRequest,
    OutputLines,
    PreparedNode,
    PrepareRequest,
)
from orchestrator.agents.node_agent import (
    TERMINAL_GROUP,
    TERMINAL_THREADS,
    NodeAgent,
    agent_name,
)
from orchestrator.agents.rank_program import StartRequest
from orchestrator.agents.rendezvous import Rendezvous
from orchestrator.agents.runtimes import runtime_for
from orchestrator.agents.services import NAMESPACE, actor_class
from orchestrator.controller import warm_workers
from orchestrator.controller.checkpointing import Uploaders
from orchestrator.controller.failure_policy import Fault, FaultKind
from orchestrator.controller.node_group import NodeGroupError, NodeLostError, RankRun, short_error
from orchestrator.controller.training_cache import affinity_selector
from orchestrator.spec.placement import (
    bundles_for,
    describe_shortfall,
    never_fits,
    strategy_for,
)
from orchestrator.storage.records import JobRecord

POLL_S = 0.2
CACHE_AFFINITY_WAIT_S = 3.0
NODE_DEATH_WAIT_S = 3.0  # a dead agent's node is looked at this long before it is called alive
# A node that crashed (no goodbye to the GCS) is declared dead once Ray's health checks fail:
# about 15 s with Ray's defaults. A node whose raylet does not answer is waited on this long.
NODE_VERDICT_WAIT_S = 60.0
RAYLET_PROBE_S = 1.0  # a connection to a live raylet's port is accepted well within this


class RayNodeGroup:
    """The job's placement group, NodeAgents, Rendezvous and CheckpointUploaders on Ray."""

    def __init__(self, record: JobRecord, say: Callable[[str], None]) -> None:
        self.record = record
        self.say = say
        self.pg: Any = None
        self.agents: list[Any] = []
        self.helpers: list[Any] = []  # the rendezvous, the uploaders: they end with the job
        self.rendezvous: Any = None
        self.uploaders: Uploaders | None = None
        self.runs: list[RankRun] = []
        self.cache_affinity: str | None = None
        self.node_ids: dict[int, str] = {}  # rank -> the node it was prepared on
        self.drained: set[str] = set()  # nodes seen draining (preempted) during the job
        self.silent: set[str] = set()  # nodes judged lost while the GCS still called them alive
        self.attempt = 0  # the rendezvous' generation

    # --- placing ---------------------------------------------------------------------------

    def reserve(
        self,
        timeout_s: float,
        on_pending: Callable[[str], None],
        check_stop: Callable[[], None],
    ) -> None:
        compute = self.record.spec.job.compute
        bundles = bundles_for(compute)
        strategy = strategy_for(compute, colocate=self.record.colocate_ranks)
        name = actor_names.placement_group(self.record.job_id)
        nodes = ray.nodes()
        spread = strategy == "STRICT_SPREAD"
        if not settings.CLUSTER_AUTOSCALES.get() and never_fits(
            bundles[0], len(bundles), nodes, spread
        ):
            raise NodeGroupError(
                "cannot be placed on this cluster even when it is idle: "
                f"{describe_shortfall(bundles[0], len(bundles), nodes)}. If nodes join on "
                f"demand (an autoscaler), set {settings.CLUSTER_AUTOSCALES.name}=1 in the head "
                "node's `ray start` environment and such a job waits for them"
            )
        if self._reserve_near_cache(bundles, strategy, name):
            return
        self.pg = placement_group(bundles, strategy=strategy, name=name)
        ready = self.pg.ready()
        deadline = time.monotonic() + timeout_s
        reason = None
        while True:
            done, _ = ray.wait([ready], timeout=1.0 if reason is None else POLL_S * 5)
            if done:
                return
            check_stop()
            new_reason = describe_shortfall(bundles[0], len(bundles), ray.nodes())
            if new_reason != reason:
                reason = new_reason
                on_pending(reason)
            if time.monotonic() > deadline:
                raise NodeGroupError(f"could not be scheduled within {timeout_s:g} s: {reason}")

    def _reserve_near_cache(self, bundles: list[dict], strategy: str, name: str) -> bool:
        """require_cache_affinity: try the nodes that hold the project's cache first, briefly."""

        selector, self.cache_affinity = affinity_selector(self.record, len(bundles))
        if selector is None:
            return False
        pg = placement_group(bundles, strategy=strategy, name=name, bundle_label_selector=selector)
        done, _ = ray.wait([pg.ready()], timeout=CACHE_AFFINITY_WAIT_S)
        if done:
            self.pg = pg
            self.cache_affinity = "placed on node(s) holding the project's cache"
            self.say(f"training cache: {self.cache_affinity}")
            return True
        remove_placement_group(pg)
        self.cache_affinity = (
            f"the node(s) holding the project's cache had no room within "
            f"{CACHE_AFFINITY_WAIT_S:g} s: placed anywhere"
        )
        self.say(f"training cache: {self.cache_affinity}")
        return False

    def placed_nodes(self) -> list[str]:
        where = ray.util.placement_group_table(self.pg).get("bundles_to_node_id", {})
        return [str(where[i]) for i in sorted(where)]

    # --- starting and preparing ------------------------------------------------------------

    def create(self) -> None:
        compute = self.record.spec.job.compute
        self.rendezvous = self._start_rendezvous(compute.node_count)
        self.agents = [self._start_agent(rank) for rank in range(compute.node_count)]
        if self.record.spec.job.runtime.checkpointing_config.enabled:
            self.uploaders = Uploaders(self.record, self.pg, compute.node_count)
            self.helpers += self.uploaders.actors

    def _start_agent(self, rank: int) -> Any:
        bundle = bundles_for(self.record.spec.job.compute)[rank]
        runtime_env = runtime_for(self.record.spec.job).agent_runtime_env()
        return (
            _agent_class()
            .options(
                name=agent_name(self.record.job_id, rank),
                namespace=NAMESPACE,
                max_concurrency=4,
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                memory=bundle["memory"],
                resources={k: v for k, v in bundle.items() if k.startswith("accelerator")},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=rank
                ),
                runtime_env=runtime_env,
            )
            .remote(self.record.job_id, rank, self.record.storage_root, self.record.team)
        )

    def _start_rendezvous(self, group_size: int) -> Any:
        """One per attempt: the barrier and the leader's port are that attempt's. Started with
        the agents, so its worker starts while they prepare, not after.

        A job of one node needs none: its agent leads itself, and one fewer worker starts.
        """

        if group_size == 1:
            return None
        if self.rendezvous is not None:
            with contextlib.suppress(Exception):
                ray.kill(self.rendezvous)
            self.helpers.remove(self.rendezvous)
        self.attempt += 1
        rendezvous = (
            actor_class(Rendezvous)
            .options(
                name=actor_names.rendezvous(self.record.job_id, self.attempt),
                namespace=NAMESPACE,
                num_cpus=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=0
                ),
            )
            .remote(group_size)
        )
        self.helpers.append(rendezvous)
        return rendezvous

    def prepare(
        self,
        request: PrepareRequest,
        check_stop: Callable[[], None],
        ranks: list[int] | None = None,
    ) -> list[PreparedNode]:
        ranks = list(range(len(self.agents))) if ranks is None else ranks
        refs = [self.agents[rank].prepare.remote(request) for rank in ranks]
        if request.image is not None:  # the pull's lines, as they come, while it prepares
            # The nodes' pullers pull it while the agents' workers start (a thread: the agents'
            # prepares wait on nothing of it).
            threading.Thread(target=self._pull_early, args=(request.image, ranks), daemon=True,
                             name="pull-early").start()  # fmt: skip
            for rank in ranks:
                stream = self.agents[rank].pull_progress.options(num_returns="streaming").remote()
                threading.Thread(target=self._say_pull, args=(rank, stream), daemon=True).start()
        pending = list(refs)
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
            check_stop()
        try:
            prepared = ray.get(refs)
        except Exception as e:
            lost = isinstance(e, ray.exceptions.RayActorError)  # its node or worker died
            error = NodeLostError if lost else NodeGroupError
            raise error(f"preparing the node failed: {short_error(e)}") from e
        self.node_ids.update({p.rank: p.node_id for p in prepared})
        return prepared

    def _pull_early(self, image: ImageRequest, ranks: list[int]) -> None:
        """Each node's puller pulls `image` for the first of `ranks` placed there, now; its
        lines are said as that rank's. Without a puller the agents pull it themselves."""
        first: dict[str, int] = {}
        for rank, node_id in enumerate(self.placed_nodes()):
            if rank in ranks:
                first.setdefault(node_id, rank)
        for node_id, rank in first.items():
            try:
                stream = image_puller(node_id).pull.options(num_returns="streaming").remote(
                    image.image, agent_name(self.record.job_id, rank), image.registry,
                    image.secret_name, self.record.team,
                )  # fmt: skip
            except Exception:  # the agent pulls it, saying why if it cannot
                continue
            threading.Thread(target=self._say_pull, args=(rank, stream), daemon=True).start()

    def _say_pull(self, rank: int, stream: Any) -> None:
        with contextlib.suppress(Exception):  # the agent is gone: prepare says what happened
            for ref in stream:
                self.say(f"rank {rank}: {ray.get(ref)}")

    # --- running ---------------------------------------------------------------------------

    def start(self, requests: list[StartRequest], on_lines: Callable[[list[str]], None]) -> None:
        first = not self.runs
        if not first:  # a later attempt: the group meets anew
            self.rendezvous = self._start_rendezvous(len(self.agents))
        self.runs = [RankRun(rank) for rank in range(len(self.agents))]
        for agent, request, run in zip(self.agents, requests, self.runs, strict=True):
            request = dataclasses.replace(request, rendezvous=self.rendezvous)
            stream = agent.run_program.options(
                num_returns="streaming", _generator_backpressure_num_objects=STREAM_BACKLOG
            ).remote(request)
            threading.Thread(target=self._follow, args=(stream, run, on_lines), daemon=True).start()
        if first and warm_workers.is_on():
            threading.Thread(target=self._warm_for_next, name="warm-workers", daemon=True).start()

    def _warm_for_next(self) -> None:
        """In the controller host, as many workers again as this job's actors took, on their
        nodes, for the next job's (warm_workers.py); asked once its commands were started, in
        a thread of its own, so that neither this job's start nor its controller waits on it."""
        try:
            nodes, live = self.placed_nodes(), _live_nodes()
        except Exception:  # its placement group is gone already: nothing to warm for
            return
        in_image = runtime_for(self.record.spec.job).agents_in_image
        wanted = [] if in_image else list(nodes)  # an agent in an image: its own env
        if self.uploaders is not None:
            wanted += nodes
        if self.rendezvous is not None:
            wanted.append(nodes[0])
        warm_workers.after_start([_raylet_address(live[node]) for node in wanted if node in live])

    def _follow(self, stream: Any, run: RankRun, on_lines: Callable[[list[str]], None]) -> None:
        held = ""  # a long line's pieces so far (OutputLines.continues)
        try:
            for ref in stream:
                item = ray.get(ref)
                if isinstance(item, OutputLines):
                    lines = list(item.lines)
                    lines[0], held = held + lines[0], ""
                    if item.continues:
                        held = lines.pop()
                    if lines:
                        on_lines(lines)
                else:
                    run.ended = item
        except Exception as e:
            run.lost = e
        finally:
            run.done.set()
            if self.uploaders is not None:  # from now on nothing on that node is settling
                with contextlib.suppress(Exception):
                    self.uploaders.writer_ended(run.ending(None))

    def stop(self, grace_s: float) -> str | None:
        """Every agent at once, so each rank's command has the whole grace; a lost rank's agent
        is gone with its commands and is not waited for."""
        live = [
            agent
            for rank, agent in enumerate(self.agents)
            if not (rank < len(self.runs) and self.runs[rank].lost is not None)
        ]
        refs = [agent.stop.remote(grace_s) for agent in live]
        errors = []
        for ref in refs:
            try:
                ray.get(ref, timeout=grace_s + 5)
            except Exception as e:
                errors.append(short_error(e))
        return "; ".join(errors) or None

    # --- faults ----------------------------------------------------------------------------

    def draining(self) -> dict[int, float]:
        try:
            drains = ray_private.draining_nodes()  # node id -> deadline (ms)
        except Exception:
            return {}
        found = {
            rank: drains[node_id] / 1000
            for rank, node_id in self.node_ids.items()
            if node_id in drains
        }
        self.drained.update(self.node_ids[rank] for rank in found)
        return found

    def fault_of(self, run: RankRun) -> Fault:
        node_id = self.node_ids.get(run.rank, "")
        if run.lost is None:
            failure = run.failure()
            return Fault(FaultKind.COMMAND_FAILED, failure.cause, run.rank, node_id or None)
        if self._node_lost(node_id):
            return self._node_gone(run.rank, node_id)
        why = f"rank {run.rank}'s node agent died ({short_error(run.lost)}); its node lives"
        return Fault(FaultKind.AGENT_LOST, why, run.rank, node_id)

    def _node_lost(self, node_id: str) -> bool:
        """Whether a node whose agent vanished is gone. A removed node is told dead about as
        soon as its agent; a crashed one looks alive until Ray's health checks fail, so a node
        whose raylet does not answer is waited on for the GCS's verdict, never called alive."""
        now = time.monotonic()
        alive_after, lost_after = now + NODE_DEATH_WAIT_S, now + NODE_VERDICT_WAIT_S
        while True:
            node = _live_nodes().get(node_id)
            if node is None:
                return True
            now = time.monotonic()
            if now >= alive_after and _raylet_answers(node):
                return False
            if now >= lost_after:  # silent for a minute: lost, whatever the GCS says yet
                self.silent.add(node_id)
                return True
            time.sleep(POLL_S)

    def _node_gone(self, rank: int, node_id: str) -> Fault:
        """A rank's node is no longer alive: preempted if it was seen draining, else lost."""
        if node_id in self.drained:
            why = f"rank {rank}'s node {node_id[:12]} was preempted and is gone"
            return Fault(FaultKind.PREEMPTED, why, rank, node_id)
        return Fault(
            FaultKind.NODE_LOST, f"rank {rank}'s node {node_id[:12]} was lost", rank, node_id
        )

    def lost_elsewhere(self) -> Fault | None:
        lost = next((r for r in self.runs if r.done.is_set() and r.lost is not None), None)
        if lost is not None:
            return self.fault_of(lost)
        alive = _live_nodes()
        draining = self.draining()
        for rank, node_id in sorted(self.node_ids.items()):
            if rank in draining:
                why = f"rank {rank}'s node {node_id[:12]} is being preempted"
                return Fault(FaultKind.PREEMPTED, why, rank, node_id)
            if node_id not in alive:
                return self._node_gone(rank, node_id)
        # A peer that crashed a moment ago: alive to the GCS, but its raylet is silent.
        for rank, node_id in sorted(self.node_ids.items()):
            if not _raylet_answers(alive[node_id]) and self._node_lost(node_id):
                return self._node_gone(rank, node_id)
        return None

    def replace(
        self,
        ranks: list[int],
        timeout_s: float,
        on_pending: Callable[[str], None],
        check_stop: Callable[[], None],
    ) -> None:
        for rank in ranks:
            with contextlib.suppress(Exception):
                ray.kill(self.agents[rank])
        gone = [self.node_ids[r] for r in ranks if r in self.node_ids]
        deadline = time.monotonic() + timeout_s
        reason = None
        while True:
            check_stop()
            alive = _alive_nodes()
            # A preempted node keeps its bundles until it is gone, and so does a crashed one
            # until the GCS declares it dead: an agent placed there meanwhile never runs.
            leaving = [n for n in gone if n in alive and n in self.drained | self.silent]
            if not leaving and self._placed_elsewhere(ranks, set(gone) - alive):
                break
            if leaving and leaving[0] in self.drained:
                new_reason = (
                    f"waiting for preempted node {leaving[0][:12]} to go, so that its rank is "
                    "placed elsewhere"
                )
            elif leaving:
                new_reason = (
                    f"waiting for Ray to declare node {leaving[0][:12]} dead (its raylet does "
                    "not answer), so that its rank is placed elsewhere"
                )
            else:
                bundle = bundles_for(self.record.spec.job.compute)[0]
                shortfall = describe_shortfall(bundle, 1, ray.nodes())
                new_reason = f"placing rank(s) {', '.join(map(str, ranks))} again: {shortfall}"
            if new_reason != reason:
                reason = new_reason
                on_pending(reason)
            if time.monotonic() > deadline:
                raise NodeGroupError(
                    f"rank(s) {', '.join(map(str, ranks))} could not be placed again within "
                    f"{timeout_s:g} s: {reason}"
                )
            time.sleep(POLL_S * 5)
        for rank in ranks:
            self.node_ids.pop(rank, None)
            self.agents[rank] = self._start_agent(rank)

    def _placed_elsewhere(self, ranks: list[int], dead: set[str]) -> bool:
        """The group is placed again and none of `ranks` is on a `dead` node (the GCS may tell
        a node's death a moment before it moves the node's bundles)."""
        table = ray.util.placement_group_table(self.pg)
        where = table.get("bundles_to_node_id", {})
        return str(table.get("state", "")) == "CREATED" and not any(
            str(where.get(rank, "")) in dead for rank in ranks
        )

    def write_back_cache(
        self, leader_node_id: str, wait_s: float | None
    ) -> CacheWrittenBack | None:
        from orchestrator.agents.training_cache_seeder import (
            cache_seeder_name,  # jobs with a cache only
        )

        seeder = ray.get_actor(cache_seeder_name(leader_node_id), namespace=NAMESPACE)
        pending = seeder.write_back.remote(
            self.record.storage_root, self.record.team, self.record.project_key
        )
        return None if wait_s is None else ray.get(pending, timeout=wait_s)

    def release(self, keep_checkpoints: bool) -> None:
        for agent in self.agents:
            with contextlib.suppress(Exception):  # a dead node's scratch went with it
                ray.get(agent.cleanup.remote(keep_checkpoints=keep_checkpoints), timeout=10)
            ray.kill(agent)
        for helper in self.helpers:
            ray.kill(helper)
        if self.pg is not None:
            remove_placement_group(self.pg)


@functools.cache
def _agent_class() -> Any:
    """The node agent's actor class, made once a process (services.actor_class says why); its
    concurrency groups can be given only here, not in `.options`."""
    return ray.remote(concurrency_groups={TERMINAL_GROUP: TERMINAL_THREADS})(NodeAgent)


def _live_nodes() -> dict[str, dict[str, Any]]:
    """The nodes the GCS calls alive, by id, as `ray.nodes()` describes them."""
    return {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}


def _alive_nodes() -> set[str]:
    return set(_live_nodes())


def _raylet_address(node: dict[str, Any]) -> str:
    """The node's raylet, host:port, from its `ray.nodes()` entry."""
    return f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}"


def _raylet_answers(node: dict[str, Any]) -> bool:
    """Whether the node's raylet accepts a connection: a crashed node's does not, long before
    the GCS declares it dead."""
    address = (node["NodeManagerAddress"], node["NodeManagerPort"])
    try:
        with socket.create_connection(address, timeout=RAYLET_PROBE_S):
            return True
    except OSError:
        return False

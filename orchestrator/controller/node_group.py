"""A job's nodes as one object: the Ray mechanics behind the controller's sequence.

The controller (controller.py) decides what happens and records it; the node group places the
job's placement group, starts its agents, rendezvous and uploaders, prepares the nodes, runs and
follows the commands, stops and releases. Tests give the controller a fake node group
(tests/test_controller.py), as Ray Train swaps its worker group for a dummy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orchestrator import settings
from orchestrator.agents.messages import (
    CacheWrittenBack,
    CommandsEnded,
    OutputLines,
    PreparedNode,
    PrepareRequest,
    StartRequest,
)
from orchestrator.agents.node_agent import TERMINAL_GROUP, TERMINAL_THREADS, NodeAgent, agent_name
from orchestrator.agents.rendezvous import Rendezvous
from orchestrator.agents.services import NAMESPACE
from orchestrator.controller.checkpointing import RankEnding, Uploaders
from orchestrator.controller.placement import bundles_for, describe_shortfall, strategy_for
from orchestrator.controller.training_cache import affinity_selector
from orchestrator.lifecycle import JobState
from orchestrator.storage.records import Failure, JobRecord

POLL_S = 0.2
CACHE_AFFINITY_WAIT_S = 3.0


class NodeGroupError(Exception):
    """The nodes could not be placed or prepared; the message says why (for the job's cause)."""


@dataclass
class RankRun:
    """One rank's commands as they run: how they ended, or how the rank was lost."""

    rank: int
    ended: CommandsEnded | None = None
    lost: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def failed(self) -> bool:
        return self.done.is_set() and (
            self.lost is not None or (self.ended is not None and self.ended.exit_code != 0)
        )

    def ending(self, state: JobState | None) -> RankEnding:
        """How the commands ended, for the rank's uploader; `state`: the job's end, for a rank
        still running."""
        ended = self.ended if self.done.is_set() else None
        if ended is None:
            how = "the job was stopped" if state == JobState.STOPPED else "the job ended"
            if self.lost is not None:
                how = f"rank {self.rank} was lost"
            return RankEnding(self.rank, clean=False, how=how)
        how = f"rank {self.rank}'s command exited with code {ended.exit_code}"
        if ended.stopped:
            how = f"the job was stopped (exit code {ended.exit_code})"
        return RankEnding(self.rank, clean=ended.exit_code == 0, how=how, at=ended.ended_at)

    def failure(self) -> Failure:
        if self.lost is not None:
            return Failure(cause=f"rank {self.rank} was lost: {short_error(self.lost)}",
                           node_rank=self.rank)  # fmt: skip
        assert self.ended is not None
        code, command = self.ended.exit_code, self.ended.command
        return Failure(
            cause=f"rank {self.rank}: command exited with code {code}: {command}",
            exit_code=code,
            command=command,
            node_rank=self.rank,
            last_lines=list(self.ended.last_lines),
        )


class NodeGroup(Protocol):
    """What the controller asks of a job's nodes, in this order."""

    uploaders: Uploaders | None  # one checkpoint uploader per rank, with checkpointing
    runs: list[RankRun]  # one per rank once the commands start
    cache_affinity: str | None  # where the job was placed for its training cache, and why

    def reserve(
        self,
        timeout_s: float,
        on_pending: Callable[[str], None],
        check_stop: Callable[[], None],
    ) -> None:
        """Place the job; `on_pending(reason)` each time the reason it waits changes.
        NodeGroupError when it cannot be placed within `timeout_s`."""

    def create(self) -> None:
        """Start the agents (and the rendezvous and uploaders) in the placed bundles."""

    def prepare(
        self, request: PrepareRequest, check_stop: Callable[[], None]
    ) -> list[PreparedNode]:
        """Every rank prepared, in rank order; NodeGroupError naming the first failure."""

    def start(self, requests: list[StartRequest], on_lines: Callable[[list[str]], None]) -> None:
        """Start each rank's commands; their lines go to `on_lines` as they come."""

    def stop(self, grace_s: float) -> str | None:
        """Stop the commands (SIGTERM, SIGKILL after `grace_s`); an error to say, if any."""

    def write_back_cache(
        self, leader_node_id: str, wait_s: float | None
    ) -> CacheWrittenBack | None:
        """Rank 0's training cache changes back to the storage root; its counts, or None when
        not waited for."""

    def release(self, keep_checkpoints: bool) -> None:
        """Clean the nodes and end the agents, helpers and placement group."""


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
        name = f"orchestrator-{self.record.job_id}"
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

    # --- starting and preparing ------------------------------------------------------------

    def create(self) -> None:
        compute = self.record.spec.job.compute
        bundle = bundles_for(compute)[0]
        self.rendezvous = self._start_rendezvous(compute.node_count)
        agent_cls = ray.remote(concurrency_groups={TERMINAL_GROUP: TERMINAL_THREADS})(NodeAgent)
        image = self.record.spec.job.image.base_image
        runtime_env = {"image_uri": image} if use_image_uri() else None
        for rank in range(compute.node_count):
            self.agents.append(
                agent_cls.options(
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
                ).remote(self.record.job_id, rank, self.record.storage_root, self.record.team)
            )
        if self.record.spec.job.runtime.checkpointing_config.enabled:
            self.uploaders = Uploaders(self.record, self.pg, compute.node_count)
            self.helpers += self.uploaders.actors

    def _start_rendezvous(self, group_size: int) -> Any:
        """Started with the agents, so its worker starts while they prepare, not after.

        A job of one node needs none: its agent leads itself, and one fewer worker starts.
        """

        if group_size == 1:
            return None
        rendezvous = (
            ray.remote(Rendezvous)
            .options(
                name=f"orchestrator-{self.record.job_id}-rendezvous",
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
        self, request: PrepareRequest, check_stop: Callable[[], None]
    ) -> list[PreparedNode]:
        refs = [agent.prepare.remote(request) for agent in self.agents]
        pending = list(refs)
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
            check_stop()
        try:
            return ray.get(refs)
        except Exception as e:
            raise NodeGroupError(f"preparing the node failed: {short_error(e)}") from e

    # --- running ---------------------------------------------------------------------------

    def start(self, requests: list[StartRequest], on_lines: Callable[[list[str]], None]) -> None:
        self.runs = [RankRun(rank) for rank in range(len(self.agents))]
        for agent, request, run in zip(self.agents, requests, self.runs, strict=True):
            request = dataclasses.replace(request, rendezvous=self.rendezvous)
            stream = agent.run_commands.options(num_returns="streaming").remote(request)
            threading.Thread(target=self._follow, args=(stream, run, on_lines), daemon=True).start()

    def _follow(self, stream: Any, run: RankRun, on_lines: Callable[[list[str]], None]) -> None:
        try:
            for ref in stream:
                item = ray.get(ref)
                if isinstance(item, OutputLines):
                    on_lines(item.lines)
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
        refs = [agent.stop.remote(grace_s) for agent in self.agents]
        try:
            ray.get(refs, timeout=grace_s + 5)
        except Exception as e:
            return short_error(e)
        return None

    def write_back_cache(
        self, leader_node_id: str, wait_s: float | None
    ) -> CacheWrittenBack | None:
        from orchestrator.agents.cache_seeder import cache_seeder_name  # jobs with a cache only

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


IMAGE_URI_ENV = settings.USE_IMAGE_URI.name


def use_image_uri() -> bool:
    """Run agents in the job's base image (a cluster with podman/docker for Ray's image_uri)."""
    return settings.USE_IMAGE_URI.get()


def short_error(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"

"""`RayRankGroup`: a job's ranks on Ray. One NodeAgent per bundle of the placement, the
attempt's Rendezvous and a CheckpointUploader per rank beside them; it prepares the nodes
(pulling the image early where jobs run in containers), follows each rank's stream into its
`RankRun`, polls, stops, replaces lost ranks' agents and releases.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from orchestrator import actor_names
from orchestrator.agents.command_runner import STREAM_BACKLOG
from orchestrator.agents.image_puller import image_puller
from orchestrator.agents.messages import (
    CacheWrittenBack,
    ImageRequest,
    PreparedNode,
    PrepareRequest,
)
from orchestrator.agents.node_agent import TERMINAL_GROUP, TERMINAL_THREADS, NodeAgent, agent_name
from orchestrator.agents.rank_program import StartRequest
from orchestrator.agents.rendezvous import Rendezvous
from orchestrator.agents.services import NAMESPACE, actor_class
from orchestrator.controller import warm_workers
from orchestrator.controller.checkpointing import Uploaders
from orchestrator.controller.cluster_nodes import ClusterNodes, live, raylet_address
from orchestrator.controller.placement import Placement
from orchestrator.controller.plan import GroupPlan
from orchestrator.controller.rank_group import (
    GroupError,
    GroupPoll,
    RankLostError,
    RankRun,
    follow,
    poll_runs,
    short_error,
)
from orchestrator.storage.metrics import MetricsSample
from orchestrator.storage.records import JobRecord

POLL_S = 0.2


class RayRankGroup:
    """The job's NodeAgents, Rendezvous and CheckpointUploaders, in its placement's bundles."""

    def __init__(
        self,
        record: JobRecord,
        say: Callable[[str], None],
        placement: Placement,
        nodes: ClusterNodes,
    ) -> None:
        self.record, self.say, self.placement, self.nodes = record, say, placement, nodes
        self.plan: GroupPlan | None = None
        self.agents: list[Any] = []
        self.helpers: list[Any] = []  # the rendezvous, the uploaders: they end with the job
        self.rendezvous: Any = None
        self.uploaders: Uploaders | None = None
        self.runs: list[RankRun] = []
        self.node_ids: dict[int, str] = {}  # rank -> the node it was prepared on
        self.generation = 0  # the rendezvous': one per attempt
        self.samples: dict[int, MetricsSample] = {}  # each rank's latest, as polls see them
        self._asked: dict[int, Any] = {}  # rank -> its agent's answer to come
        self._next_ask = 0.0

    # --- starting and preparing ------------------------------------------------------------

    def create(self, plan: GroupPlan) -> None:
        self.plan = plan
        self.rendezvous = self._start_rendezvous(plan.size)
        self.agents = [self._start_agent(rank) for rank in range(plan.size)]
        if self.record.spec.job.runtime.checkpointing_config.enabled:
            self.uploaders = Uploaders(self.record, self.placement.bundle, plan.size)
            self.helpers += self.uploaders.actors

    def _start_agent(self, rank: int) -> Any:
        assert self.plan is not None
        share = self.plan.ranks[rank].agent_share  # the bundle, or none of it (Ray Train's)
        return (
            _agent_class()
            .options(
                name=agent_name(self.record.job_id, rank),
                namespace=NAMESPACE,
                max_concurrency=4,
                num_cpus=share["CPU"],
                num_gpus=share.get("GPU", 0),
                memory=share["memory"],
                resources={k: v for k, v in share.items() if k.startswith("accelerator")},
                scheduling_strategy=self.placement.bundle(rank),
                runtime_env=self.plan.runtime.agent_runtime_env(),
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
        self.generation += 1
        rendezvous = (
            actor_class(Rendezvous)
            .options(
                name=actor_names.rendezvous(self.record.job_id, self.generation),
                namespace=NAMESPACE,
                num_cpus=0,
                scheduling_strategy=self.placement.bundle(0),
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
            error = RankLostError if lost else GroupError
            raise error(f"preparing the node failed: {short_error(e)}") from e
        self.node_ids.update({p.rank: p.node_id for p in prepared})
        return prepared

    def _pull_early(self, image: ImageRequest, ranks: list[int]) -> None:
        """Each node's puller pulls `image` for the first of `ranks` placed there, now; its
        lines are said as that rank's. Without a puller the agents pull it themselves."""
        first: dict[str, int] = {}
        for rank, node_id in enumerate(self.placement.placed_nodes()):
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
        self.samples, self._asked = {}, {}  # an attempt's own
        for agent, request, run in zip(self.agents, requests, self.runs, strict=True):
            request = dataclasses.replace(request, rendezvous=self.rendezvous)
            stream = agent.run_program.options(
                num_returns="streaming", _generator_backpressure_num_objects=STREAM_BACKLOG
            ).remote(request)
            args = (stream, run, on_lines, self.uploaders.attempt if self.uploaders else 0)
            threading.Thread(target=self._follow, args=args, daemon=True).start()
        if first and warm_workers.is_on():
            threading.Thread(target=self._warm_for_next, name="warm-workers", daemon=True).start()

    def _follow(
        self, stream: Any, run: RankRun, on_lines: Callable[[list[str]], None], attempt: int
    ) -> None:
        follow((ray.get(ref) for ref in stream), run, on_lines)
        if self.uploaders is not None:  # from now on nothing on that node is settling
            with contextlib.suppress(Exception):
                ending = dataclasses.replace(run.ending(None), attempt=attempt)
                self.uploaders.writer_ended(ending)

    def _warm_for_next(self) -> None:
        """In the controller host, as many workers again as this job's actors took, on their
        nodes, for the next job's (warm_workers.py); asked once its commands were started, in
        a thread of its own, so that neither this job's start nor its controller waits on it."""
        assert self.plan is not None
        try:
            placed, alive = self.placement.placed_nodes(), live(self.nodes)
        except Exception:  # its placement group is gone already: nothing to warm for
            return
        wanted = [] if self.plan.runtime.agents_in_image else list(placed)  # their own env
        if self.uploaders is not None:
            wanted += placed
        if self.rendezvous is not None:
            wanted.append(placed[0])
        warm_workers.after_start([raylet_address(alive[n]) for n in wanted if n in alive])

    def poll(self) -> GroupPoll:
        self._gather_samples()
        return poll_runs(self.runs, self.uploaders, self.samples)

    def _gather_samples(self) -> None:
        """Each running rank's latest resource sample, asked of its agent once an interval and
        taken when it has come: a poll never waits on an agent."""
        if self._asked:
            ready, _ = ray.wait(list(self._asked.values()), num_returns=len(self._asked),
                                timeout=0)  # fmt: skip
            for rank, ref in list(self._asked.items()):
                if ref in ready:
                    del self._asked[rank]
                    with contextlib.suppress(Exception):  # a lost agent: its run says so
                        if (sample := ray.get(ref)) is not None:
                            self.samples[rank] = sample
        interval = self.record.metrics_interval_s
        if interval <= 0 or time.monotonic() < self._next_ask:
            return
        self._next_ask = time.monotonic() + interval
        for run in self.runs:
            if not run.done.is_set() and run.rank not in self._asked:
                self._asked[run.rank] = self.agents[run.rank].last_sample.remote()

    def wait(self, timeout_s: float) -> None:
        """Woken by a rank's end (the job's, for one node), not a poll's later look."""
        running = next((r for r in self.runs if not r.done.is_set()), None)
        if running is not None:
            running.done.wait(timeout_s)

    def stacks(self, timeout_s: float) -> dict[int, str]:
        asked = {
            rank: agent.stacks.remote()
            for rank, agent in enumerate(self.agents)
            if rank < len(self.runs) and not self.runs[rank].done.is_set()
        }
        return gather_stacks(asked, timeout_s)

    def stop(self, grace_s: float) -> str | None:
        """Every agent at once, so each rank's program has the whole grace; a lost rank's agent
        is gone with its program and is not waited for."""
        live_agents = [
            agent
            for rank, agent in enumerate(self.agents)
            if not (rank < len(self.runs) and self.runs[rank].lost is not None)
        ]
        refs = [agent.stop.remote(grace_s) for agent in live_agents]
        errors = []
        for ref in refs:
            try:
                ray.get(ref, timeout=grace_s + 5)
            except Exception as e:
                errors.append(short_error(e))
        return "; ".join(errors) or None

    # --- replacing, and the end --------------------------------------------------------------

    def drop(self, ranks: list[int]) -> None:
        for rank in ranks:
            with contextlib.suppress(Exception):
                ray.kill(self.agents[rank])

    def replace(self, ranks: list[int]) -> None:
        for rank in ranks:
            self.node_ids.pop(rank, None)
            self.agents[rank] = self._start_agent(rank)

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


def gather_stacks(asked: dict[int, Any], timeout_s: float) -> dict[int, str]:
    """The answers of agents' `stacks` calls (rank -> its ref) that come within `timeout_s`; a
    rank that did not answer is said so in its place."""
    if asked:
        ray.wait(list(asked.values()), num_returns=len(asked), timeout=timeout_s)
    found = {}
    for rank, ref in asked.items():
        try:
            found[rank] = ray.get(ref, timeout=0)
        except Exception as e:
            found[rank] = f"rank {rank}'s stacks could not be taken: {short_error(e)}\n"
    return found


@functools.cache
def _agent_class() -> Any:
    """The node agent's actor class, made once a process (services.actor_class says why); its
    concurrency groups can be given only here, not in `.options`."""
    return ray.remote(concurrency_groups={TERMINAL_GROUP: TERMINAL_THREADS})(NodeAgent)

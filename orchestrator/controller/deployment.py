"""Putting a job on nodes: mirror its weights, wait in the cluster's queue, place a plan's
bundles and prepare every rank; for a retry, place and prepare lost ranks again.

The first start and a start after the queue preempted the job take one path
(`place_and_prepare`). A step that cannot be done fails the deploy with a cause that says why.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from orchestrator.agents.messages import (
    PreparedNode,
    PrepareRequest,
    WeightPlacement,
)
from orchestrator.books.cost import rates
from orchestrator.controller.checkpointing import CheckpointNotFound, resolve_checkpoints
from orchestrator.controller.job_nodes import JobNodes
from orchestrator.controller.job_run import JobRun
from orchestrator.controller.plan import GroupPlan
from orchestrator.controller.queueing import JobQueue, NeverFits, QueueTimeout, QueueUnavailable
from orchestrator.controller.rank_group import GroupError, short_error
from orchestrator.controller.training_cache import (
    cache_enabled,
    cache_request,
    seeding_lines,
    seeding_status,
)
from orchestrator.controller.weights import WeightsUnavailable, mirror_weights, record_deliveries
from orchestrator.lifecycle import JobState
from orchestrator.scheduler.cluster_view import bundle_of
from orchestrator.scheduler.reasons import never_fits_cause
from orchestrator.storage.checkpoints import Manifest
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.prices import read_prices
from orchestrator.storage.records import Failure, Hold
from orchestrator.storage.weights import WeightSet


class DeployFailed(Exception):
    """The job could not be put on nodes; `failure` says why."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.cause)
        self.failure = failure


class Deployment:
    """Puts the job's run on its nodes and keeps what a replaced rank is prepared with."""

    def __init__(
        self, run: JobRun, store: JobStore, queue: JobQueue, scheduling_timeout_s: float
    ) -> None:
        self.run = run
        self.store = store
        self.queue = queue
        self.scheduling_timeout_s = scheduling_timeout_s
        self.weight_sets: list[WeightSet] = []  # mirrored sets, in the order of `weights`
        self.prepare_request: PrepareRequest | None = None  # a replacement node's, too

    def mirror_weights(self) -> None:
        """While CREATED, before any compute is reserved: every source into the mirror."""
        run = self.run
        sources = run.record.spec.job.weights
        if not sources:
            return
        run.say(f"mirroring {len(sources)} weights source(s) into the storage root")
        try:
            self.weight_sets = mirror_weights(
                run.record.storage_root,
                run.record.team,
                sources,
                run.say,
                lambda statuses: run.amend(weights=statuses),
                run.stop_requested.is_set,
            )
        except WeightsUnavailable as e:
            raise DeployFailed(Failure(cause=str(e))) from None
        run.check_stop()

    def place_and_prepare(self, nodes: JobNodes, plan: GroupPlan) -> None:
        """Admitted by the queue, `plan` placed, every rank prepared: the first start's path
        and a requeued job's."""
        self._admit()
        self._reserve(nodes, plan)
        self._deploy(nodes, plan)

    def place_again(self, nodes: JobNodes, ranks: list[int]) -> None:
        """Lost `ranks` placed again (PENDING meanwhile), with new agents; GroupError if there
        is no room."""
        group = nodes.group
        old = [group.node_ids[rank] for rank in ranks if rank in group.node_ids]
        group.drop(ranks)
        nodes.placement.place_again(
            ranks, old, nodes.judge, self.scheduling_timeout_s, self._pending,
            self.run.check_stop,
        )  # fmt: skip
        group.replace(ranks)
        self.queue_call(self.queue.placed, nodes.placement.placed_nodes())  # a rank moved

    def prepare_again(self, nodes: JobNodes, ranks: list[int]) -> list[PreparedNode]:
        """Replaced `ranks` prepared with the first prepare's request."""
        assert self.prepare_request is not None
        return nodes.group.prepare(self.prepare_request, self.run.check_stop, ranks)

    def queue_call(self, call: Callable[..., Any], *args: Any) -> None:
        """A call the job goes on without: the queue service rebuilds from storage."""
        try:
            call(*args)
        except Exception as e:
            self.run.say(f"the queue service: {short_error(e)}")

    def leave_queue(self) -> None:
        self.queue_call(self.queue.release)

    def release_hold(self) -> None:
        """The job's nodes are let go of: the books stop counting what it held."""
        holds = self.run.status.holds
        if holds and holds[-1].until is None:
            ended = holds[-1].model_copy(update={"until": time.time()})
            self.run.amend(holds=[*holds[:-1], ended])

    def _hold(self) -> None:
        """Admitted: from now the job holds its nodes, at the cluster's prices now."""
        record = self.run.record
        try:
            prices = rates(read_prices(self.store.root))
        except Exception as e:  # the books lack a price; the job goes on
            self.run.say(f"the cluster's prices could not be read ({short_error(e)}): "
                         "this admission is costed at none")  # fmt: skip
            prices = {}
        compute = record.spec.job.compute
        hold = Hold(since=time.time(), bundle=bundle_of(compute), nodes=compute.node_count,
                    prices=prices)  # fmt: skip
        self.run.amend(holds=[*self.run.status.holds, hold])

    # --- the steps ---------------------------------------------------------------------------

    def _pending(self, reason: str) -> None:
        self.run.transition(JobState.PENDING, reason)

    def _admit(self) -> None:
        """Wait in the cluster's queue until the job may reserve its nodes."""
        try:
            borrowed = self.queue.wait_admitted(
                self.run.record.queue_timeout_s, self._pending, self.run.check_stop
            )
        except NeverFits as e:
            raise DeployFailed(Failure(cause=never_fits_cause(str(e)))) from None
        except (QueueTimeout, QueueUnavailable) as e:
            raise DeployFailed(Failure(cause=str(e))) from None
        self._hold()
        if borrowed:
            self.run.say(
                "admitted on idle capacity beyond team "
                f"{self.run.record.team}'s quota: borrowed, so the first to be preempted when "
                "its owners need it back"
            )

    def _reserve(self, nodes: JobNodes, plan: GroupPlan) -> None:
        placement = nodes.placement
        try:
            placement.reserve(plan, self.scheduling_timeout_s, self._pending, self.run.check_stop)
        except GroupError as e:
            raise DeployFailed(Failure(cause=str(e))) from None
        self.queue_call(self.queue.placed, placement.placed_nodes())

    def _deploy(self, nodes: JobNodes, plan: GroupPlan) -> None:
        run = self.run
        run.check_stop()
        run.transition(JobState.DEPLOYING, f"preparing {plan.size} node(s)")
        try:
            loads = resolve_checkpoints(run.record, self.store)
        except CheckpointNotFound as e:
            raise DeployFailed(Failure(cause=str(e))) from None
        if loads:
            names = sorted({f"{m.job_id}/{m.name}" for m in loads})
            run.say(f"loading checkpoint(s) {', '.join(names)} on every node")
        nodes.group.create(plan)
        prepared = self._prepare(nodes, plan, loads)
        weights = [w.model_copy(update={"nodes": []}) for w in run.status.weights]
        record_deliveries(weights, prepared, run.say)
        updates: dict[str, Any] = {"nodes": [p.node_info() for p in prepared], "weights": weights}
        if cache_enabled(run.record):
            updates["cache"] = seeding_status(prepared, nodes.placement.cache_affinity)
            run.lines(seeding_lines(updates["cache"]))
        run.amend(**updates)
        if nodes.group.uploaders is not None:
            nodes.group.uploaders.wait_ready()  # watching before any command runs

    def _prepare(
        self, nodes: JobNodes, plan: GroupPlan, loads: list[Manifest]
    ) -> list[PreparedNode]:
        record = self.run.record
        job = record.spec.job
        load_config = job.runtime.load_checkpoint_config
        self.prepare_request = request = PrepareRequest(
            archive_path=record.archive.path,
            sha256=record.archive.sha256,
            checkpoint_dir=job.runtime.checkpointing_config.checkpoint_path,
            secret_names=tuple(
                sorted({ref.name for ref in job.runtime.secret_references().values()})
            ),
            load=tuple(loads),
            download_folder=load_config.download_folder if load_config else None,
            weights=tuple(
                WeightPlacement(ws, w.normalized_mount)
                for ws, w in zip(self.weight_sets, job.weights, strict=True)
            ),
            cache=cache_request(record),
            image=plan.runtime.image_request(),
        )
        try:
            return nodes.group.prepare(request, self.run.check_stop)
        except GroupError as e:
            raise DeployFailed(Failure(cause=str(e))) from e

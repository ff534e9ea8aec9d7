"""The callback Ray Train loads through RAY_TRAIN_CALLBACKS, which puts a Ray Train job's workers
inside the job's own placement group and leaves retries to orchestrator.

The queue admitted the job's nodes as the group `orchestrator-<job id>` (one bundle per node);
Train would make a group of its own, racing every other piece of work for the GPUs between our
release and its placement (docs/design/ray-train.md, P2). So in Train's controller process this
callback swaps Train's worker group for one that borrows our group (`_create_placement_group`),
puts worker i in bundle i // workers_per_node (`_create_workers`), keeps Train's placement-group
cleaner off our group, and turns every RETRY Train decides into the end of the attempt: one
retry budget, the job's `--retries`. It also stores every round Train collects (each worker's
`ray.train.report` metrics, the checkpoint's name) with the job (storage/train_reports.py), on
a thread of its own so that training never waits on storage.

Checkpoints: in the driver, before Train reads it, the script's RunConfig is pointed at each
node's own checkpoint directory (agents/ray_train_storage.py). A directory there is a
checkpoint only once Train commits it (every worker reported its round): then this callback
tells the uploader of each node that wrote a part of it, which uploads that part, and the round
it stores names those nodes, so a retry knows when every part is stored (whole). Importing this
module with a Ray whose Train lacks a seam raises RayTrainSeamsMissing naming the version
(ray_train_seams.py).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import ray
from ray.util.placement_group import PlacementGroup, placement_group_table

from orchestrator import actor_names
from orchestrator.agents.rank_program import WORKERS_SAID
from orchestrator.agents.ray_train_seams import (
    TRAIN_CHECKPOINT_PATH_ENV,
    TRAIN_PG_ENV,
    TRAIN_REPORTS_ROOT_ENV,
    TRAIN_WORKERS_ENV,
    calling_trainer,
    seams,
)
from orchestrator.agents.ray_train_storage import redirect
from orchestrator.storage.retry import StorageRetry
from orchestrator.storage.root import StorageRoot
from orchestrator.storage.train_reports import TrainReportWriter, TrainRunHeader, train_round

_seams = seams()  # every private attribute below was found and checked here, once
FINISH_FLUSH_S = 15.0  # what a finished run waits, at most, for its last reports to be stored
ABORT_FLUSH_S = 2.0  # the same for an aborted one (a stop: the controller is about to exit)


class NotAnOrchestratorTrainJob(RuntimeError):
    """The callback was named in RAY_TRAIN_CALLBACKS outside a job that set up its group."""


class AdmittedShapeMismatch(RuntimeError):
    """The script's ScalingConfig asks for other workers than the job was admitted with.
    Not one of Train's retryable controller errors: Train ends the run with it."""


class TrainRetryRefused(RuntimeError):
    """Train wanted to retry; the job's own retries decide (also not retryable for Train)."""


@dataclass(frozen=True)
class Admission:
    """What the queue admitted the job with: its group's name and its number of Train workers."""

    placement_group: str
    workers: int

    @classmethod
    def from_env(cls) -> Admission:
        name, workers = os.environ.get(TRAIN_PG_ENV), os.environ.get(TRAIN_WORKERS_ENV, "")
        if not name or not workers.isdigit() or int(workers) < 1:
            raise NotAnOrchestratorTrainJob(
                f"RAY_TRAIN_CALLBACKS names orchestrator's callback, but {TRAIN_PG_ENV}="
                f"{name!r} and {TRAIN_WORKERS_ENV}={workers!r} are not a job's group and worker "
                "count: run this script as an orchestrator job with ray_train set in its config"
            )
        return cls(name, int(workers))


@dataclass(frozen=True)
class ReportTarget:
    """Where the job's rounds are stored: its storage root, id and attempt (read in the driver;
    None outside a job that says, and nothing is stored)."""

    storage_url: str
    job_id: str
    attempt: int

    @classmethod
    def from_env(cls) -> ReportTarget | None:
        url, job = os.environ.get(TRAIN_REPORTS_ROOT_ENV), os.environ.get("BT_TRAINING_JOB_ID")
        if not url or not job:
            return None
        attempt = os.environ.get("BT_RETRY_COUNT", "")
        return cls(url, job, int(attempt) if attempt.isdigit() else 0)

    def writer(self, train_run_context: Any) -> TrainReportWriter:
        """A writer for this run that never waits out an outage: it tries again itself."""
        header = TrainRunHeader(
            job_id=self.job_id, run_id=str(train_run_context.run_id),
            run_name=str(train_run_context.run_config.name or ""), attempt=self.attempt,
            started_at=time.time(),
        )  # fmt: skip
        root = StorageRoot(self.storage_url, StorageRetry(self.storage_url, 0, say=_say))
        return TrainReportWriter(root, header, say=_say)


def shape_problem(
    admission: Admission, bundles: list[dict[str, float]], num_workers: int,
    resources_per_worker: dict[str, float],
) -> str | None:  # fmt: skip
    """Why the script's workers cannot run in the admitted bundles, with the fix; None: they fit."""
    if num_workers != admission.workers:
        return (
            f"the script asks for {num_workers} Ray Train workers, the job was admitted with "
            f"{admission.workers}: set ScalingConfig(num_workers={admission.workers})"
        )
    if not bundles or num_workers % len(bundles):
        return (
            f"{num_workers} Ray Train workers do not divide evenly over the job's "
            f"{len(bundles)} node(s): set ray_train.workers_per_node in the job's config"
        )
    per_node = num_workers // len(bundles)
    for index, bundle in enumerate(bundles):
        for resource, amount in resources_per_worker.items():
            if bundle.get(resource, 0) + 1e-9 < amount * per_node:
                return (
                    f"{per_node} Ray Train workers asking {resource}={amount:g} each do not fit "
                    f"node {index}'s share of the job ({bundle}): ask at most "
                    f"{bundle.get(resource, 0) / per_node:g} {resource} per worker in "
                    "ScalingConfig(resources_per_worker=...), or fewer ray_train.workers_per_node"
                )
    return None


def job_group(name: str) -> PlacementGroup:
    """The job's placement group by name, whatever Ray namespace made it (the user's driver
    runs in a namespace of its own, the job's controller made the group in another)."""
    live = [g for g in placement_group_table().values()
            if g.get("name") == name and g.get("state") != "REMOVED"]  # fmt: skip
    if not live:
        raise NotAnOrchestratorTrainJob(
            f"the job's placement group {name!r} is not there: its nodes were given back "
            "(the job was stopped or preempted), so Ray Train has nowhere to run"
        )
    return PlacementGroup(ray.PlacementGroupID.from_hex(live[0]["placement_group_id"]))


class BorrowedPlacementGroupHandle(_seams.DefaultPlacementGroupHandle):
    """The job's group lent to Train: Train's shutdown of it does nothing, the job removes it."""

    def shutdown(self) -> None:
        pass


class BorrowedPlacementWorkerGroup(_seams.WorkerGroup):
    """Train's worker group, placed in the job's group rather than in one of its own."""

    admission: ClassVar[Admission | None] = None  # set in the controller's process (install)

    def _create_placement_group(self, scaling_config: Any, worker_group_context: Any) -> Any:
        admission = self.admission
        assert admission is not None, "install() sets the admission before the first start"
        group = job_group(admission.placement_group)
        problem = shape_problem(admission, group.bundle_specs, worker_group_context.num_workers,
                                dict(worker_group_context.resources_per_worker))  # fmt: skip
        if problem:
            raise AdmittedShapeMismatch(problem)
        return BorrowedPlacementGroupHandle(group)

    def _create_workers(self, num_workers: int, placement_group: PlacementGroup,
                        resources_per_worker: dict[str, float],
                        placement_group_bundle_indices: list[int] | None = None,
                        **kwargs: Any) -> Any:  # fmt: skip
        if placement_group_bundle_indices is None:  # one bundle per node: i // workers per node
            per_node = num_workers // len(placement_group.bundle_specs)
            placement_group_bundle_indices = [i // per_node for i in range(num_workers)]
        return super()._create_workers(
            num_workers, placement_group, resources_per_worker,
            placement_group_bundle_indices=placement_group_bundle_indices, **kwargs,
        )  # fmt: skip


def install(admission: Admission) -> None:
    """In Train's controller process (one controller a process): its worker groups borrow the
    job's group, and Train's cleaner, which removes a dead controller's group, never sees it."""
    BorrowedPlacementWorkerGroup.admission = admission
    _seams.TrainController.worker_group_cls = BorrowedPlacementWorkerGroup
    cleaner = _seams.PlacementGroupCleanerCallback
    original = cleaner.after_worker_group_start
    if getattr(original, "_keeps_jobs_group", False):
        return

    def after_worker_group_start(callback: Any, worker_group: Any) -> Any:
        handle = worker_group.get_worker_group_state().placement_group_handle
        if isinstance(handle, BorrowedPlacementGroupHandle):
            return None  # the job's reservation: the job removes it, never Train
        return original(callback, worker_group)

    after_worker_group_start._keeps_jobs_group = True  # type: ignore[attr-defined]
    cleaner.after_worker_group_start = after_worker_group_start


class OrchestratorTrainCallback(
    _seams.ControllerCallback, _seams.WorkerGroupCallback, _seams.ReportCallback
):
    """Made in the user's driver (reading the job's admission there), pickled to Train's
    controller, where it installs the borrowing, refuses Train's retries and stores the
    reports (its writer is made there: a thread does not pickle)."""

    def __init__(self) -> None:
        self._admission = Admission.from_env()
        self._reports_to = ReportTarget.from_env()
        self._job_id = os.environ.get("BT_TRAINING_JOB_ID", "")
        self._uploads = "BT_CHECKPOINT_DIR" in os.environ  # the job's nodes have uploaders
        self._writer: TrainReportWriter | None = None
        self._rounds = 0
        self._failures: dict[int, str] = {}  # rank -> its last error's first line
        self._nodes: list[int] = []  # worker rank -> the node rank (bundle) it runs on
        self._parts: dict[str, set[int]] = {}  # checkpoint -> nodes whose workers wrote to it
        self._pending: list[tuple[int, float, list[dict[str, Any]], str | None]] = []
        self._point_at_nodes()

    def _point_at_nodes(self) -> None:
        """Made in the driver by the trainer's fit(): its RunConfig goes to the nodes'
        checkpoint directories before Train reads it (agents/ray_train_storage.py)."""
        if not self._job_id:
            return  # Train's seams tried outside a job (tests/test_ray_train_seams.py)
        trainer = calling_trainer()
        if trainer is None:
            raise NotAnOrchestratorTrainJob(
                "orchestrator's Ray Train callback was not made by a trainer's fit() (Ray "
                "Train's RAY_TRAIN_CALLBACKS): the job's checkpoints would have nowhere to go"
            )
        run_config = trainer.run_config
        count = os.environ.get("BT_RETRY_COUNT", "0")
        attempt = None if self._uploads else int(count) if count.isdigit() else 0
        asked = redirect(run_config, self._job_id, self._admission.placement_group,
                         os.environ.get(TRAIN_CHECKPOINT_PATH_ENV) or None, attempt)  # fmt: skip
        if asked is not None:
            _say(f"Ray Train run {run_config.name!r}: checkpoints are written to each node's "
                 f"$BT_CHECKPOINT_DIR and stored with the job, not to RunConfig.storage_path "
                 f"{asked!r}")  # fmt: skip

    def after_controller_start(self, train_run_context: Any) -> None:
        install(self._admission)
        if self._reports_to is not None:
            try:
                self._writer = self._reports_to.writer(train_run_context)
            except Exception as e:  # training goes on without its reports, saying why
                _say(f"Ray Train reports will not be stored: {type(e).__name__}: {e}")

    def after_report(self, training_report: Any, metrics: list[dict[str, Any]]) -> None:
        """One round, every worker's report in: stored by the writer's thread, never here."""
        if self._writer is None:
            return
        checkpoint = training_report.checkpoint
        name = None if checkpoint is None else _dir_name(checkpoint.path)
        # Committed: stored, and its parts uploaded, once this poll's reports say whose they
        # are (after_worker_group_poll_status, called next with the same poll).
        self._pending.append((self._rounds, time.time(), list(metrics), name))
        self._rounds += 1

    def after_worker_group_start(self, worker_group: Any) -> None:
        workers = worker_group.get_workers()  # by world rank
        self._nodes = [w.placement_group_bundle_index or 0 for w in workers]
        self._parts = {}
        # Which pid is which rank: the job's log puts the rank in each worker's lines.
        _say(f"{WORKERS_SAID} " + "; ".join(
            f"rank {i} is pid {w.metadata.pid} on node rank {self._nodes[i]}"
            for i, w in enumerate(workers)
        ))  # fmt: skip

    def _commit(self) -> None:
        """Each round Train collected: stored with the nodes that wrote a part of its
        checkpoint, and those nodes' uploaders told to upload their part (never waited on)."""
        for index, at, metrics, name in self._pending:
            parts = sorted(self._parts.pop(name, ())) if name else None
            if self._writer is not None:
                try:
                    self._writer.add(train_round(index, at, metrics, name, parts))
                except Exception as e:  # never the run's failure: a report we could not read
                    _say(f"Ray Train report {index} not stored: {type(e).__name__}: {e}")
            if name and self._uploads:
                for rank in parts or ():
                    self._tell_uploader(rank, name, parts or [])
        self._pending = []

    def _tell_uploader(self, rank: int, name: str, parts: list[int]) -> None:
        try:
            uploader = ray.get_actor(actor_names.checkpoint_uploader(self._job_id, rank),
                                     namespace=actor_names.NAMESPACE)  # fmt: skip
            uploader.train_committed.remote(name, parts)
        except Exception as e:  # its node is gone: the checkpoint is not whole, a retry says
            _say(f"Ray Train checkpoint {name}: rank {rank}'s uploader not told: {e}")

    def after_controller_finish(self, result: Any) -> None:
        self._commit()
        if self._writer is not None:
            self._writer.close(FINISH_FLUSH_S)

    def before_controller_abort(self) -> None:
        if self._writer is not None:
            self._writer.close(ABORT_FLUSH_S)

    def after_worker_group_poll_status(self, worker_group_status: Any) -> None:
        statuses = worker_group_status.worker_statuses
        for i in range(len(statuses)):
            report = statuses[i].training_report
            if report is not None and report.checkpoint is not None and i < len(self._nodes):
                self._parts.setdefault(_dir_name(report.checkpoint.path), set()).add(self._nodes[i])
        self._commit()
        errors = worker_group_status.errors
        if errors:
            self._failures = {rank: _first_line(e) for rank, e in sorted(errors.items())}

    def before_controller_execute_failure_decision(self, failure_decision: Any) -> None:
        if failure_decision != _seams.FailureDecision.RETRY:
            return
        failed = "; ".join(f"rank {r}: {line}" for r, line in self._failures.items())
        raise _seams.ControllerError(
            TrainRetryRefused(
                f"a Ray Train worker failed ({failed or 'the worker group could not start'}). "
                "Ray Train's own retries (FailureConfig) are not used in an orchestrator job: "
                "the job's retries are (push --retries), so this attempt ends here"
            )
        )


def _dir_name(path: Any) -> str:
    return os.path.basename(str(path).rstrip("/"))


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return f"{type(error).__name__}: {text.splitlines()[0][:300]}"


def _say(line: str) -> None:
    """Into the controller's output, which reaches the driver's and so the job's log."""
    print(f"orchestrator: {line}", file=sys.stderr, flush=True)

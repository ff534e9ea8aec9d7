"""Drives one job through its states: reserve nodes, prepare them, run, record how it ended.

Runs as the entrypoint of the job's Ray job. Every transition is written to the storage root
before the next step starts, so a reader (or a later controller) always sees the truth; while
the storage root is unreachable the job goes on and its journal stores lines and states, in
order, once it is back (storage/journal.py).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from orchestrator import settings
from orchestrator.agents.messages import (
    PreparedNode,
    PrepareRequest,
    WeightPlacement,
)
from orchestrator.agents.secret_service import start_secret_service
from orchestrator.agents.services import NAMESPACE
from orchestrator.controller.attempts import (
    STOP_GRACE_S,
    Attempts,
    Unrecoverable,
    attempt_causes,
)
from orchestrator.controller.checkpointing import (
    CheckpointNotFound,
    RankEnding,
    resolve_checkpoints,
)
from orchestrator.controller.node_group import (
    IMAGE_URI_ENV,
    NodeGroup,
    NodeGroupError,
    RayNodeGroup,
    short_error,
    use_image_uri,
)
from orchestrator.controller.queueing import (
    JobQueue,
    NeverFits,
    QueueTimeout,
    QueueUnavailable,
    RayJobQueue,
)
from orchestrator.controller.session import hold_until, requested_until
from orchestrator.controller.training_cache import (
    cache_enabled,
    cache_request,
    seeding_lines,
    seeding_status,
    write_back_line,
)
from orchestrator.controller.weights import WeightsUnavailable, mirror_weights, record_deliveries
from orchestrator.home import orchestrator_home
from orchestrator.lifecycle import CHECKPOINTS_NOT_STORED_EXIT, OUTCOME_NOT_STORED_EXIT, JobState
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.journal import JobJournal, spill_dir
from orchestrator.storage.records import (
    CacheStatus,
    Failure,
    JobRecord,
    JobStatus,
    WeightsStatus,
)
from orchestrator.storage.retry import ON_ERROR_ENV, StorageRetry

__all__ = ["IMAGE_URI_ENV", "JobController", "run_controller", "use_image_uri"]

POLL_S = 0.2
WRITE_BACK_S = 600.0
STOP_FLUSH_S = 40.0  # within the 60 s RAY_JOB_STOP_WAIT_TIME_S, after the commands' grace
RESULT_WAIT_S = 5.0  # for a stopped rank's result to come through its stream
STORED_WAIT_S = 10.0  # a transition waits this long to be stored (not at all in an outage)
STOPPED_CLOSE_S = 5.0  # what a stopped job's journal has left of Ray's stop grace
SESSION_POLL_S = 1.0  # a held job looks for `isession` requests and a stop this often


class JobStopped(Exception):
    """A stop was requested (SIGTERM from `ray job stop` / `orchestrator stop`)."""


class StorageLost(Exception):
    """The job's logs and status cannot be stored and ORCHESTRATOR_ON_STORAGE_ERROR=stop."""


class DeployFailed(Exception):
    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.cause)
        self.failure = failure


NodeGroupFactory = Callable[[JobRecord, Callable[[str], None]], NodeGroup]
QueueFactory = Callable[[JobRecord, Callable[[str], None]], JobQueue]


class JobController:
    """The job's sequence: each step recorded before the next; the nodes are a NodeGroup."""

    def __init__(
        self,
        store: JobStore,
        job_id: str,
        scheduling_timeout_s: float,
        node_group: NodeGroupFactory = RayNodeGroup,
        queue: QueueFactory = RayJobQueue,
    ) -> None:
        self.store = store
        self.record: JobRecord = store.record(job_id)
        self.status: JobStatus = store.status(job_id)
        self.scheduling_timeout_s = scheduling_timeout_s
        self.journal = JobJournal(
            store.root, job_id, spill_dir(orchestrator_home(), job_id), self.say
        )
        # From here on, an outage is said once in the job's lines, with the job's budget.
        outage_s = self.record.storage.outage_s
        store.root.retry = StorageRetry(store.root.url, outage_s, say=self.say)
        self.unstored: list[str] = []  # what could not be stored when the job ended
        self.stop_requested = threading.Event()
        self.node_group = node_group
        self.nodes: NodeGroup = node_group(self.record, self.say)
        self.queue: JobQueue = queue(self.record, self.say)
        self.weight_sets: list[dict[str, Any]] = []  # mirrored sets, in the order of `weights`
        self.running_since = 0.0
        self.prepare_request: PrepareRequest | None = None  # a replacement node's, too

    # --- state -----------------------------------------------------------------------------

    def move(self, state: JobState, reason: str | None = None, **updates: Any) -> None:
        status = self.status.moved_to(state, reason).model_copy(update=updates)
        # Lines first: a reader that sees the new state has every line written before it.
        self.say(f"{state.value}" + (f": {reason}" if reason else ""))
        self.status = status
        self.journal.status(status)
        self.journal.wait_stored(STORED_WAIT_S)

    def say(self, message: str) -> None:
        """A controller line, in the Ray job log and the stored logs."""
        line = f"[orchestrator {time.strftime('%H:%M:%S')}] {message}"
        print(line, flush=True)
        self.journal.lines([line])

    def _check_stop(self) -> None:
        if self.stop_requested.is_set():
            raise JobStopped()
        if self.journal.problem and self.record.storage.on_error == "stop":
            raise StorageLost(self.journal.problem)

    # --- the run ---------------------------------------------------------------------------

    def run(self) -> JobState:
        if self.status.state.is_terminal:
            self.say(f"job already ended {self.status.state.value}; nothing to do")
            return self.status.state
        self.say(self._image_notice())
        try:
            if self.record.spec.job.secret_references():
                start_secret_service()  # on this node, the head: where `secrets set` writes
            self._mirror_weights()
            self._admit()
            self._reserve()
            self._deploy()
            Attempts(self).run()
        except JobStopped:
            self._stop_agents()
            self._finish(JobState.STOPPED, "stopped by user")
        except StorageLost as e:
            self._stop_agents()
            cause = (
                f"stopped: the storage root {self.store.root.url} does not take the job's "
                f"logs and status ({e}), and {ON_ERROR_ENV}=stop"
            )
            self._finish(JobState.FAILED, cause, failure=Failure(cause=cause))
        except DeployFailed as e:
            self.move(JobState.DEPLOY_FAILED, e.failure.cause, failure=e.failure)
        except Unrecoverable as e:
            causes = attempt_causes(self.status.attempts)
            cause = f"the job could not be retried: {e}; " + "; ".join(causes)
            self._stop_agents()
            self._finish(JobState.FAILED, cause, failure=Failure(cause=cause, attempts=causes))
        except Exception as e:  # a bug or an infrastructure failure: record it, never hang
            failure = Failure(cause=f"controller error: {type(e).__name__}: {e}")
            ran = self.status.state == JobState.RUNNING or self.status.attempts
            state = JobState.FAILED if ran else JobState.DEPLOY_FAILED
            self.move(state, failure.cause, failure=failure)
        finally:
            self._release()
            self._leave_queue()
            self._close_journal()
        return self.status.state

    def _close_journal(self) -> None:
        """Store what waits; a stopped job has only what is left of Ray's stop grace."""
        stopped = self.status.state == JobState.STOPPED
        self.unstored = self.journal.close(
            STOPPED_CLOSE_S if stopped else self.record.storage.outage_s
        )
        if self.unstored:
            line = f"could not be stored in {self.store.root.url}: " + "; ".join(self.unstored)
            print(f"[orchestrator {time.strftime('%H:%M:%S')}] {line}", flush=True)

    def _image_notice(self) -> str:
        image = self.record.spec.job.image.base_image
        if use_image_uri():
            return f"image {image}: each node runs the job in that container (Ray image_uri)"
        return (
            f"image {image} is recorded; this cluster runs jobs in each node's own environment "
            f"(set {IMAGE_URI_ENV}=1 on a cluster with a container runtime to use it)"
        )

    def _mirror_weights(self) -> None:
        """While CREATED, before any compute is reserved: every source into the mirror."""
        sources = self.record.spec.job.weights
        if not sources:
            return
        self.say(f"mirroring {len(sources)} weights source(s) into the storage root")
        try:
            self.weight_sets = mirror_weights(
                self.record.storage_root,
                self.record.team,
                sources,
                self.say,
                self._publish_weights,
                self.stop_requested.is_set,
            )
        except WeightsUnavailable as e:
            raise DeployFailed(Failure(cause=str(e))) from None
        self._check_stop()

    def _publish_weights(self, statuses: list[WeightsStatus]) -> None:
        self.status = self.status.model_copy(update={"weights": statuses})
        self.journal.status(self.status)

    def _admit(self) -> None:
        """Wait in the cluster's queue until the job may reserve its nodes."""
        try:
            borrowed = self.queue.wait_admitted(
                self.record.queue_timeout_s,
                lambda reason: self.move(JobState.PENDING, reason),
                self._check_stop,
            )
        except NeverFits as e:
            autoscales = settings.CLUSTER_AUTOSCALES.name
            cause = (
                f"cannot be placed on this cluster even when it is idle: {e}. If nodes join on "
                f"demand (an autoscaler), set {autoscales}=1 in the head node's `ray start` "
                "environment and such a job waits for them"
            )
            raise DeployFailed(Failure(cause=cause)) from None
        except (QueueTimeout, QueueUnavailable) as e:
            raise DeployFailed(Failure(cause=str(e))) from None
        if borrowed:
            self.say(
                "admitted on idle capacity beyond team "
                f"{self.record.team}'s quota: borrowed, so the first to be preempted when its "
                "owners need it back"
            )

    def _reserve(self) -> None:
        try:
            self.nodes.reserve(
                self.scheduling_timeout_s,
                lambda reason: self.move(JobState.PENDING, reason),
                self._check_stop,
            )
        except NodeGroupError as e:
            raise DeployFailed(Failure(cause=str(e))) from None
        self._queue_call(self.queue.placed, self.nodes.placed_nodes())

    def _leave_queue(self) -> None:
        self._queue_call(self.queue.release)

    def _queue_call(self, call: Callable[..., Any], *args: Any) -> None:
        """A call the job goes on without: the queue service rebuilds from storage."""
        try:
            call(*args)
        except Exception as e:
            self.say(f"the queue service: {short_error(e)}")

    def _deploy(self) -> None:
        self._check_stop()
        compute = self.record.spec.job.compute
        self.move(JobState.DEPLOYING, f"preparing {compute.node_count} node(s)")
        try:
            loads = resolve_checkpoints(self.record, self.store)
        except CheckpointNotFound as e:
            raise DeployFailed(Failure(cause=str(e))) from None
        if loads:
            names = sorted({f"{m.job_id}/{m.name}" for m in loads})
            self.say(f"loading checkpoint(s) {', '.join(names)} on every node")
        self.nodes.create()
        prepared = self._prepare(loads)
        nodes = [p.node_info() for p in prepared]
        weights = [w.model_copy(update={"nodes": []}) for w in self.status.weights]
        record_deliveries(weights, prepared, self.say)
        updates: dict[str, Any] = {"nodes": nodes, "weights": weights}
        if cache_enabled(self.record):
            updates["cache"] = seeding_status(prepared, self.nodes.cache_affinity)
            self._say_lines(seeding_lines(updates["cache"]))
        self.status = self.status.model_copy(update=updates)
        if self.nodes.uploaders is not None:
            self.nodes.uploaders.wait_ready()  # watching before any command runs

    def _prepare(self, loads: list[Any]) -> list[PreparedNode]:
        job = self.record.spec.job
        load_config = job.runtime.load_checkpoint_config
        self.prepare_request = request = PrepareRequest(
            archive_path=self.record.archive.path,
            sha256=self.record.archive.sha256,
            checkpoint_dir=job.runtime.checkpointing_config.checkpoint_path,
            secret_names=tuple(
                sorted({ref.name for ref in job.runtime.secret_references().values()})
            ),
            load=tuple(m.model_dump() for m in loads),
            download_folder=load_config.download_folder if load_config else None,
            weights=tuple(
                WeightPlacement(ws, w.normalized_mount)
                for ws, w in zip(self.weight_sets, job.weights, strict=True)
            ),
            cache=cache_request(self.record),
        )
        try:
            return self.nodes.prepare(request, self._check_stop)
        except NodeGroupError as e:
            raise DeployFailed(Failure(cause=str(e))) from e

    def complete(self) -> None:
        """Every command of the last attempt exited 0."""
        self._hold_for_session(failed=False, why="all commands exited 0")
        self._finish(JobState.COMPLETED, "all commands exited 0")

    def fail(self, state: JobState, failure: Failure) -> None:
        """The job ends badly (`state`: FAILED, PREEMPTED): its commands are stopped already
        or now, its nodes held if an interactive session asks."""
        self._stop_agents()
        self._hold_for_session(failed=True, why=failure.cause)
        self._finish(state, failure.cause, failure=failure)

    def _rank_lines(self, lines: list[str]) -> None:
        sys.stdout.write("".join(line + "\n" for line in lines))
        sys.stdout.flush()
        self.journal.lines(lines)

    def _hold_for_session(self, failed: bool, why: str) -> None:
        """Keep the nodes, their files and agents, as the interactive session asks; until its
        time is up (an `isession` request extends it) or the job is stopped."""
        session = self.record.spec.job.interactive_session
        if session is None:  # `isession` refuses such a job: nothing to read
            return
        root, job_id = self.store.root, self.record.job_id
        until = hold_until(
            session, failed, self.running_since, requested_until(root, job_id), time.time()
        )
        shown = None
        while until is not None and time.time() < until and not self.stop_requested.is_set():
            if until != shown:
                clock = time.strftime("%H:%M:%S", time.localtime(until))
                self.move(
                    JobState.RUNNING,
                    f"held for an interactive session until {clock} ({why}): orchestrator "
                    f"shell --job-id {job_id} -- CMD",
                    held_until=until,
                )
                shown = until
            time.sleep(SESSION_POLL_S)
            until = max(until, requested_until(root, job_id) or 0)
        if shown is not None:
            how = "stopped" if self.stop_requested.is_set() else "its time is up"
            self.say(f"interactive session over ({how}): releasing the nodes")
            self.status = self.status.model_copy(update={"held_until": None})

    def _finish(self, state: JobState, reason: str, **updates: Any) -> None:
        """Flush the checkpoints still on the nodes and write the cache back, then record the
        final state."""
        uploaders = self.nodes.uploaders
        if uploaders is not None:
            self.say("uploading the checkpoints still on the nodes")
            # A stopping job has until Ray's stop grace (RAY_JOB_STOP_WAIT_TIME_S) runs out.
            timeout = STOP_FLUSH_S if state == JobState.STOPPED else None
            runs = self.nodes.runs
            for run in runs:  # stopped or ended: each result follows its exit closely
                run.done.wait(RESULT_WAIT_S)
            endings = [run.ending(state) for run in runs] or [
                RankEnding(rank, clean=False, how="the job ended before its commands ran")
                for rank in range(len(uploaders.actors))
            ]
            events, summary = uploaders.flush(endings, timeout)
            self._say_lines(events)
            for problem in summary.problems():  # nothing quiet: each one, with why
                self.say(f"checkpoint {problem}")
            if not summary.all_uploaded:
                missing = ", ".join([*summary.pending, *summary.failed])
                self.say(f"checkpoints not uploaded: {missing}")
                reason += f", but checkpoints were not all stored (not stored: {missing})"
            updates["checkpoints"] = summary
        if self.status.cache is not None and self.status.nodes:
            updates["cache"] = self._write_back_cache(wait=state != JobState.STOPPED)
        self.move(state, reason, **updates)

    def _write_back_cache(self, wait: bool) -> CacheStatus:
        """The leader's changes to the caches go back to the storage root, whatever the end.

        Asked of rank 0's node seeder itself, which outlives the job: a stopping job, with
        little of Ray's stop grace left, does not wait for it.
        """
        assert self.status.cache is not None
        leader = self.status.nodes[0].node_id
        try:
            result = self.nodes.write_back_cache(leader, WRITE_BACK_S if wait else None)
        except Exception as e:
            error = short_error(e)
            self.say(f"training cache not written back: {error}")
            return self.status.cache.model_copy(update={"write_back_error": error})
        if result is None:
            self.say("training cache: rank 0's changes are being written back")
            return self.status.cache
        total, line = write_back_line(result)
        self.say(line)
        return self.status.cache.model_copy(update={"written_back": total})

    def _say_lines(self, lines: list[str]) -> None:
        if lines:
            print("\n".join(lines), flush=True)
            self.journal.lines(lines)

    def _stop_agents(self) -> None:
        error = self.nodes.stop(STOP_GRACE_S)
        if error:
            self.say(f"stopping the commands: {error}")

    def _release(self) -> None:
        summary = self.status.checkpoints
        self.nodes.release(keep_checkpoints=summary is None or not summary.all_uploaded)


def run_controller(job_id: str, storage_root: str, scheduling_timeout_s: float) -> int:
    """Entrypoint body: connect to the cluster, run the job, exit 0 only if it completed."""
    if not ray.is_initialized():
        ray.init(address="auto", namespace=NAMESPACE, log_to_driver=False)
    controller = JobController(JobStore(storage_root), job_id, scheduling_timeout_s)

    def on_sigterm(signum: int, frame: Any) -> None:
        controller.stop_requested.set()

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, on_sigterm)
    final = controller.run()
    if final != JobState.COMPLETED:
        return 1
    if controller.unstored:
        return OUTCOME_NOT_STORED_EXIT
    summary = controller.status.checkpoints
    # The commands succeeded but not every checkpoint was stored: not a plain success in Ray's
    # eyes either (the dashboard shows the job FAILED with this code, `ray job submit` exits 1).
    return CHECKPOINTS_NOT_STORED_EXIT if summary and not summary.all_uploaded else 0

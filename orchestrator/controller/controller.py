"""Drives one job through its states: reserve nodes, prepare them, run, record how it ended.

Runs as a thread of the controller host, or as the entrypoint of the job's own Ray job. Every
transition is written to the storage root before the next step starts, so a reader (or a later
controller) always sees the truth; while the storage root is unreachable the job goes on and its
journal stores lines and states, in order, once it is back (storage/journal.py). The run's
status is the JobRun's; getting onto nodes is the Deployment's; the attempts drive the
controller as their RunPort.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

import ray

from orchestrator.agents.messages import PreparedNode
from orchestrator.agents.secret_service import start_secret_service
from orchestrator.agents.services import NAMESPACE
from orchestrator.controller.attempts import (
    STOP_GRACE_S,
    Attempts,
    Unrecoverable,
    attempt_causes,
)
from orchestrator.controller.checkpointing import RankEnding
from orchestrator.controller.deployment import DeployFailed, Deployment
from orchestrator.controller.job_nodes import JobNodes, NodesFactory, ray_job_nodes
from orchestrator.controller.job_run import JobRun, JobStopped, StorageLost
from orchestrator.controller.plan import GroupPlan, SpecPlan
from orchestrator.controller.queueing import JobQueue, RayJobQueue
from orchestrator.controller.rank_group import short_error
from orchestrator.controller.session import hold_until, requested_until
from orchestrator.controller.training_cache import write_back_line
from orchestrator.lifecycle import CHECKPOINTS_NOT_STORED_EXIT, OUTCOME_NOT_STORED_EXIT, JobState
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.records import CacheStatus, Failure, JobRecord, JobStatus
from orchestrator.storage.retry import ON_ERROR_ENV, StorageRetry

__all__ = ["JobController", "run_controller"]

WRITE_BACK_S = 600.0
STOP_FLUSH_S = 40.0  # within the 60 s RAY_JOB_STOP_WAIT_TIME_S, after the commands' grace
RESULT_WAIT_S = 5.0  # for a stopped rank's result to come through its stream
SESSION_POLL_S = 1.0  # a held job looks for `isession` requests and a stop this often

QueueFactory = Callable[[JobRecord, Callable[[str], None]], JobQueue]


class JobController:
    """The job's sequence: each step recorded before the next; its nodes are JobNodes (where
    the ranks are placed, the ranks, the judge of faults), made by `nodes`.

    It is the RunPort its attempts drive (run_port.py): they decide, it acts on the nodes and
    the queue and ends the job.
    """

    def __init__(
        self,
        store: JobStore,
        job_id: str,
        scheduling_timeout_s: float,
        nodes: NodesFactory = ray_job_nodes,
        queue: QueueFactory = RayJobQueue,
        echo: TextIO | None = None,
    ) -> None:
        self.store = store
        self.job_run = JobRun(store, job_id, echo)
        self.record = self.job_run.record
        # From here on, an outage is said once in the job's lines, with the job's budget.
        outage_s = self.record.storage.outage_s
        store.root.retry = StorageRetry(store.root.url, outage_s, say=self.job_run.say)
        self.unstored: list[str] = []  # what could not be stored when the job ended
        self.plans = SpecPlan(self.record)
        self.plan = self.plans.plan(0)  # the first attempt's: what the job is placed for
        self.make_nodes = nodes
        self._nodes: JobNodes = nodes(self.record, self.job_run.say)
        self.queue: JobQueue = queue(self.record, self.job_run.say)
        self.deployment = Deployment(self.job_run, store, self.queue, scheduling_timeout_s)

    @property
    def status(self) -> JobStatus:
        return self.job_run.status

    @property
    def stop_requested(self) -> threading.Event:
        """Set to stop the job (SIGTERM, SIGINT)."""
        return self.job_run.stop_requested

    # --- the run ---------------------------------------------------------------------------

    def run(self) -> JobState:
        run = self.job_run
        if run.status.state.is_terminal:
            run.say(f"job already ended {run.status.state.value}; nothing to do")
            return run.status.state
        run.say(self.plan.runtime.notice())
        try:
            if problem := self.plan.runtime.problem():
                raise DeployFailed(Failure(cause=problem))
            if self.record.spec.job.secret_references():
                start_secret_service()  # on this node, the head: where `secrets set` writes
            self.deployment.mirror_weights()
            self.deployment.place_and_prepare(self._nodes, self.plan)
            Attempts(run, self, self.plan, self.plans).run()
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
            run.transition(JobState.DEPLOY_FAILED, e.failure.cause, failure=e.failure)
        except Unrecoverable as e:
            causes = attempt_causes(run.status.attempts)
            cause = f"the job could not be retried: {e}; " + "; ".join(causes)
            self._stop_agents()
            self._finish(JobState.FAILED, cause, failure=Failure(cause=cause, attempts=causes))
        except Exception as e:  # a bug or an infrastructure failure: record it, never hang
            failure = Failure(cause=f"controller error: {type(e).__name__}: {e}")
            ran = run.status.state == JobState.RUNNING or run.status.attempts
            state = JobState.FAILED if ran else JobState.DEPLOY_FAILED
            run.transition(state, failure.cause, failure=failure)
        finally:
            self._release()
            self.deployment.leave_queue()
            self.unstored = run.close()
        return run.status.state

    # --- the port its attempts drive (run_port.RunPort) --------------------------------------

    @property
    def nodes(self) -> JobNodes:
        return self._nodes

    def preemption(self) -> str | None:
        return self.queue.preemption()

    def replace(self, ranks: list[int]) -> None:
        self.deployment.place_again(self._nodes, ranks)

    def prepare(self, ranks: list[int]) -> list[PreparedNode]:
        return self.deployment.prepare_again(self._nodes, ranks)

    def requeue(self, reason: str, keep_checkpoints: bool, plan: GroupPlan) -> None:
        self._nodes.release(keep_checkpoints=keep_checkpoints)  # what is unstored stays there
        self.deployment.release_hold()
        self._nodes = self.make_nodes(self.record, self.job_run.say)
        self.job_run.transition(JobState.PENDING, f"{reason}; back in the queue")
        # Not a call to go on without: an entry still admitted (and marked preempted) would be
        # admitted again at once and preempted again, over and over.
        self.queue.requeue()
        self.deployment.place_and_prepare(self._nodes, plan)

    def complete(self) -> None:
        self._hold_for_session(failed=False, why="all commands exited 0")
        self._finish(JobState.COMPLETED, "all commands exited 0")

    def fail(self, state: JobState, failure: Failure) -> None:
        """Its commands are stopped already or now, its nodes held if an interactive session
        asks."""
        self._stop_agents()
        self._hold_for_session(failed=True, why=failure.cause)
        self._finish(state, failure.cause, failure=failure)

    # --- the end -----------------------------------------------------------------------------

    def _hold_for_session(self, failed: bool, why: str) -> None:
        """Keep the nodes, their files and agents, as the interactive session asks; until its
        time is up (an `isession` request extends it) or the job is stopped."""
        session = self.record.spec.job.interactive_session
        if session is None:  # `isession` refuses such a job: nothing to read
            return
        run, root, job_id = self.job_run, self.store.root, self.record.job_id
        until = hold_until(
            session, failed, run.running_since, requested_until(root, job_id), time.time()
        )
        shown = None
        while until is not None and time.time() < until and not run.stop_requested.is_set():
            if until != shown:
                clock = time.strftime("%H:%M:%S", time.localtime(until))
                run.transition(
                    JobState.RUNNING,
                    f"held for an interactive session until {clock} ({why}): orchestrator "
                    f"shell --job-id {job_id} -- CMD",
                    held_until=until,
                )
                shown = until
            time.sleep(SESSION_POLL_S)
            until = max(until, requested_until(root, job_id) or 0)
        if shown is not None:
            how = "stopped" if run.stop_requested.is_set() else "its time is up"
            run.say(f"interactive session over ({how}): releasing the nodes")
            run.amend(held_until=None)

    def _finish(self, state: JobState, reason: str, **updates: Any) -> None:
        """Flush the checkpoints still on the nodes and write the cache back, then record the
        final state."""
        run, group = self.job_run, self._nodes.group
        uploaders = group.uploaders
        if uploaders is not None:
            run.say("uploading the checkpoints still on the nodes")
            # A stopping job has until Ray's stop grace (RAY_JOB_STOP_WAIT_TIME_S) runs out.
            timeout = STOP_FLUSH_S if state == JobState.STOPPED else None
            for rank_run in group.runs:  # stopped or ended: each result follows its exit closely
                rank_run.done.wait(RESULT_WAIT_S)
            endings = [rank_run.ending(state) for rank_run in group.runs] or [
                RankEnding(rank, clean=False, how="the job ended before its commands ran")
                for rank in range(len(uploaders.actors))
            ]
            events, summary = uploaders.flush(endings, timeout)
            run.lines(events)
            for problem in summary.problems():  # nothing quiet: each one, with why
                run.say(f"checkpoint {problem}")
            if not summary.all_uploaded:
                missing = ", ".join([*summary.pending, *summary.failed])
                run.say(f"checkpoints not uploaded: {missing}")
                reason += f", but checkpoints were not all stored (not stored: {missing})"
            updates["checkpoints"] = summary
        if run.status.cache is not None and run.status.nodes:
            updates["cache"] = self._write_back_cache(wait=state != JobState.STOPPED)
        run.transition(state, reason, **updates)

    def _write_back_cache(self, wait: bool) -> CacheStatus:
        """The leader's changes to the caches go back to the storage root, whatever the end.

        Asked of rank 0's node seeder itself, which outlives the job: a stopping job, with
        little of Ray's stop grace left, does not wait for it.
        """
        run = self.job_run
        cache = run.status.cache
        assert cache is not None
        leader = run.status.nodes[0].node_id
        try:
            result = self._nodes.group.write_back_cache(leader, WRITE_BACK_S if wait else None)
        except Exception as e:
            error = short_error(e)
            run.say(f"training cache not written back: {error}")
            return cache.model_copy(update={"write_back_error": error})
        if result is None:
            run.say("training cache: rank 0's changes are being written back")
            return cache
        total, line = write_back_line(result)
        run.say(line)
        return cache.model_copy(update={"written_back": total})

    def _stop_agents(self) -> None:
        error = self._nodes.group.stop(STOP_GRACE_S)
        if error:
            self.job_run.say(f"stopping the commands: {error}")

    def _release(self) -> None:
        summary = self.job_run.status.checkpoints
        self._nodes.release(keep_checkpoints=summary is None or not summary.all_uploaded)
        self.deployment.release_hold()


def run_controller(job_id: str, storage_root: str, scheduling_timeout_s: float) -> int:
    """Entrypoint body: connect to the cluster, run the job, exit 0 only if it completed."""
    if not ray.is_initialized():
        ray.init(address="auto", namespace=NAMESPACE, log_to_driver=False)
    controller = JobController(JobStore(storage_root), job_id, scheduling_timeout_s)

    def on_sigterm(signum: int, frame: Any) -> None:
        controller.stop_requested.set()

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, on_sigterm)
    return exit_code(controller, controller.run())


def exit_code(controller: JobController, final: JobState) -> int:
    """How the controller's Ray job ends (its exit code; a hosted one's row says the same): 0
    only for a plain success. The commands succeeded but the outcome or not every checkpoint
    was stored: not a plain success in Ray's eyes either (the dashboard shows the job FAILED,
    `ray job submit` exits 1)."""
    if final != JobState.COMPLETED:
        return 1
    if controller.unstored:
        return OUTCOME_NOT_STORED_EXIT
    summary = controller.status.checkpoints
    return CHECKPOINTS_NOT_STORED_EXIT if summary and not summary.all_uploaded else 0

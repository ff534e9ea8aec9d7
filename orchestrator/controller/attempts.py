"""A job's attempts: the loop in Ray Train v2's shape that runs every rank's program and carries
the job over a fault when its retry policy says so (docs/architecture.md#the-attempt-loop).

One attempt is one run of the plan's programs on every rank (BT_RETRY_COUNT = its number): its
`GroupPlan` in, the rank group's `GroupPoll`s out, the watchers (watchers.py) and the fault
judge saying what ended it. When one ends badly, its fault is recorded, every process of it is
stopped (a preempted node's within its notice) and its checkpoints are stored; the failure
policy decides. A retry replaces only what was lost (a lost node's bundle, which Ray places
again by itself, gets a new agent that prepares it from scratch; the surviving nodes keep their
code, weights and caches), restores the job's latest complete checkpoint on each rank that
lacks it, and starts every rank again.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from orchestrator.agents.messages import MetricsRequest
from orchestrator.agents.rank_program import StartRequest
from orchestrator.controller import stuck as _stuck  # noqa: F401  (registers StuckWatcher)
from orchestrator.controller import time_limit as _time_limit  # noqa: F401  (TimeLimitWatcher)
from orchestrator.controller.checkpointing import RestoreFailed, Uploaders
from orchestrator.controller.environment import job_environment
from orchestrator.controller.failure_policy import (
    NEVER_RETRIED,
    Action,
    FailureDecision,
    FailurePolicy,
    Fault,
    FaultKind,
)
from orchestrator.controller.job_run import JobRun
from orchestrator.controller.plan import GroupPlan, PlanPolicy
from orchestrator.controller.rank_group import GroupError, GroupPoll, RankGroup, RankLostError
from orchestrator.controller.run_port import RunPort
from orchestrator.controller.watchers import WatchScope, watchers_for
from orchestrator.controller.weights import record_deliveries
from orchestrator.lifecycle import JobState
from orchestrator.spec.secrets import SecretReference
from orchestrator.storage.records import Attempt, Failure, NodeInfo

POLL_S = 0.2
PEER_SETTLE_S = 1.0  # after a command fails, how long a peer's loss may take to be told
STOP_GRACE_S = 10.0  # SIGTERM to SIGKILL: a stop's, a fault's without a preemption deadline
NOTICE_SHARE = 2 / 3  # of a preemption notice, the commands' share; the rest is for uploads


@dataclass(frozen=True)
class AttemptEnd:
    """How an attempt ended: every rank well (no fault), or a fault and what the job's failure
    says if this attempt ends it."""

    fault: Fault | None = None
    failure: Failure | None = None


class Attempts:
    """Runs the job's attempts: the status through `job` (its JobRun), the nodes, the queue and
    the job's end through `port` (the controller, or a fake of it). `plan` is attempt 0's, on
    which the port placed the job; `plans` decides each later one's."""

    def __init__(self, job: JobRun, port: RunPort, plan: GroupPlan, plans: PlanPolicy) -> None:
        self.job = job
        self.port = port
        self.plan, self.plans = plan, plans
        self.policy = FailurePolicy(job.record.retry)
        self.faults: list[Fault] = []

    @property
    def group(self) -> RankGroup:
        return self.port.nodes.group

    # --- the loop --------------------------------------------------------------------------

    def run(self) -> None:
        """Until an attempt completes, or a fault the policy does not retry."""
        number, resumed = 0, None
        end = self._run_one(number, resumed)
        while True:
            if end.fault is None:
                self._record_end(None, "completed")
                self.port.complete()
                return
            if end.fault.kind == FaultKind.PREEMPTED_BY_JOB:  # not a fault: no retry used
                self._record_end(end.fault, "gave way: back in the queue, to resume later")
                self._store_attempt(end, self._stop_attempt(end))
                number += 1
                end = self._run_one(number, self._back_in_line(end.fault, number))
                continue
            decision = self.policy.decide(end.fault, self.faults)
            self.faults.append(end.fault)
            if decision.action == Action.END:  # the job's end stops and flushes everything
                self._record_end(end.fault, f"ended: {decision.why}")
                assert decision.state is not None
                self.port.fail(decision.state, self._final_failure(end, decision))
                return
            self._record_end(end.fault, f"retried: {decision.why}")
            stopper = self._stop_attempt(end)
            unsettled: tuple[AttemptEnd, threading.Thread] | None = (end, stopper)
            if end.fault.deadline:  # stored before the preempted node goes, then replaced
                self._store_attempt(end, stopper)
                unsettled = None
            number += 1
            try:
                resumed = self._recover(end.fault, decision, number, unsettled)
            except ReplacementLost as lost:  # attempt `number` ends before its commands ran
                self._append(Attempt(number=number, started_at=time.time()))
                end = AttemptEnd(
                    lost.fault, Failure(cause=lost.fault.reason, node_rank=lost.fault.rank)
                )
                continue
            end = self._run_one(number, resumed)

    # --- one attempt -----------------------------------------------------------------------

    def _run_one(self, number: int, resumed: str | None) -> AttemptEnd:
        job = self.job
        job.check_stop()
        plan = self.plan
        requests = self._requests(plan, number)
        uploaders = self.group.uploaders
        resumed_at = uploaders.resumed_at if resumed and uploaders is not None else None
        attempt = Attempt(number=number, started_at=time.time(), resumed_from=resumed,
                          resumed_at=resumed_at)  # fmt: skip
        attempts = [*job.status.attempts, attempt]
        if number == 0:
            job.transition(JobState.RUNNING, f"running {plan.describe()}", attempts=attempts)
            job.running_since = time.time()
        else:
            job.say(f"==== attempt {number} (BT_RETRY_COUNT={number}) ====")
            how = f"from checkpoint {resumed}" if resumed else "from the start"
            job.transition(
                JobState.RUNNING,
                f"attempt {number}: running {plan.describe()} again, {how}",
                attempts=attempts,
            )
        self.group.start(requests, job.lines)
        return self._follow(WatchScope(job, self.port, plan))

    def _requests(self, plan: GroupPlan, number: int) -> list[StartRequest]:
        record = self.job.record
        job = record.spec.job
        secrets = {
            var: ref.name
            for var, ref in job.runtime.environment_variables.items()
            if isinstance(ref, SecretReference)
        }
        nodes = self.job.status.nodes
        return [
            StartRequest(
                program=rank.program,
                env=job_environment(record, nodes[rank.rank], number),
                secrets=secrets,
                cwd=workdir(nodes[rank.rank], record.archive.config_dir),
                gpus_per_node=int(rank.bundle.get("GPU", 0)),
                metrics=MetricsRequest(
                    project=record.project,
                    interval_s=record.metrics_interval_s,
                    memory_request_bytes=job.compute.memory_bytes,
                    cpu_request=job.compute.cpu_count,
                    checkpointing=job.runtime.checkpointing_config.enabled,
                ),
                runtime=plan.runtime,
            )
            for rank in plan.ranks
        ]

    def _follow(self, scope: WatchScope) -> AttemptEnd:
        """Poll the group until every rank has ended, one has failed or been lost, or a
        watcher says a fault (a stop, a preemption, the checkpoint volume, ...)."""
        watchers = watchers_for(scope)
        while True:
            poll = self.group.poll()
            self.job.lines(list(poll.checkpoint_lines))
            for watcher in watchers:
                if (fault := watcher.watch(poll)) is not None:
                    return AttemptEnd(fault, Failure(cause=fault.reason, node_rank=fault.rank))
            if poll.ended or poll.failed is not None:
                return self._judge(poll)
            self.group.wait(POLL_S)

    def _judge(self, poll: GroupPoll) -> AttemptEnd:
        """The attempt's end from its last poll: a rank's fault, or none."""
        failed = poll.failed
        if failed is None:
            return AttemptEnd()
        judge, node_ids = self.port.nodes.judge, self.group.node_ids
        fault = judge.fault_of(failed, node_ids.get(failed.rank))
        if fault.kind == FaultKind.COMMAND_FAILED and len(poll.ranks) > 1:
            # A rank whose peer vanished fails too (a broken collective): the peer's loss is
            # the attempt's cause. It may be told a moment after the failure.
            time.sleep(PEER_SETTLE_S)
            fault = judge.lost_elsewhere(self.group.poll(), node_ids) or fault
        return AttemptEnd(fault, failed.failure)

    # --- between attempts ------------------------------------------------------------------

    def _stop_attempt(self, end: AttemptEnd) -> threading.Thread:
        """Stop every rank's commands, in the background: a lost rank is replaced meanwhile.
        On a preemption notice the SIGTERM goes out at once, with most of the notice to save."""
        job, fault = self.job, end.fault
        assert fault is not None
        job.say(f"attempt {len(job.status.attempts) - 1} ended: {fault.reason}")
        grace = STOP_GRACE_S
        if fault.deadline:  # a preemption notice: the commands save, the uploader stores
            left = max(0.0, fault.deadline - time.time())
            grace = max(1.0, left * NOTICE_SHARE)
            job.say(
                f"preemption notice: SIGTERM to every rank's commands now; they have "
                f"{grace:.0f} s to save, the uploads the rest of {left:.0f} s"
            )

        def stop() -> None:
            if error := self.group.stop(grace):
                job.say(f"stopping the commands: {error}")

        stopper = threading.Thread(target=stop, name="stop-attempt", daemon=True)
        stopper.start()
        return stopper

    def _store_attempt(self, end: AttemptEnd, stopper: threading.Thread) -> None:
        """Once every process of the attempt is gone, its checkpoints stored: no rank of this
        attempt may write into the next one's."""
        stopper.join()
        uploaders = self.group.uploaders
        if uploaders is None:
            return
        runs = self.group.runs
        for run in runs:
            run.done.wait(5.0)  # a stopped rank's result follows its exit closely
        upload_s = uploaders.flush_timeout_s
        if end.fault is not None and end.fault.deadline:
            upload_s = max(5.0, end.fault.deadline - time.time())
        # A lost node's uploader went with it; a lost agent's (its node lives) still uploads.
        lost = {r.rank for r in runs if r.lost is not None}
        if end.fault is not None and end.fault.kind == FaultKind.AGENT_LOST:
            lost = set()
        endings = [run.ending(None) for run in runs]
        self.job.lines(uploaders.end_attempt(endings, upload_s, lost))

    def _recover(
        self,
        fault: Fault,
        decision: FailureDecision,
        number: int,
        unsettled: tuple[AttemptEnd, threading.Thread] | None,
    ) -> str | None:
        """Wait as the policy says and replace what was lost while the last attempt stops;
        once it is `unsettled` no more (its processes gone, its checkpoints stored) put every
        rank at the resume point. The checkpoint the next attempt resumes from."""
        job = self.job
        self.plan = self._next_plan(number)
        ranks = self._to_replace(fault)
        what = f"rank(s) {', '.join(map(str, ranks))} placed again" if ranks else "a restart"
        job.transition(JobState.PENDING, f"{fault.reason}; {decision.why}: waiting for {what}")
        if decision.delay_s:
            job.say(f"retrying in {decision.delay_s:g} s")
            until = time.monotonic() + decision.delay_s
            while time.monotonic() < until:
                job.check_stop()
                time.sleep(POLL_S)
        if ranks:
            try:
                self.port.replace(ranks)
            except GroupError as e:
                raise Unrecoverable(str(e)) from None
            job.transition(JobState.DEPLOYING, f"preparing rank(s) {', '.join(map(str, ranks))}")
            self._prepare_again(ranks, number)
        else:
            job.transition(
                JobState.DEPLOYING, f"restarting every rank's commands (attempt {number})"
            )
        if unsettled is not None:
            self._store_attempt(*unsettled)
        uploaders = self.group.uploaders
        if uploaders is None:
            return None
        uploaders.wait_ready()
        return self._restore(uploaders, number)

    def _restore(self, uploaders: Uploaders, number: int) -> str | None:
        """Every rank at the job's resume point before attempt `number`; its checkpoint."""
        try:
            resumed = uploaders.begin_attempt(number, self.job.check_stop)
        except RestoreFailed as e:
            raise Unrecoverable(str(e)) from None
        self.job.lines(uploaders.poll()[0])
        return resumed

    def _back_in_line(self, fault: Fault, number: int) -> str | None:
        """After the queue preempted the job (its commands stopped, its checkpoints stored):
        give its nodes back, wait to be admitted again, place and prepare every rank anew and
        put each at the latest checkpoint. The checkpoint attempt `number` resumes from."""
        old = self.group.uploaders
        earlier = old.earlier() if old is not None else {}
        unstored = any(e.state in ("pending", "failed") for e in earlier.values())
        self.plan = self.plans.plan(number, self.plan)  # on nodes placed anew: any size
        self.port.requeue(fault.reason, keep_checkpoints=unstored, plan=self.plan)
        uploaders = self.group.uploaders
        if uploaders is None:
            self.job.say(f"no checkpointing: attempt {number} starts from the beginning")
            return None
        if old is not None:
            uploaders.carry(old)
        return self._restore(uploaders, number)

    def _next_plan(self, number: int) -> GroupPlan:
        """Attempt `number`'s plan, on the group the last one ran on."""
        plan = self.plans.plan(number, self.plan)
        if plan.size != self.plan.size:
            raise Unrecoverable(
                f"attempt {number} was planned with {plan.size} rank(s) on a group of "
                f"{self.plan.size}: resizing a placed group is not built yet"
            )
        return plan

    def _to_replace(self, fault: Fault) -> list[int]:
        ranks = {r.rank for r in self.group.runs if r.lost is not None}
        if fault.kind in (FaultKind.NODE_LOST, FaultKind.AGENT_LOST, FaultKind.PREEMPTED):
            assert fault.rank is not None
            ranks.add(fault.rank)
        return sorted(ranks)

    def _prepare_again(self, ranks: list[int], number: int) -> None:
        job = self.job
        try:
            prepared = self.port.prepare(ranks)
        except RankLostError as e:  # the replacement went too: a fault like any other
            which = ", ".join(map(str, ranks))
            why = f"rank(s) {which} lost again while being prepared ({e})"
            raise ReplacementLost(Fault(FaultKind.NODE_LOST, why, ranks[0])) from None
        except GroupError as e:
            raise Unrecoverable(str(e)) from None
        nodes = list(job.status.nodes)
        for p in prepared:
            nodes[p.rank] = p.node_info().model_copy(update={"prepared_for": number})
            job.say(f"rank {p.rank}: prepared on node {p.node_id[:12]} ({p.hostname})")
        weights = [w.model_copy(deep=True) for w in job.status.weights]
        record_deliveries(weights, prepared, job.say)
        job.amend(nodes=nodes, weights=weights)

    # --- records ---------------------------------------------------------------------------

    def _append(self, attempt: Attempt) -> None:
        self.job.amend(attempts=[*self.job.status.attempts, attempt])

    def _record_end(self, fault: Fault | None, decision: str) -> None:
        job = self.job
        attempts = list(job.status.attempts)
        if not attempts:
            return
        updates: dict[str, Any] = {"ended_at": time.time(), "decision": decision}
        if (stored := self._stored_since(attempts[-1].started_at)) is not None:
            updates["checkpoint_at"] = stored
        if fault is not None:
            updates.update(cause=fault.kind.value, reason=fault.reason, rank=fault.rank,
                           node_id=fault.node_id)  # fmt: skip
        attempts[-1] = attempts[-1].model_copy(update=updates)
        job.amend(attempts=attempts)

    def _stored_since(self, started_at: float) -> float | None:
        """When the newest checkpoint any rank stored complete since `started_at` was stored."""
        uploaders = self.group.uploaders
        stored = [] if uploaders is None else uploaders.last_stored.values()
        return max((s.at for s in stored if s.at >= started_at), default=None)

    def _final_failure(self, end: AttemptEnd, decision: FailureDecision) -> Failure:
        assert end.fault is not None and end.failure is not None
        failure = end.failure
        cause, kind = failure.cause, end.fault.kind
        retriable = kind != FaultKind.COMMAND_FAILED or self.job.record.retry.retries
        if kind not in NEVER_RETRIED and retriable:
            cause += f" ({decision.why})"  # why a fault that could be retried was not
        causes = attempt_causes(self.job.status.attempts)
        if len(causes) > 1:
            cause += f"; {len(causes)} attempts: " + "; ".join(causes)
        return failure.model_copy(update={"cause": cause, "attempts": causes})


class ReplacementLost(Exception):
    """A lost rank's replacement was lost while it was being prepared."""

    def __init__(self, fault: Fault) -> None:
        super().__init__(fault.reason)
        self.fault = fault


class Unrecoverable(Exception):
    """A retry could not replace what was lost (no room within the timeout, a failed prepare)."""


def attempt_causes(attempts: list[Attempt]) -> list[str]:
    """`attempt 0: rank 1's node ... was lost`, for each attempt that ended badly."""
    return [f"attempt {a.number}: {a.reason}" for a in attempts if a.reason]


def workdir(node: NodeInfo, config_dir: str) -> str:
    """Where the commands run: the config's directory inside the node's unpacked code."""
    assert node.working_dir is not None
    return node.working_dir if config_dir in ("", ".") else f"{node.working_dir}/{config_dir}"

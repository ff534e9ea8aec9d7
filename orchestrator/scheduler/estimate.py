"""When each waiting job should start (`estimate_starts`): the queue's own policy simulated
forward over the running jobs' expected ends.

Pure, as the policy is. Given a decision's snapshot and what says how long each job holds its
nodes once admitted (`RunTime`: its `max_duration`, its project's latest finished runs), it
repeats: the earliest expected end among the running jobs frees what that job holds, the real
`SchedulingPolicy.decide` runs on the cluster as it would be then, and what it admits starts
then. A job's expected run is the median of its project's runs longer than what it has run
already, capped by its `max_duration`; one past all of them is assumed to end soon (in a tenth
of its typical run). A job with neither never ends in the simulation: the waiting jobs that
would start only after it are not estimated, and say which job it is. Preemptions are honoured
conservatively: a victim leaves `leave_s` later (the default preemption grace) and goes back to
the queue needing its whole run again. Jobs pushed later are not foreseen. The simulation stops
after `max_steps` ends or `budget_s` of CPU (about 200 ends of a 1,000-job queue), and the jobs
it did not reach say so.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from orchestrator.scheduler.model import ClusterSnapshot, Node, QueuedJob, RunningJob
from orchestrator.scheduler.policy import SchedulingPolicy
from orchestrator.spec.durations import format_duration

LEAVE_S = 60.0  # a victim's grace before its nodes are free (ORCHESTRATOR_PREEMPTION_GRACE_S)
LEAVING = "preempted: leaving"
OVERDUE_SHARE = 0.1  # a job past its expected end: assumed to end this share of its run from now
MAX_STEPS = 1000  # ends simulated at most (each is one decision)
BUDGET_S = 2.0  # CPU seconds the simulation may take (a decision on 1,000 jobs: ~10 ms)


@dataclass(frozen=True)
class RunTime:
    """What says how long a job holds its nodes once admitted: its `max_duration` (`limit`: the
    controller stops it there) and how long its project's latest finished jobs held theirs."""

    limit: float | None = None
    runs: tuple[float, ...] = ()

    def after(self, elapsed: float) -> tuple[float, str] | None:
        """The whole run expected of a job that has held its nodes `elapsed` already, and what
        says so: the median of the project's runs longer than that, capped by the limit; None
        when it has run past all of them (and its limit)."""
        longer = sorted(h for h in self.runs if h > elapsed)
        if longer and (self.limit is None or longer[len(longer) // 2] < self.limit):
            typical = longer[len(longer) // 2]
            if elapsed <= 0 or len(longer) == len(self.runs):
                return typical, f"its project's typical run {format_duration(typical)}"
            return typical, (f"its project's runs longer than {format_duration(elapsed)}: "
                             f"typically {format_duration(typical)}")  # fmt: skip
        if self.limit is not None and self.limit > elapsed:
            return self.limit, f"its max_duration {format_duration(self.limit)}"
        return None


@dataclass(frozen=True)
class Estimate:
    """A waiting job's estimated start (epoch seconds), and how it was estimated; `start` None:
    it cannot be estimated, and `how` says why."""

    start: float | None
    how: str


def estimate_starts(
    snap: ClusterSnapshot, policy: SchedulingPolicy, run_times: Mapping[str, RunTime | None],
    *, pushed_at: Mapping[str, float] | None = None, leave_s: float = LEAVE_S,
    max_steps: int = MAX_STEPS, budget_s: float = BUDGET_S,
    clock: Callable[[], float] = time.thread_time,
) -> dict[str, Estimate]:  # fmt: skip
    """Each queued job's `Estimate` (the impossible ones excepted: they never start).
    `pushed_at`: the running jobs' push times, which a preempted one keeps in the queue (else
    its start stands for it). Jobs pushed later are not foreseen: one that goes first (a higher
    priority, a team further below its share) starts the others later than estimated."""
    sim = _Simulation(snap, policy, run_times, leave_s, pushed_at or {})
    return sim.run(max_steps, budget_s, clock)


class _Simulation:
    def __init__(
        self, snap: ClusterSnapshot, policy: SchedulingPolicy,
        run_times: Mapping[str, RunTime | None], leave_s: float,
        pushed_at: Mapping[str, float],
    ) -> None:  # fmt: skip
        self.snap, self.policy, self.run_times, self.leave_s = snap, policy, run_times, leave_s
        self.now = snap.now
        self.queued = {j.job_id: j for j in snap.queued}
        self.running = {r.job_id: r for r in snap.running}
        self.free = {n.node_id: n.free for n in snap.nodes}
        self.capacity = {n.node_id: n.capacity for n in snap.nodes}
        self.ends: dict[str, tuple[float, str]] = {}  # running job -> its end, and what says so
        self.unknown: dict[str, str] = {}  # running job that never ends here -> why
        for r in snap.running:
            self._expect_end(r, first=True)
        self.asked = {j.job_id for j in snap.queued}  # the jobs estimated
        self.pushed = {**pushed_at, **{j.job_id: j.pushed_at for j in snap.queued}}
        self.last_basis: dict[str, str] = {}  # what said when the jobs that ended last would
        self.out: dict[str, Estimate] = {}
        self.never: set[str] = set()  # impossible: never estimated

    def run(self, max_steps: int, budget_s: float, clock: Callable[[], float]) -> dict:
        started = clock()
        last_ended: list[str] = []
        for _ in range(max_steps):
            self._decide(last_ended)
            if not self._waiting():
                return self.out
            if clock() - started > budget_s:
                return self._give_up(f"the simulation reached its {budget_s:g} s limit before "
                                     "this job's start")  # fmt: skip
            if not self.ends:
                return self._give_up(self._why_stuck())
            last_ended = self._advance()
        return self._give_up(f"the simulation reached its limit of {max_steps} job ends "
                             "before this job's start")  # fmt: skip

    # -- one step -----------------------------------------------------------------------------

    def _decide(self, ended: list[str]) -> None:
        nodes = [Node(n, self.capacity[n], self.free[n]) for n in self.capacity]
        snap = replace(self.snap, queued=list(self.queued.values()),
                       running=list(self.running.values()), nodes=nodes, now=self.now)  # fmt: skip
        decision = self.policy.decide(snap)
        self.never.update(decision.impossible)
        for i, admit in enumerate(decision.admit):
            job = self.queued.pop(admit.job_id)
            r = RunningJob(job.job_id, job.team, job.priority, self.now + i * 1e-6, job.demand,
                           admit.placed_on)  # fmt: skip
            self.running[r.job_id] = r
            for node in admit.placed_on:
                self.free[node] = self.free[node] - job.demand.bundle
            self._expect_end(r)
            if r.job_id in self.asked and r.job_id not in self.out:  # its first start
                self.out[r.job_id] = Estimate(self.now, self._how(ended))
        for p in decision.preempt:
            victim = self.running.get(p.victim)
            if victim is not None and not victim.leaving:
                self.running[p.victim] = replace(victim, leaving=True, leaving_for=p.for_job)
                self.unknown.pop(p.victim, None)
                self.ends[p.victim] = (self.now + self.leave_s, LEAVING)

    def _advance(self) -> list[str]:
        """To the next expected end: every job ending then lets go (a preempted one back in the
        queue); the jobs that ended."""
        self.now = max(self.now, min(end for end, _ in self.ends.values()))
        ended = sorted((j for j, (end, _) in self.ends.items() if end <= self.now),
                       key=lambda j: self.ends[j][0])  # fmt: skip
        for job_id in ended:
            r = self.running.pop(job_id)
            for node in r.placed_on:
                if node in self.free:
                    self.free[node] = self.free[node] + r.demand.bundle
            if r.leaving:  # requeued, keeping its push time; its whole run again (conservative)
                pushed = self.pushed.get(job_id, r.started_at)
                self.queued[job_id] = QueuedJob(job_id, r.team, r.priority, pushed, r.demand,
                                                preempted_by=r.leaving_for)  # fmt: skip
        self.last_basis = {j: self.ends.pop(j)[1] for j in ended}
        return ended

    def _expect_end(self, r: RunningJob, first: bool = False) -> None:
        if r.leaving:
            self.ends[r.job_id] = (self.now + self.leave_s, LEAVING)
            return
        run = self.run_times.get(r.job_id)
        if run is None:
            self.unknown[r.job_id] = _no_run_time(r.job_id, first)
            return
        elapsed = self.now - r.started_at
        expected = run.after(elapsed)
        if expected is None:  # it ran longer than anything known of it: assumed to end soon
            whole, basis = run.after(0.0) or (elapsed, "")
            self.ends[r.job_id] = (self.now + OVERDUE_SHARE * whole,
                                   f"past {basis}: assumed to end soon")  # fmt: skip
        else:
            self.ends[r.job_id] = (r.started_at + expected[0], expected[1])

    # -- what it says -------------------------------------------------------------------------

    def _how(self, ended: list[str]) -> str:
        """ "after j1 ends (its max_duration 2h 0m), in the queue's order"""
        if not ended:
            return "at the next decision, in the queue's order"
        first = ended[0]
        more = f" and {len(ended) - 1} more" if len(ended) > 1 else ""
        basis = self.last_basis.get(first, "")
        if basis == LEAVING:
            return f"once {first}{more}, preempted, has left (its grace {self.leave_s:g} s)"
        return f"after {first}{more} ends ({basis}), in the queue's order"

    def _waiting(self) -> list[str]:
        """The jobs asked about that have not started (nor can never start)."""
        return [j for j in self.queued if j in self.asked and j not in self.out
                and j not in self.never]  # fmt: skip

    def _why_stuck(self) -> str:
        """Nothing known ends any more, and jobs still wait."""
        if self.unknown:
            names = list(self.unknown)  # those running now first
            first = self.unknown[names[0]]
            more = f" (and {len(names) - 1} more without one)" if len(names) > 1 else ""
            return f"{first}{more}"
        return ("it does not fit even once every job the queue runs has ended (work the queue "
                "does not run holds part of the cluster)")  # fmt: skip

    def _give_up(self, why: str) -> dict[str, Estimate]:
        for job_id in self._waiting():
            self.out[job_id] = Estimate(None, f"cannot estimate: {why}")
        return self.out


def _no_run_time(job_id: str, running_now: bool) -> str:
    who = f"running job {job_id}" if running_now else f"job {job_id}, which starts before it,"
    return f"{who} has no time limit and its project no history"


def expected_run(max_duration_s: float | None, runs: Sequence[float] = ()) -> RunTime | None:
    """A job's `RunTime`; None when it has neither a limit nor a project with finished runs."""
    if max_duration_s is None and not runs:
        return None
    return RunTime(max_duration_s, tuple(runs))

"""A replayed trace for the queue's start estimates: jobs of a few projects pushed over time
onto a small simulated cluster, run by the real policy (`queue_sim.SimCluster`), each running
as long as its own drawn run time; at every push, the estimate of every waiting job, from what
was known then (the limits, and the runs of jobs finished before then).

`replay(seed)` gives each job's actual start and every estimate taken, for
`tests/test_queue_estimate.py` to compare.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from queue_sim import SimCluster, gpus

from orchestrator.scheduler.estimate import Estimate, RunTime, estimate_starts, expected_run
from orchestrator.scheduler.model import Demand, QueuedJob
from orchestrator.scheduler.policy import SchedulingPolicy
from orchestrator.scheduler.resources import Resources
from orchestrator.scheduler.run_history import recent_runs

LEAVE_S = 60.0  # a preempted job's grace, as the estimator assumes
MIN_WAIT_S = 60.0  # relative errors are taken over at least this long a wait


@dataclass(frozen=True)
class Project:
    name: str
    team: str
    mean_s: float  # a lognormal run time around it
    demand: Demand
    limit: float | None = None  # max_duration, as a multiple of mean_s (runs are cut there)


PROJECTS = (
    Project("sft", "vision", 40 * 60, gpus(8)),
    Project("pretrain", "vision", 3 * 3600, gpus(8, nodes=2), limit=2.0),
    Project("eval", "speech", 12 * 60, gpus(2)),
    Project("asr", "speech", 90 * 60, gpus(8), limit=1.5),
)
NODES = {f"n{i}": Resources.of(H100=8, CPU=32) for i in range(4)}
QUOTAS = {"vision": {"GPU:H100": 16.0}, "speech": {"GPU:H100": 16.0}}
SIGMA = 0.15  # a project's runs: the same code and data on the same nodes, give or take
LOAD = 1.0  # pushes as fast as the cluster runs them
FAILING = 0.1  # the share of jobs that fail early


@dataclass
class Job:
    job_id: str
    project: Project
    pushed_at: float
    run_s: float  # how long it actually holds its nodes (each time it starts)
    max_duration_s: float | None
    priority: int


@dataclass
class Trace:
    jobs: dict[str, Job]
    starts: dict[str, list[float]] = field(default_factory=dict)  # job -> each time it started
    # (instant, job, estimate) for every job waiting at a push
    estimates: list[tuple[float, str, Estimate]] = field(default_factory=list)
    preemptions: int = 0

    def started_after(self, job_id: str, at: float) -> float:
        """When a job waiting at `at` started next (a preempted job waits again)."""
        return min(t for t in self.starts[job_id] if t > at)


def jobs_of(seed: int, count: int = 200, sigma: float = SIGMA, load: float = LOAD,
            failing: float = FAILING) -> dict[str, Job]:  # fmt: skip
    """`count` jobs pushed at random, `load` times as fast as the cluster runs them: each runs
    about its project's mean (lognormal, `sigma`), cut at its max_duration if it has one; a
    `failing` share of them fails early, anywhere in its run."""
    rng = random.Random(seed)
    weights = (3, 1, 5, 4)  # each team's load about its quota's share
    busy = sum(w * p.mean_s * p.demand.total.get("GPU:H100")
               for w, p in zip(weights, PROJECTS, strict=True))  # fmt: skip
    gap = busy / sum(weights) / (sum(n.get("GPU:H100") for n in NODES.values()) * load)
    jobs, now = {}, 0.0
    for i in range(count):
        now += rng.expovariate(1 / gap)
        p = rng.choices(PROJECTS, weights)[0]
        run = p.mean_s * math.exp(rng.gauss(0, sigma))
        limit = p.limit * p.mean_s if p.limit else None
        if limit is not None:
            run = min(run, limit)  # cut at its max_duration
        if rng.random() < failing:
            run *= rng.random()
        jobs[f"j{i:03d}"] = Job(f"j{i:03d}", p, now, run, limit, rng.choice((0, 0, 1, 2)))
    return jobs


def replay(seed: int = 0, count: int = 200, quotas: dict | None = QUOTAS, **shape: float) -> Trace:
    """The truth, with each job's own run time, and the estimates taken along the way; `shape`:
    `jobs_of`'s."""
    jobs = jobs_of(seed, count, **shape)
    trace = Trace(jobs)
    sim = SimCluster(dict(NODES), dict(quotas or {}), SchedulingPolicy())
    pushes = sorted(jobs.values(), key=lambda j: j.pushed_at)
    ends: dict[str, float] = {}  # running job -> when it ends (or leaves, preempted)
    finished: list[tuple[str, float, float]] = []  # (project, end, held)
    while pushes or sim.queued or sim.running:
        if not ends and not pushes:  # an idle cluster, and jobs wait: the policy is stuck
            stuck = {j.job_id: j.preempted_by for j in sim.queued.values()}
            raise AssertionError(f"seed {seed}: nothing runs at {sim.now:.0f} s and jobs wait "
                                 f"(job: the job it gave way to): {stuck}")  # fmt: skip
        sim.now = min([*(e for e in ends.values()), *([pushes[0].pushed_at] if pushes else [])])
        for job_id in [j for j, end in ends.items() if end <= sim.now]:
            del ends[job_id]
            run = sim.running.pop(job_id)
            finished.append((jobs[job_id].project.name, sim.now, sim.now - run.started_at))
            if run.leaving:  # back in the queue, keeping its push time: it starts over
                sim.queued[job_id] = QueuedJob(job_id, run.team, run.priority,
                                               jobs[job_id].pushed_at, run.demand,
                                               preempted_by=run.leaving_for)  # fmt: skip
                finished.pop()  # not a finished run
        pushed = False
        while pushes and pushes[0].pushed_at <= sim.now:
            job = pushes.pop(0)
            sim.push(job.job_id, job.project.team, job.project.demand, job.priority)
            pushed = True
        for _ in range(3):  # the service decides on every change, and each second: till quiet
            decision = sim.carry_out(sim.policy.decide(sim.snapshot()))
            for admit in decision.admit:
                trace.starts.setdefault(admit.job_id, []).append(sim.now)
                ends[admit.job_id] = sim.now + jobs[admit.job_id].run_s
            for p in decision.preempt:
                ends[p.victim] = sim.now + LEAVE_S
                trace.preemptions += 1
            if not decision.admit and not decision.preempt:
                break
        if pushed and sim.queued:
            known = recent_runs(finished)
            runs = {j: _expected(jobs[j], known) for j in [*sim.queued, *sim.running]}
            pushed_at = {j: jobs[j].pushed_at for j in sim.running}
            found = estimate_starts(sim.snapshot(), sim.policy, runs, pushed_at=pushed_at)
            for job_id, estimate in found.items():
                trace.estimates.append((sim.now, job_id, estimate))
    return trace


def _expected(job: Job, known: dict[str, tuple[float, ...]]) -> RunTime | None:
    return expected_run(job.max_duration_s, known.get(job.project.name, ()))


def errors(trace: Trace) -> tuple[dict[str, list[float]], int]:
    """Per job, its estimates' relative errors (|estimate - actual| / its wait from then, at
    least MIN_WAIT_S); and how many estimates could not be made."""
    out: dict[str, list[float]] = {}
    cannot = 0
    for at, job_id, estimate in trace.estimates:
        if estimate.start is None:
            cannot += 1
            continue
        actual = trace.started_after(job_id, at)
        wait = max(actual - at, MIN_WAIT_S)
        out.setdefault(job_id, []).append(abs(estimate.start - actual) / wait)
    return out, cannot

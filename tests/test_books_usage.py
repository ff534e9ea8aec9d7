"""The books (books/usage.py) against a recomputation: a scripted day of jobs of two teams, with
requeues, faults, a price change and jobs still running at its end, added up second by second
the way the queue holds them (no Ray, a fake clock: the records are written as a controller
writes them)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from orchestrator import definitions as d
from orchestrator.books.cost import GIB, per_hour, rates, unpriced
from orchestrator.books.usage import Usage, job_usage
from orchestrator.lifecycle import JobState
from orchestrator.storage.prices import Prices
from orchestrator.storage.records import (
    ArchiveRef,
    Attempt,
    Hold,
    JobRecord,
    JobStatus,
    StatusEvent,
)

DAY = 86_400.0
T0 = 1_800_000_000.0  # the day's start
EARLY = Prices(gpu={"H100": 2.49, "A100": 1.29}, cpu_hour=0.04, memory_gib_hour=0.005)
LATE = Prices(gpu={"H100": 1.99}, cpu_hour=0.05, memory_gib_hour=0.004)  # no A100 price
CHANGE = T0 + DAY / 2


def record(job_id: str, team: str, pushed: float, accelerator: str | None, nodes: int) -> JobRecord:
    compute = d.Compute(cpu_count=4, memory="16Gi", node_count=nodes,
                        accelerator=f"{accelerator}:2" if accelerator else None)  # fmt: skip
    spec = d.TrainingProject(
        name=f"p-{team}", team_name=team,
        job=d.TrainingJob(image=d.Image(base_image="x"), compute=compute),
    )  # fmt: skip
    archive = ArchiveRef(path="a", sha256="x", size_bytes=1, file_count=1, config_dir=".")
    return JobRecord(job_id=job_id, project=spec.name, team=team, created_at=pushed, spec=spec,
                     archive=archive, storage_root="r")  # fmt: skip


def bundle(accelerator: str | None) -> dict[str, float]:
    out = {"CPU": 4.0, "memory": 16.0 * GIB}
    if accelerator:
        out[f"GPU:{accelerator}"] = 2.0
    return out


@dataclass
class Scripted:
    """One job of the day: when it was pushed, admitted and released, its attempts."""

    record: JobRecord
    bundle: dict[str, float]
    holds: list[tuple[float, float | None]] = field(default_factory=list)
    # (start, end, cause, checkpoint_at)
    attempts: list[tuple[float, float | None, str | None, float | None]] = field(
        default_factory=list
    )
    end: float | None = None
    state: JobState = JobState.RUNNING

    def status(self) -> JobStatus:
        nodes = self.record.spec.job.compute.node_count
        history = [StatusEvent(state=JobState.CREATED, at=self.record.created_at)]
        if self.end is not None:
            history.append(StatusEvent(state=self.state, at=self.end))
        return JobStatus(
            job_id=self.record.job_id, state=self.state,
            history=history,
            holds=[Hold(since=s, until=u, bundle=self.bundle, nodes=nodes,
                        prices=rates(EARLY if s < CHANGE else LATE)) for s, u in self.holds],
            attempts=[self.attempt(i) for i in range(len(self.attempts))],
        )  # fmt: skip

    def attempt(self, i: int) -> Attempt:
        """Attempt `i`, resumed from the checkpoint the one before it stored last, if any."""
        start, end, cause, checkpoint = self.attempts[i]
        before = self.attempts[i - 1][3] if i else None
        return Attempt(number=i, started_at=start, ended_at=end, cause=cause,
                       checkpoint_at=checkpoint, resumed_from="ckpt" if before else None,
                       resumed_at=before)  # fmt: skip


def scripted_day(seed: int, jobs: int = 24) -> list[Scripted]:
    """Jobs pushed through the day; each waits, is admitted, may lose a node (retried on the
    same hold) or give way to another job (released, queued again, admitted again), and ends;
    the last ones still run (or still wait) at the day's end."""
    rnd = random.Random(seed)
    out = []
    for i in range(jobs):
        accelerator = rnd.choice(["H100", "A100", None])
        pushed = T0 + rnd.uniform(0, DAY * 0.9)
        job = Scripted(record(f"j{i:02d}", rnd.choice(["vision", "nlp"]), pushed, accelerator,
                              rnd.choice([1, 2])), bundle(accelerator))  # fmt: skip
        t = pushed + rnd.uniform(5, 3600)
        for placement in range(rnd.choice([1, 1, 2])):
            since = t
            start = since + rnd.uniform(10, 120)  # deploying
            for _ in range(rnd.choice([1, 2])):
                end = start + rnd.uniform(600, 7200)
                checkpoint = start + rnd.uniform(0, end - start) if rnd.random() < 0.7 else None
                job.attempts.append((start, end, "node_lost", checkpoint))
                start = end + rnd.uniform(5, 60)
            last_start, last_end, _, checkpoint = job.attempts[-1]
            if placement == 0 and rnd.random() < 0.4:  # gave way: back in the queue
                job.attempts[-1] = (last_start, last_end, "preempted_by_job", checkpoint)
                job.holds.append((since, last_end + 3))
                t = last_end + 3 + rnd.uniform(60, 3600)
                continue
            cause = rnd.choice([None, None, "command_failed", "stopped", "max_duration"])
            job.attempts[-1] = (last_start, last_end, cause, checkpoint)
            job.holds.append((since, last_end + 2))
            job.end = last_end + 1  # the end is recorded, then the nodes are let go of
            job.state = JobState.COMPLETED if cause is None else JobState.FAILED
            break
        else:  # gave way, and waits again at the day's end
            job.state = JobState.PENDING
        out.append(job)
    # The day ends with one job holding its nodes, one whose controller died holding them
    # (ended, its hold never closed), and one waiting again after a requeue.
    holding = out[0]
    holding.holds[-1] = (holding.holds[-1][0], None)
    holding.end, holding.state = None, JobState.RUNNING
    holding.attempts[-1] = (holding.attempts[-1][0], None, None, None)
    died = out[1]
    died.holds[-1] = (died.holds[-1][0], None)
    waiting = out[2]
    waiting.end, waiting.state = None, JobState.PENDING
    waiting.holds = waiting.holds[:1]
    waiting.attempts = [a for a in waiting.attempts if a[0] < waiting.holds[0][1]]
    return out


def last_moment(jobs: list[Scripted]) -> float:
    """The last time the day's records name: "now" is after it."""
    times = [t for j in jobs for hold in j.holds for t in hold if t is not None]
    return max([*times, *(j.end for j in jobs if j.end is not None)])


def recomputed(jobs: list[Scripted], now: float, step: float = 1.0) -> dict[str, dict[str, float]]:
    """Per team: GPU-, CPU-, memory-GiB-seconds, cost, waiting and lost GPU-seconds, summed
    one `step` at a time: a job holds at t when t is inside one of its holds (an open one runs
    to the job's end, or `now`), waits when it is pushed, not ended and holds nothing, has
    lost t when a fault ended an attempt and t is between its last checkpoint and its end."""
    teams: dict[str, dict[str, float]] = {}
    for job in jobs:
        books = teams.setdefault(job.record.team or "", dict.fromkeys(
            ("gpu", "cpu", "mem", "cost", "wait", "lost_gpu", "lost_cost"), 0.0))  # fmt: skip
        nodes = job.record.spec.job.compute.node_count
        horizon = job.end if job.end is not None else now
        holds = [(s, u if u is not None else horizon, EARLY if s < CHANGE else LATE)
                 for s, u in job.holds]  # fmt: skip
        lost = [(max(s, k or s), e if e is not None else horizon) for s, e, c, k in job.attempts
                if c is not None and c not in ("stopped", "max_duration")]  # fmt: skip
        gpus = sum(v for k, v in job.bundle.items() if k.startswith("GPU:")) * nodes
        t = job.record.created_at + step / 2
        while t < now:
            holding = [p for s, u, p in holds if s <= t < u]
            if holding:
                prices = holding[0]
                hourly = nodes * (sum(prices.gpu.get(k[4:], 0) * v for k, v in job.bundle.items()
                                      if k.startswith("GPU:")) + prices.cpu_hour * 4
                                  + prices.memory_gib_hour * 16)  # fmt: skip
                books["gpu"] += gpus * step
                books["cpu"] += 4 * nodes * step
                books["mem"] += 16 * nodes * step
                books["cost"] += hourly * step / 3600
                if any(a <= t < b for a, b in lost):
                    books["lost_gpu"] += gpus * step
                    books["lost_cost"] += hourly * step / 3600
            elif job.end is None or t < job.end:
                ended_wait = job.state != JobState.PENDING and holds and t >= holds[-1][1]
                if not ended_wait:
                    books["wait"] += step
            t += step
    return teams


def books_of(jobs: list[Scripted], now: float) -> dict[str, dict[str, float]]:
    teams: dict[str, dict[str, float]] = {}
    for job in jobs:
        u = job_usage(job.record, job.status(), now)
        books = teams.setdefault(job.record.team or "", dict.fromkeys(
            ("gpu", "cpu", "mem", "cost", "wait", "lost_gpu", "lost_cost"), 0.0))  # fmt: skip
        books["gpu"] += sum(u.usage.gpu_s.values())
        books["cpu"] += u.usage.cpu_s
        books["mem"] += u.usage.memory_gib_s
        books["cost"] += u.usage.cost
        books["wait"] += u.waiting_s
        books["lost_gpu"] += sum(u.lost.gpu_s.values())
        books["lost_cost"] += u.lost.cost
    return teams


@pytest.mark.parametrize("seed", [1, 2])
def test_a_scripted_days_books_match_a_second_by_second_recount(seed):
    jobs = scripted_day(seed)
    now = last_moment(jobs) + 600
    got, want = books_of(jobs, now), recomputed(jobs, now)
    assert set(got) == set(want) == {"vision", "nlp"}
    for team, figures in want.items():
        for key, value in figures.items():
            assert got[team][key] == pytest.approx(value, rel=1e-3, abs=1.0), (team, key)
    assert sum(t["lost_gpu"] for t in got.values()) > 0
    assert sum(t["wait"] for t in got.values()) > 0


def test_the_hours_of_a_day_add_up_to_the_day():
    jobs = scripted_day(3)
    now = last_moment(jobs) + 600
    slots = range(int((now - T0) // 3600) + 1)
    for job in jobs:
        whole = job_usage(job.record, job.status(), now)
        hours = [job_usage(job.record, job.status(), now, since=T0 + h * 3600,
                           until=T0 + (h + 1) * 3600) for h in slots]  # fmt: skip
        assert sum(h.usage.cpu_s for h in hours) == pytest.approx(whole.usage.cpu_s)
        assert sum(h.usage.cost for h in hours) == pytest.approx(whole.usage.cost)
        assert sum(h.waiting_s for h in hours) == pytest.approx(whole.waiting_s)
        assert sum(h.lost.cpu_s for h in hours) == pytest.approx(whole.lost.cpu_s)


def test_a_price_change_never_rewrites_what_already_ran():
    """Costed at the prices its admission kept: prices set later change nothing."""
    job = Scripted(record("j", "vision", T0, "H100", 2), bundle("H100"))
    job.holds = [(T0 + 10, T0 + 3610)]
    job.attempts = [(T0 + 20, T0 + 3600, None, None)]
    job.end, job.state = T0 + 3605, JobState.COMPLETED
    status = job.status()
    u = job_usage(job.record, status, now=T0 + DAY)
    hourly = 2 * (2 * 2.49 + 4 * 0.04 + 16 * 0.005)
    assert u.usage.cost == pytest.approx(hourly)
    assert u.usage.gpu_s == {"H100": pytest.approx(4 * 3600)}
    assert (u.waiting_s, u.lost.cost) == (pytest.approx(10), 0)
    assert per_hour(bundle("H100"), 2, rates(LATE)) != pytest.approx(hourly)


def test_an_unpriced_gpu_type_is_named_not_costed():
    job = Scripted(record("j", "nlp", T0, "A100", 1), bundle("A100"))
    job.holds = [(CHANGE + 1, CHANGE + 3601)]  # admitted after the change: LATE has no A100
    job.attempts = [(CHANGE + 2, CHANGE + 3600, None, None)]
    job.end, job.state = CHANGE + 3600.5, JobState.COMPLETED
    u = job_usage(job.record, job.status(), now=T0 + DAY)
    assert u.usage.unpriced == ["A100"]
    assert u.usage.cost == pytest.approx(4 * 0.05 + 16 * 0.004)  # CPU and memory only
    assert unpriced(bundle("A100"), rates(EARLY)) == []


def test_lost_time_runs_from_what_the_next_attempt_kept_and_only_for_faults():
    job = Scripted(record("j", "nlp", T0, "H100", 1), bundle("H100"))
    job.holds = [(T0, T0 + 2000)]
    attempts = [
        # 100 s after the checkpoint attempt 1 resumed from
        Attempt(
            number=0,
            started_at=T0 + 10,
            ended_at=T0 + 300,
            cause="node_lost",
            checkpoint_at=T0 + 200,
        ),
        # saved on SIGTERM, stored after its end: attempt 2 resumed from that, nothing lost
        Attempt(
            number=1,
            started_at=T0 + 310,
            ended_at=T0 + 500,
            cause="preempted_by_job",
            resumed_from="checkpoint-200",
            resumed_at=T0 + 200,
            checkpoint_at=T0 + 400,
        ),
        # attempt 3 resumed from a checkpoint stored before this one began: all 190 s lost
        Attempt(
            number=2,
            started_at=T0 + 510,
            ended_at=T0 + 700,
            cause="stuck",
            resumed_from="checkpoint-5000",
            resumed_at=T0 + 505,
        ),
        # a user's stop: not lost; the next two were followed by attempts that started over
        Attempt(
            number=3,
            started_at=T0 + 710,
            ended_at=T0 + 900,
            cause="stopped",
            resumed_from="checkpoint-5000",
            resumed_at=T0 + 505,
        ),
        Attempt(
            number=4,
            started_at=T0 + 910,
            ended_at=T0 + 1000,
            cause="command_failed",
            resumed_from="checkpoint-5000",
            resumed_at=T0 + 505,
            checkpoint_at=T0 + 950,
        ),
        Attempt(number=5, started_at=T0 + 1010, ended_at=T0 + 1100, cause="agent_lost"),
        # its own time limit: not lost
        Attempt(number=6, started_at=T0 + 1110, ended_at=T0 + 1990, cause="max_duration"),
    ]
    status = job.status().model_copy(update={
        "attempts": attempts, "state": JobState.FAILED,
        "history": [StatusEvent(state=JobState.CREATED, at=T0),
                    StatusEvent(state=JobState.FAILED, at=T0 + 1995)],
    })  # fmt: skip
    u = job_usage(job.record, status, now=T0 + DAY)
    assert [a.lost.held_s for a in u.attempts] == [100, 0, 190, 0, 90, 90, 0]
    assert u.lost.gpu_s == {"H100": pytest.approx(2 * 470)}
    assert u.usage.held_s == 2000


def test_a_last_attempt_lost_from_its_own_newest_checkpoint():
    job = Scripted(record("j", "nlp", T0, None, 1), bundle(None))
    job.holds = [(T0, T0 + 100)]
    job.attempts = [(T0 + 1, T0 + 90, "node_lost", T0 + 60)]
    job.end, job.state = T0 + 95, JobState.FAILED
    u = job_usage(job.record, job.status(), now=T0 + DAY)
    assert u.attempts[0].lost.held_s == 30 and u.lost.cpu_s == 4 * 30


def test_a_job_that_never_got_nodes_only_waited():
    job = Scripted(record("j", "nlp", T0, "H100", 1), bundle("H100"))
    job.end, job.state = T0 + 120, JobState.STOPPED
    u = job_usage(job.record, job.status(), now=T0 + DAY)
    assert (u.waiting_s, u.usage, u.lost) == (120, Usage(), Usage())

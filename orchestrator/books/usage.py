"""A job's usage from its status: what it held (GPU-, CPU- and memory-seconds), what that cost,
how long it waited in the queue, and what its faults lost.

Held is what the queue accounts: from each admission to the release of the job's nodes
(`JobStatus.holds`), whatever the ranks were doing meanwhile. Lost is, for each attempt a fault
or a preemption ended, the work done again: from the moment its progress was last kept to its
end, times what the job held then. Kept is the checkpoint the next attempt resumed from, when
that was stored (`Attempt.resumed_at`: one saved on SIGTERM after the end keeps it all; one
stored before the attempt began keeps none of it); for a last attempt, the newest checkpoint
stored while it ran (`Attempt.checkpoint_at`). A user's stop and the job's own time limit are
not faults. Every figure can be clipped to a window (`since`, `until`), so a day's books add up
to the day.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.books.cost import GIB, per_hour, unpriced
from orchestrator.scheduler.resources import GPU_PREFIX
from orchestrator.storage.records import Attempt, Hold, JobRecord, JobStatus

NOT_LOST = frozenset({"stopped", "max_duration"})  # attempt causes that cost no lost time
Span = tuple[float, float]


class Usage(BaseModel):
    """Resources held over some time, and their cost at the prices of their admission."""

    model_config = ConfigDict(frozen=True)

    held_s: float = 0.0  # wall seconds something was held
    gpu_s: dict[str, float] = Field(default_factory=dict)  # accelerator type -> GPU-seconds
    cpu_s: float = 0.0
    memory_gib_s: float = 0.0
    cost: float = 0.0
    unpriced: list[str] = Field(default_factory=list)  # GPU types held with no price set

    def __add__(self, other: Usage) -> Usage:
        gpu = dict(self.gpu_s)
        for kind, seconds in other.gpu_s.items():
            gpu[kind] = gpu.get(kind, 0.0) + seconds
        return Usage(
            held_s=self.held_s + other.held_s, gpu_s=gpu, cpu_s=self.cpu_s + other.cpu_s,
            memory_gib_s=self.memory_gib_s + other.memory_gib_s, cost=self.cost + other.cost,
            unpriced=sorted({*self.unpriced, *other.unpriced}),
        )  # fmt: skip

    @property
    def gpu_hours(self) -> float:
        return sum(self.gpu_s.values()) / 3600

    @classmethod
    def total(cls, usages: Iterable[Usage]) -> Usage:
        out = cls()
        for usage in usages:
            out = out + usage
        return out


class AttemptUsage(BaseModel):
    model_config = ConfigDict(frozen=True)

    number: int
    cause: str | None  # None: it completed (or runs)
    started_at: float
    ended_at: float | None
    usage: Usage
    lost: Usage  # from its last stored checkpoint to its end, when a fault ended it


class JobUsage(BaseModel):
    """One job's books over a window."""

    model_config = ConfigDict(frozen=True)

    job_id: str
    project: str
    team: str | None
    job_name: str | None
    state: str
    pushed_at: float
    ended_at: float | None
    usage: Usage  # held, admission to release
    waiting_s: float  # in the queue: before its first admission, and after each requeue
    lost: Usage  # what its faults and preemptions cost
    attempts: list[AttemptUsage]


def job_usage(
    record: JobRecord, status: JobStatus, now: float,
    since: float | None = None, until: float | None = None,
) -> JobUsage:  # fmt: skip
    """The job's books between `since` and `until` (None: unbounded), as of `now`."""
    end = ended_at(status)
    horizon = end if end is not None else now  # where what is still open ends
    window = (float("-inf") if since is None else since, float("inf") if until is None else until)
    holds = [(h, (h.since, h.until if h.until is not None else horizon)) for h in status.holds]
    waits_now = end is None and not (status.holds and status.holds[-1].until is None)
    tried = status.attempts
    attempts = [_attempt(a, tried[i + 1] if i + 1 < len(tried) else None, holds, window, horizon)
                for i, a in enumerate(tried)]  # fmt: skip
    return JobUsage(
        job_id=record.job_id, project=record.project, team=record.team,
        job_name=record.spec.job.name, state=status.state.value,
        pushed_at=record.created_at, ended_at=end,
        usage=Usage.total(held(hold, span, window) for hold, span in holds),
        waiting_s=sum(_length(_clip(span, window))
                      for span in waiting_spans(record.created_at, holds, horizon, waits_now)),
        lost=Usage.total(a.lost for a in attempts),
        attempts=attempts,
    )  # fmt: skip


def ended_at(status: JobStatus) -> float | None:
    """When the job reached its end state; None while it lives."""
    return status.history[-1].at if status.state.is_terminal else None


def held(hold: Hold, span: Span, window: Span) -> Usage:
    """What `hold` held over the part of `span` inside `window`."""
    seconds = _length(_clip(span, window))
    if seconds <= 0:
        return Usage()
    per_node, nodes, rates = hold.bundle, hold.nodes, hold.prices
    gpu = {k[len(GPU_PREFIX):]: v * nodes * seconds for k, v in per_node.items()
           if k.startswith(GPU_PREFIX) and v}  # fmt: skip
    hourly = per_hour(per_node, nodes, rates)
    return Usage(
        held_s=seconds, gpu_s=gpu, cpu_s=per_node.get("CPU", 0.0) * nodes * seconds,
        memory_gib_s=per_node.get("memory", 0.0) / GIB * nodes * seconds,
        cost=hourly * seconds / 3600, unpriced=unpriced(per_node, rates),
    )  # fmt: skip


def waiting_spans(
    pushed_at: float, holds: Sequence[tuple[Hold, Span]], horizon: float, waits_now: bool
) -> list[Span]:
    """In the queue: from the push to the first admission, from each release to the next
    admission, and from the last release to `horizon` when it `waits_now` (a job never
    admitted waited from its push to its end)."""
    spans, start = [], pushed_at
    for _, (since, until) in holds:
        spans.append((start, since))
        start = until
    if waits_now or not holds:
        spans.append((start, horizon))
    return spans


def kept_until(attempt: Attempt, following: Attempt | None) -> float:
    """Up to when the attempt's progress was kept (see the module's docstring)."""
    end = attempt.ended_at if attempt.ended_at is not None else float("inf")
    kept = attempt.checkpoint_at
    if following is not None and following.resumed_at is not None:
        kept = following.resumed_at
    elif following is not None and following.resumed_from is None:
        kept = None  # it started over
    return min(end, max(attempt.started_at, kept or attempt.started_at))


def _attempt(
    attempt: Attempt, following: Attempt | None, holds: Sequence[tuple[Hold, Span]],
    window: Span, horizon: float,
) -> AttemptUsage:  # fmt: skip
    end = attempt.ended_at if attempt.ended_at is not None else horizon
    span = (attempt.started_at, end)
    usage = Usage.total(held(h, _clip(s, span), window) for h, s in holds)
    lost = Usage()
    if attempt.cause is not None and attempt.cause not in NOT_LOST:
        kept = kept_until(attempt, following)
        lost = Usage.total(held(h, _clip(s, (kept, end)), window) for h, s in holds)
    return AttemptUsage(
        number=attempt.number, cause=attempt.cause, started_at=attempt.started_at,
        ended_at=attempt.ended_at, usage=usage, lost=lost,
    )  # fmt: skip


def _clip(span: Span, window: Span) -> Span:
    return max(span[0], window[0]), min(span[1], window[1])


def _length(span: Span) -> float:
    return max(0.0, span[1] - span[0])

"""Which queued jobs start, which running jobs give way, and why every other job waits.

Pure: the queue service hands `SchedulingPolicy.decide` a snapshot (queued jobs, running jobs and
where their bundles are, each node's capacity and free resources, the teams' quotas) and carries
out the `Decision`. The rules (docs/architecture.md#the-job-queue says them for users):

1. Quota. A team's running jobs, in the order they started: a job *borrows* where its team's use
   of a resource it takes that the quota limits, counting it and the jobs before it, passes the
   quota; the others are its own. Recomputed every decision: a job becomes its team's own when
   jobs before it end or the quota grows, and admitting a job never makes another borrow. A
   queued job is *within* its quota when it fits the quota, in each resource it uses, beside
   everything its team runs and holds room for; a team without a quota is always within.
2. Order. First the jobs that waited `hold_after_s` within their quota (oldest push first; the
   job one gave way to, if of these groups, is served just before it); then those
   whose preemption freed room for them; then every other job within its quota, then the jobs
   beyond it (first those that preempting teammates would bring within it). In the last two,
   within a team higher `priority` goes first, then earlier push; across teams the next job is
   the head of the team furthest below its share (dominant share: the largest fraction of its
   quota, or of the cluster where it has none, its running and already-ordered jobs use).
3. Admission. A job starts when its bundles fit the free resources (one node per bundle, or all
   on one when colocated). A job beyond its quota borrows only what is left once every job
   within its quota was considered: capacity none of them can use now; and not while a job of
   its team holds room (rule 4), whose quota it would take once that room frees.
4. Preemption. A job within its quota that does not fit may preempt borrowed jobs of teams still
   over their quota; lower-priority jobs of its own team only where `within_team` allows it
   (never by default, as Kueue; `resumable`: jobs that resume from a checkpoint; `always`), and
   once they have run `hold_after_s`: else a busy team could stop a job the hold started (rule
   5) each time before its first checkpoint.
   The victims are a minimal set: each one is needed for the job to fit (its nodes, or its
   team's quota). What they free is held for that job, and a preempted job does not start again
   before the job it gave way to has started: no livelock.
5. No starvation. A job within its quota that waited `hold_after_s` since its push goes first;
   if it cannot start or make room, the nodes closest to holding it are kept for it: nothing
   else is placed there until it starts, whatever its team, share or priority.
6. A job that does not fit the cluster even empty can never start (unless it autoscales).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from heapq import nsmallest

from orchestrator.scheduler.fitting import (
    impossible,
    needs,
    node_kinds,
    place,
    released,
    shortfall,
    take,
)
from orchestrator.scheduler.model import (
    Admit,
    ClusterSnapshot,
    Decision,
    Demand,
    Node,
    Preempt,
    QueuedJob,
    RunningJob,
    Waiting,
    WithinTeam,
)
from orchestrator.scheduler.preemption import (
    minimal_victims,
    victim_order,
    why_preempted,
    why_spared,
    would_make_room,
)
from orchestrator.scheduler.reasons import WITHIN_TEAM_SETTING, needs_text, quota_text, room_text
from orchestrator.scheduler.resources import Resources, total
from orchestrator.scheduler.shares import (
    borrowed_jobs,
    fits_quota,
    order,
    still_over,
    usage_by_team,
)

__all__ = ["DEFAULT_HOLD_AFTER_S", "WITHIN_TEAM_SETTING", "Admit", "ClusterSnapshot", "Decision",
           "Demand", "Node", "Preempt", "QueuedJob", "RunningJob", "SchedulingPolicy", "Waiting",
           "WithinTeam"]  # fmt: skip

DEFAULT_HOLD_AFTER_S = 600.0
_NOTHING = Resources()


class SchedulingPolicy:
    def __init__(
        self, hold_after_s: float = DEFAULT_HOLD_AFTER_S,
        within_team: WithinTeam = WithinTeam.NEVER,
    ) -> None:  # fmt: skip
        self.hold_after_s = hold_after_s
        self.within_team = WithinTeam(within_team)

    def decide(self, snap: ClusterSnapshot) -> Decision:
        return _Cycle(snap, self).run()


class _Cycle:
    """One decision's working state: what is free, what each team uses, who waits and why."""

    def __init__(self, snap: ClusterSnapshot, policy: SchedulingPolicy) -> None:
        self.snap, self.policy = snap, policy
        self.free = {n.node_id: n.free for n in snap.nodes}  # reserved nodes are taken out
        self.capacity = {n.node_id: n.capacity for n in snap.nodes}
        self.usage = usage_by_team(snap.running)
        self.running = [r for r in snap.running if not r.leaving]  # may still be preempted
        self.leaving_for: dict[str, list[RunningJob]] = {}
        for r in snap.running:
            if r.leaving and r.leaving_for is not None:
                self.leaving_for.setdefault(r.leaving_for, []).append(r)
        self.lenders = borrowed_jobs(snap.running, snap.quotas)  # reclaimable by other teams
        self.decision = Decision()
        self.waiting: list[tuple[str, str]] = []  # (job, why), in the order they are served
        self.started: set[str] = set()
        self.ahead_done: set[str] = set()  # served in rule 2's first two groups
        self.pending: set[str] = set()  # queued and able to start some day
        self.changes = 0  # admissions, holds and kept nodes: what makes remembered reasons stale
        # Jobs alike (same demand, team, priority, standing) fare alike until something is
        # admitted, preempted or kept: why they wait is remembered (1,000 jobs, few shapes).
        self.alike: dict[tuple, str] = {}
        self.memo: dict[tuple, object] = {}  # placements and candidates, until the next change
        self.within: dict[tuple, bool] = {}  # (team, demand) -> within quota, until team use grows
        self.texts: dict[str, str] = {}  # by demand: "needs 2 nodes with 8 H100, 32 CPU"
        # By (team, priority): whom a job may preempt, and whom the rules protect; until a
        # preemption changes who runs.
        self.candidates: dict[tuple, tuple[list[RunningJob], list[RunningJob], list[RunningJob]]]
        self.candidates = {}
        self.why_spared: dict[str, str] = {}  # running job -> why its own team may not preempt it
        # By demand: what one node must hold, the nodes that hold it now, those that could.
        self.nodes_for: dict[str, tuple[Resources, set[str], set[str]]] = {}
        # By demand, by node: how far the node's free resources are from one bundle.
        self.gaps: dict[str, dict[str, float]] = {}
        self.held_nodes: set[str] = set()  # nodes of decision.held
        self.holding: dict[str | None, str] = {}  # team -> a job of it that holds room
        # Nodes alike (the same capacity; the same free resources) hold a bundle alike: each
        # question is asked once per kind of node, not once per node.
        self.kinds = node_kinds(self.capacity)
        self.free_kinds: list[tuple[Resources, list[str]]] | None = None  # until free changes

    def run(self) -> Decision:
        snap, hold = self.snap, self.policy.hold_after_s
        if not snap.autoscaling:  # rule 6, asked before anything is kept: every node counts
            self.decision.impossible = impossible(snap.queued, snap.nodes, self._useful)
        jobs = [j for j in snap.queued if j.job_id not in self.decision.impossible]
        self.pending = {j.job_id for j in jobs}
        claims = set(self.leaving_for) | {j.preempted_by for j in jobs if j.preempted_by}
        by_push = sorted(jobs, key=lambda j: (j.pushed_at, j.job_id))
        ahead = {j.job_id: j for j in by_push if snap.now - j.pushed_at >= hold and self._within(j)}
        held = set(ahead)  # then those claiming room their preemptions freed
        ahead.update((j.job_id, j) for j in by_push if j.job_id in claims and j.job_id not in held
                     and self._within(j, self.leaving_for.get(j.job_id, [])))  # fmt: skip
        # One that gave way to a job served here goes right after it (as it will next time);
        # one that gave way to another job waits with the rest.
        while out := {i for i in held if self._gave_way(ahead[i])
                      and ahead[i].preempted_by not in ahead}:  # fmt: skip
            held -= out
            ahead = {i: j for i, j in ahead.items() if i not in out}
        rest = [j for j in jobs if j.job_id not in ahead]
        for job in list(ahead.values()):
            if (by := ahead.get(job.preempted_by or "")) is not None and self._gave_way(job):
                self._serve_ahead(by, by.job_id in held, rest)
            self._serve_ahead(job, job.job_id in held, rest)
        beyond = []
        for job in order(rest, self.usage, snap.quotas, total(self.capacity.values())):
            if self._within(job):
                self._serve(job, True)
            else:
                beyond.append(job)  # borrows only what no job within its quota can use
        # First those that preempting teammates would bring within: no borrower takes that room.
        can: dict[tuple, bool] = {}  # by team, priority and demand: jobs alike fare alike
        for j in beyond:
            if (key := (j.team, j.priority, j.demand.key)) not in can:
                can[key] = self._within(j, self._candidates(j)[0])
        if any(can.values()):
            beyond.sort(key=lambda j: not can[j.team, j.priority, j.demand.key])
        for job in beyond:  # not while its team holds quota: a borrower ranks first once it frees
            self._serve(job, False, may_borrow=job.team not in self.holding)
        self.decision.waiting = [
            Waiting(job_id, position, why)
            for position, (job_id, why) in enumerate(self.waiting, start=1)
        ]
        queued = {j.job_id: j for j in snap.queued}
        started = [  # in the order they were admitted, as the service records them
            RunningJob(a.job_id, queued[a.job_id].team, queued[a.job_id].priority,
                       snap.now + i * 1e-6, queued[a.job_id].demand, a.placed_on)
            for i, a in enumerate(self.decision.admit)
        ]  # fmt: skip
        self.decision.borrowed = borrowed_jobs([*snap.running, *started], snap.quotas)
        return self.decision

    # -- one job ---------------------------------------------------------------------------------

    def _serve_ahead(self, job: QueuedJob, held: bool, rest: list[QueuedJob]) -> None:
        """Rule 2's first groups, each job once: past the hold (still within, else `rest`)."""
        if job.job_id in self.ahead_done:
            return
        self.ahead_done.add(job.job_id)
        if not held:
            self._serve(job, self._within(job))
        elif self._within(job):  # a job of its team held before may have used the quota
            self._serve(job, True, held=True)
        else:
            rest.append(job)

    def _serve(
        self, job: QueuedJob, within: bool, held: bool = False, may_borrow: bool = False
    ) -> None:
        """Admit `job`, make room for it, keep nodes for it, or say why it waits. `within`: it
        fits its team's quota now."""
        self.decision.served.append(job.job_id)
        if self._gave_way(job):
            self._wait(job, f"gave way to {job.preempted_by}, which has not started yet: it "
                            "starts again after it")  # fmt: skip
            return
        mine = job.job_id if job.job_id in self.leaving_for else None  # its own leaving victims
        alike = (job.demand.key, job.team, job.priority, within, held, may_borrow, mine)
        if (why := self.alike.get(alike)) is not None:
            self._wait(job, why, held)
            return
        if within or may_borrow:
            spot = self._place(job.demand)
            if spot is not None:
                self._admit(job, spot, borrowed=not within)
                return
        changes = self.changes
        why = self._make_room(job)
        if why is None:
            spared = self._not_preempted(job)
            why = self._keep_nodes(job) if held else self._why_waiting(job, within)
            why += spared
        if self.changes == changes:
            self.alike[alike] = why
        self._wait(job, why, held)

    def _wait(self, job: QueuedJob, why: str, held: bool = False) -> None:
        if held:
            why = f"waited {self.snap.now - job.pushed_at:.0f} s, past the hold: {why}"
        self.waiting.append((job.job_id, why))

    def _admit(self, job: QueuedJob, spot: tuple[str, ...], borrowed: bool) -> None:
        self.decision.admit.append(Admit(job.job_id, spot, borrowed))
        take(self.free, job.demand, spot)
        self.started.add(job.job_id)
        self._count(job)
        self._changed(spot)

    def _changed(self, nodes: Sequence[str]) -> None:
        """`nodes`' free resources changed (or they were kept for a job): forget what was
        worked out from them, and bring the sets of fitting and useful nodes up to date."""
        self.changes += 1
        self.alike.clear()
        self.memo.clear()
        self.free_kinds = None
        for gaps in self.gaps.values():
            for node in nodes:
                gaps.pop(node, None)
        for need, fitting, useful in self.nodes_for.values():
            for node in nodes:
                if node in self.free and need.fits_in(self.free[node]):
                    fitting.add(node)
                else:
                    fitting.discard(node)
                if node not in self.free:
                    useful.discard(node)

    def _place(self, demand: Demand) -> tuple[str, ...] | None:
        key = ("place", demand.key)
        if key not in self.memo:
            self.memo[key] = place(demand, self.free, self._fitting(demand))
        return self.memo[key]  # type: ignore[return-value]

    def _fitting(self, demand: Demand) -> set[str]:
        """The nodes whose free resources hold one of `demand`'s bundles now."""
        return self._nodes_for(demand)[1]

    def _useful(self, demand: Demand) -> set[str]:
        """The nodes (not kept for another job) that could hold one of `demand`'s bundles."""
        return self._nodes_for(demand)[2]

    def _nodes_for(self, demand: Demand) -> tuple[Resources, set[str], set[str]]:
        if demand.key not in self.nodes_for:
            need, _ = needs(demand)
            if self.free_kinds is None:
                self.free_kinds = node_kinds(self.free)
            fitting = {n for room, nodes in self.free_kinds if need.fits_in(room) for n in nodes}
            useful = {
                n for capacity, nodes in self.kinds if need.fits_in(capacity)
                for n in nodes if n in self.free
            }  # fmt: skip
            self.nodes_for[demand.key] = need, fitting, useful
        return self.nodes_for[demand.key]

    def _count(self, job: QueuedJob) -> None:
        self.usage[job.team] = self.usage.get(job.team, _NOTHING) + job.demand.total
        self.within.clear()

    def _gave_way(self, job: QueuedJob) -> bool:
        """Preempted for a job that has not started yet (and still may): it goes first."""
        by = job.preempted_by
        return by is not None and by in self.pending and by not in self.started

    # -- quotas ----------------------------------------------------------------------------------

    def _within(self, job: QueuedJob, victims: Sequence[RunningJob] = ()) -> bool:
        """Whether `job` fits its team's quota beside what the team runs (and holds room for),
        less `victims`, in each resource it uses: one admitted within it is its team's own."""
        quota = self.snap.quotas.get(job.team or "")
        if not quota:
            return True
        used = self.usage.get(job.team, _NOTHING)
        if victims:
            gone = [v.demand.total for v in victims if v.team == job.team]
            return fits_quota(quota, used, job.demand.total, gone)
        key = (job.team, job.demand.key)
        if (within := self.within.get(key)) is None:
            within = self.within[key] = fits_quota(quota, used, job.demand.total)
        return within

    # -- making room -----------------------------------------------------------------------------

    def _make_room(self, job: QueuedJob) -> str | None:
        """Room for `job` from the jobs already leaving for it, else from a minimal set of
        jobs it may preempt; what it finds is held for it. None: no room can be made."""
        mine = self.leaving_for.get(job.job_id, [])
        base = released(self.free, mine) if mine else self.free
        if mine and self._within(job, mine):
            spot = place(job.demand, base)
            if spot is not None:
                self._hold(job, spot)
                return "waiting for preempted jobs to leave"
        allowed, _, _ = self._candidates(job)
        victims = self._victims(job, base, allowed, mine)
        if victims is None:
            return None
        spot = place(job.demand, released(base, victims))
        assert spot is not None
        for v in victims:
            self.running.remove(v)
            self.candidates.clear()
            why = f"preempted by {job.job_id}: {why_preempted(v, job)}"
            self.decision.preempt.append(Preempt(v.job_id, job.job_id, why))
        self._hold(job, spot)
        return f"preempting {', '.join(v.job_id for v in victims)} to make room"

    def _not_preempted(self, job: QueuedJob) -> str:
        """Why `job` waits although preempting jobs of its own team would make room ("" if
        it would not); each such job notes why it was spared."""
        _, protected, everyone = self._candidates(job)
        if not protected:
            return ""
        mine = self.leaving_for.get(job.job_id, [])
        base = released(self.free, mine) if mine else self.free
        victims = self._victims(job, base, everyone, mine)
        whys = {v.job_id: self.why_spared[v.job_id] for v in victims or () if v in protected}
        if not whys:
            return ""
        for job_id, why in whys.items():
            self.decision.spared.setdefault(job_id, f"not preempted for {job.job_id}: {why}")
        return would_make_room(whys)

    def _candidates(
        self, job: QueuedJob
    ) -> tuple[list[RunningJob], list[RunningJob], list[RunningJob]]:
        """Whom `job` may preempt, in the order they go (lowest priority, then the most recently
        started), the lower-priority jobs of its team that `within_team`, or having run less
        than `hold_after_s`, protects, and both."""
        key = (job.team, job.priority)
        if key not in self.candidates:
            mode, hold, now = self.policy.within_team, self.policy.hold_after_s, self.snap.now
            allowed, protected = [], []
            for r in self.running:
                if r.team != job.team:
                    if r.job_id in self.lenders:
                        allowed.append(r)
                elif r.priority < job.priority:
                    if (why := why_spared(r, mode, now - r.started_at, hold)) is not None:
                        self.why_spared[r.job_id] = why
                    (allowed if why is None else protected).append(r)
            self.candidates[key] = (
                victim_order(allowed),
                victim_order(protected),
                victim_order(allowed + protected),
            )
        return self.candidates[key]

    def _victims(
        self, job: QueuedJob, base: Mapping[str, Resources], candidates: Sequence[RunningJob],
        leaving: Sequence[RunningJob],
    ) -> list[RunningJob] | None:  # fmt: skip
        useful = self._useful(job.demand)
        fitting = None if leaving else self._fitting(job.demand) & useful
        return minimal_victims(
            job, base, candidates, leaving, useful, fitting,
            within=lambda victims: self._within(job, victims),
            over_quota=lambda c, chosen: still_over(self.snap.quotas, self.usage, c, chosen),
        )  # fmt: skip

    def _hold(self, job: QueuedJob, spot: tuple[str, ...]) -> None:
        """What `job` will start on is taken from `free` now (below zero until its victims
        have left), and its quota use counted: nothing after it takes either."""
        take(self.free, job.demand, spot)
        self.decision.held[job.job_id] = spot
        self.held_nodes.update(spot)
        self.holding.setdefault(job.team, job.job_id)
        self._count(job)
        self._changed(spot)

    def _keep_nodes(self, job: QueuedJob) -> str:
        """Rule 5: the nodes closest to holding `job` are kept for it (taken out of `free`)."""
        need, count = needs(job.demand)
        why = self._why_waiting(job, True)
        eligible = self._useful(job.demand) - self.held_nodes  # not held for another job
        gaps = self.gaps.setdefault(job.demand.key, {})
        for node in eligible - gaps.keys():
            gaps[node] = shortfall(need, self.free[node])
        kept = tuple(nsmallest(count, eligible, key=lambda n: (gaps[n], n)))
        if not kept:
            return f"{why}; the nodes it needs are kept or held for jobs that go first"
        for node in kept:
            del self.free[node]
        self.decision.reserved[job.job_id] = kept
        self._changed(kept)
        many = len(kept) > 1
        return (f"{why}; the {len(kept)} node{'s' if many else ''} closest to holding it "
                f"{'are' if many else 'is'} kept for it until it starts")  # fmt: skip

    def _why_waiting(self, job: QueuedJob, within: bool) -> str:
        key = ("room", job.demand.key)
        if key not in self.memo:
            if job.demand.key not in self.texts:
                self.texts[job.demand.key] = needs_text(job.demand)
            fitting = len(self._fitting(job.demand))
            kept = bool(self.decision.reserved)
            self.memo[key] = room_text(self.texts[job.demand.key], fitting, kept)
        room = str(self.memo[key])
        if within:
            return room
        if (holder := self.holding.get(job.team)) is not None:
            return (f"team {job.team}'s quota is held for {holder}, whose preempted jobs are "
                    f"leaving: none of its jobs borrows before it starts: {room}")  # fmt: skip
        want = job.demand.total
        quota = {k: v for k, v in self.snap.quotas.get(job.team or "", {}).items() if want.get(k)}
        return quota_text(job.team, quota, self.usage.get(job.team, _NOTHING), want, room)

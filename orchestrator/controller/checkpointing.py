"""The controller's side of checkpoints: resolving checkpoints to load, and the node uploaders."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from orchestrator.agents.checkpoint_uploader import CheckpointUploader
from orchestrator.agents.messages import EventCursor, StoredCheckpoint, UploaderFlush
from orchestrator.agents.node_agent import uploader_name
from orchestrator.agents.services import NAMESPACE, actor_class
from orchestrator.controller.resume_point import TrainCommit, resume_point, train_resume_point
from orchestrator.errors import CheckpointNotFound, JobNotFound, RestoreFailed
from orchestrator.node.rank_writes import RankWrites
from orchestrator.spec.checkpoints import (
    _BasetenLatestCheckpoint,
    _BasetenNamedCheckpoint,
    _LoopsCheckpoint,
)
from orchestrator.storage.checkpoints import CheckpointStore, Manifest
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.records import CheckpointEntry, CheckpointSummary, JobRecord
from orchestrator.storage.root import StorageRoot
from orchestrator.storage.train_reports import TrainRun, read_train_runs

# How often the uploaders are asked: also how old a lost rank's last word can be
# (controller/resume_point.py waits QUIET_MARGIN_S past another rank's checkpoint for it).
POLL_EVERY_S = 1.0


def resolve_checkpoints(record: JobRecord, store: JobStore) -> list[Manifest]:
    """The checkpoints `load_checkpoint_config` names, every rank's copy of each.

    Raises CheckpointNotFound naming the first reference that matches nothing.
    """
    load = record.spec.job.runtime.load_checkpoint_config
    if load is None or not load.enabled:
        return []
    checkpoints = CheckpointStore(store.root)
    found: list[Manifest] = []
    for i, ref in enumerate(load.checkpoints):
        where = f"load_checkpoint_config.checkpoints[{i}]"
        if isinstance(ref, _LoopsCheckpoint):
            raise CheckpointNotFound(f"{where}: Loops checkpoints are not available here")
        if isinstance(ref, _BasetenNamedCheckpoint):
            project = _record_of(ref.job_id, store, where).project_key
            matches = [
                m for m in checkpoints.list(project, ref.job_id) if m.name == ref.checkpoint_name
            ]
            if not matches:
                raise CheckpointNotFound(
                    f"{where}: job {ref.job_id} has no checkpoint named {ref.checkpoint_name!r}"
                )
            broken = next((m for m in matches if not m.complete), None)
            if broken is not None:
                raise CheckpointNotFound(
                    f"{where}: checkpoint {ref.checkpoint_name!r} of job {ref.job_id} is "
                    f"incomplete ({broken.incomplete_reason}); `orchestrator checkpoints download "
                    f"--job-id {ref.job_id} --name {ref.checkpoint_name}` fetches it to look at"
                )
            found += matches
            continue
        assert isinstance(ref, _BasetenLatestCheckpoint)
        found += _latest(ref, record, store, checkpoints, where)
    clashes = _clashes(found)
    if clashes:
        raise CheckpointNotFound(
            f"load_checkpoint_config: {', '.join(clashes)} would be loaded from more than one "
            "job into the same place; load one checkpoint of each name"
        )
    return found


def _clashes(manifests: list[Manifest]) -> list[str]:
    seen: dict[tuple[int, str], str] = {}
    clashes = []
    for m in manifests:
        key = (m.node_rank, m.name)
        if seen.setdefault(key, m.job_id) != m.job_id:
            clashes.append(f"rank-{m.node_rank}/{m.name}")
    return clashes


def _latest(
    ref: _BasetenLatestCheckpoint,
    record: JobRecord,
    store: JobStore,
    checkpoints: CheckpointStore,
    where: str,
) -> list[Manifest]:
    if ref.job_id:
        owner = _record_of(ref.job_id, store, where)
        if ref.project_name and ref.project_name not in (owner.project, owner.project_key):
            raise CheckpointNotFound(
                f"{where}: job {ref.job_id} is of project {owner.project!r}, not "
                f"{ref.project_name!r}"
            )
        candidates = [owner]
        scope = f"job {ref.job_id}"
    else:
        project = ref.project_name or record.project  # a name or an id
        jobs = [
            r for r in store.records()
            if project in (r.project, r.project_key) and r.job_id != record.job_id
        ]  # fmt: skip
        candidates = sorted(jobs, key=lambda r: r.created_at, reverse=True)
        scope = f"project {project!r}"
    for job in candidates:
        # An incomplete checkpoint (its writer died before it was whole) is never "latest", nor
        # a trainer's books of its checkpoints kept at the top (`bookkeeping`).
        manifests = [
            m for m in checkpoints.list(job.project_key, job.job_id)
            if m.complete and not m.bookkeeping
        ]  # fmt: skip
        if manifests:
            newest = max(manifests, key=lambda m: m.created_at).name
            return [m for m in manifests if m.name == newest]
    raise CheckpointNotFound(f"{where}: {scope} has no complete uploaded checkpoint to load")


def _record_of(job_id: str, store: JobStore, where: str) -> JobRecord:
    try:
        return store.record(job_id)
    except JobNotFound:
        raise CheckpointNotFound(f"{where}: no job {job_id!r} in {store.root.url}") from None


class Uploaders:
    """One CheckpointUploader per rank, in that rank's bundle; polled while the job runs."""

    def __init__(self, record: JobRecord, bundle: Callable[[int], Any], group_size: int) -> None:
        """Started with the agents, so their workers start while the nodes prepare; each
        watches once its agent has noted what the checkpoint directory held before the job.
        `bundle(rank)`: the scheduling strategy that puts an actor in that rank's bundle."""
        checkpointing = record.spec.job.runtime.checkpointing_config
        settings = record.checkpoint_upload.model_dump()
        self.train_run = record.spec.job.ray_train is not None  # commits say what is whole
        self.actors = [
            actor_class(CheckpointUploader)
            .options(
                name=uploader_name(record.job_id, rank),
                namespace=NAMESPACE,
                num_cpus=0,
                # A killed uploader comes back and redoes what it had not committed.
                max_restarts=-1,
                max_task_retries=-1,
                scheduling_strategy=bundle(rank),
            )
            .remote(
                record.project_key,
                record.job_id,
                rank,
                record.storage_root,
                checkpointing.checkpoint_path,
                settings,
                checkpointing.volume_size_gib,
                outage_s=record.storage.outage_s,
                train_run=self.train_run,
            )
            for rank in range(group_size)
        ]
        self.flush_timeout_s = record.checkpoint_upload.flush_timeout_s
        self._cursors = [EventCursor()] * len(self.actors)
        self._last_poll = 0.0
        self.last_stored: dict[int, StoredCheckpoint] = {}  # rank -> its newest stored
        # What earlier attempts' ends found, by "rank-N/name": a lost node's uploader starts
        # again knowing nothing of them.
        self._earlier: dict[str, CheckpointEntry] = {}
        self.attempt = 0  # the attempt the ranks are at (begin_attempt)
        self.store = CheckpointStore(StorageRoot(record.storage_root))
        self.project, self.job_id = record.project_key, record.job_id
        # What each rank was seen writing, as its uploader last said (a lost node's too), over
        # the job's attempts: the resume point's evidence (controller/resume_point.py).
        self.writes: dict[int, RankWrites] = {}
        self._said: list[str] = []  # the controller's own lines, out with the next poll
        self.resumed_at: float | None = None  # when the last resume point was stored

    def wait_ready(self, timeout: float = 60) -> None:
        """Until every uploader watches its directory: a checkpoint renamed into place in the
        commands' first moment is seen as renamed."""
        if not all(ray.get([actor.ready.remote() for actor in self.actors], timeout=timeout)):
            raise TimeoutError("a checkpoint uploader did not start watching within 60 s")

    def poll(self) -> tuple[list[str], str | None]:
        """New event lines (the controller's own first), and the over-volume error of a rank
        if one is over; the uploaders are asked at most every POLL_EVERY_S."""
        lines, self._said = self._said, []
        if time.monotonic() - self._last_poll < POLL_EVERY_S:
            return lines, None
        self._last_poll = time.monotonic()
        over = None
        refs = [actor.poll.remote(self._cursors[i]) for i, actor in enumerate(self.actors)]
        for i, ref in enumerate(refs):
            try:
                state = ray.get(ref, timeout=2)
            except Exception:
                continue  # restarting; the final flush reports it
            lines += state.events
            self._cursors[i] = state.next
            over = over or state.over_volume
            if state.last_stored is not None:
                self.last_stored[i] = state.last_stored
            self._note(i, state.writes)
        return lines, over

    def end_attempt(self, endings: list[RankEnding], timeout: float, lost: set[int]) -> list[str]:
        """Between attempts: every rank but the `lost` uploads what its commands left, within
        `timeout`; the uploaders go on watching. Event lines (each uploader's unread ones)."""
        refs = {
            e.rank: self.actors[e.rank].end_attempt.remote(timeout, e.clean, e.how)
            for e in endings
            if e.rank not in lost
        }
        lines = [
            f"[rank {rank}] [checkpoints] what this rank had not stored when it was lost is lost"
            for rank in sorted(lost)
        ]
        if lost:  # what a lost rank did store, as its uploader would have said
            for m in self.store.list(self.project, self.job_id):
                if m.node_rank in lost:
                    entry = CheckpointEntry(
                        rank=m.node_rank, name=m.name,
                        state="uploaded" if m.complete else "incomplete",
                        reason=m.incomplete_reason, files=len(m.files), size_bytes=m.size_bytes,
                    )  # fmt: skip
                    self._earlier[entry.key] = entry
        for rank, ref in refs.items():
            try:
                result = ray.get(ref, timeout=timeout + 10)
            except Exception as e:
                lines.append(f"[rank {rank}] [checkpoints] uploader unreachable: {e}")
                continue
            lines += self._unread(rank, result)
            self._earlier.update({entry.key: entry for entry in result.entries})
            self._note(rank, result.writes)
        return lines

    def _note(self, rank: int, report: RankWrites | None) -> None:
        if report is not None:
            known = self.writes.get(rank)
            self.writes[rank] = known.merged(report) if known is not None else report

    def earlier(self) -> dict[str, CheckpointEntry]:
        """What the ended attempts' checkpoints became: for the uploaders that follow these
        when the job moves to other nodes (after the queue preempted it)."""
        return dict(self._earlier)

    def carry(self, earlier: Uploaders) -> None:
        """Take over what the uploaders of the job's earlier placement knew: what their
        attempts' checkpoints became, and what each rank was seen writing."""
        self._earlier.update(earlier.earlier())
        for rank, report in earlier.writes.items():
            self._note(rank, report)

    def begin_attempt(self, number: int, check_stop: Callable[[], None]) -> str | None:
        """Put every rank at the job's resume point (see `resume_point`) before attempt
        `number`, however long the restores take (a stop still ends it); the checkpoint's name,
        if the job has one. RestoreFailed says which rank could not be put there, and why."""
        self.attempt = number
        manifests = self.store.list(self.project, self.job_id)
        snapshot = None
        if self.train_run:
            commits = train_commits(read_train_runs(self.store.root, self.job_id), manifests)
            point = train_resume_point(manifests, commits, len(self.actors))
            snapshot = train_snapshot(point.commit)
        else:
            point = resume_point(manifests, self.writes, len(self.actors))
        self._said.append(
            _line(f"attempt {number} resumes from {point.name or 'the start'}: {point.why}")
        )
        parts = [*point.copies.values(), *(m for ms in point.parts.values() for m in ms)]
        self.resumed_at = max((m.created_at for m in parts), default=None) if point.name else None
        refs = [
            actor.begin_attempt.remote(
                number,
                point.copies.get(rank),
                point.newer.get(rank, []),
                point.top.get(rank),
                point.parts.get(rank, []),
                snapshot if rank == 0 else None,
            )
            for rank, actor in enumerate(self.actors)
        ]
        pending = list(refs)
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_EVERY_S)
            check_stop()
        for rank, ref in enumerate(refs):
            try:
                ray.get(ref)
            except Exception as e:
                what = f"restoring {point.name} on rank {rank}" if point.name else f"rank {rank}"
                raise RestoreFailed(f"{what} before attempt {number} failed: {e}") from e
        return point.name

    def _unread(self, rank: int, result: UploaderFlush) -> list[str]:
        """The events of `rank` not said yet (all of a restarted uploader's new list)."""
        start = self._cursors[rank].start_in(result.incarnation)
        self._cursors[rank] = EventCursor(result.incarnation, len(result.events))
        return result.events[start:]

    def writer_ended(self, ending: RankEnding) -> None:
        """Tell a rank's uploader at once that its commands ended (not waited for), unless
        they were an earlier attempt's."""
        if ending.attempt is not None and ending.attempt != self.attempt:
            return
        self.actors[ending.rank].writer_ended.remote(
            ending.clean, ending.how, ending.at, ending.attempt
        )

    def flush(
        self, endings: list[RankEnding], timeout: float | None = None
    ) -> tuple[list[str], CheckpointSummary]:
        """Upload what is left on every rank, within `timeout` (else the flush deadline)."""
        timeout = min(timeout or self.flush_timeout_s, self.flush_timeout_s)
        refs = [
            actor.flush.remote(timeout, e.clean, e.how)
            for actor, e in zip(self.actors, endings, strict=True)
        ]
        lines: list[str] = []
        entries: list[CheckpointEntry] = []
        unreachable: dict[str, str] = {}
        for rank, ref in enumerate(refs):
            try:
                result = ray.get(ref, timeout=timeout + 30)
            except Exception as e:
                unreachable[f"rank-{rank}"] = f"uploader unreachable: {type(e).__name__}"
                continue
            lines += self._unread(rank, result)
            entries += result.entries
        found = {e.key for e in entries}
        entries += [e for key, e in self._earlier.items() if key not in found]
        return lines, CheckpointSummary.of(entries, unreachable)


def train_commits(runs: list[TrainRun], manifests: Sequence[Manifest] = ()) -> list[TrainCommit]:
    """Every checkpoint Ray Train committed in the job's runs, as their stored rounds say, and
    as the parts stored say (`Manifest.train_parts`): a round may be lost with the driver's
    node (its writer stores rounds a second apart) after the uploaders had its commit."""
    commits = {
        r.checkpoint: TrainCommit(r.checkpoint, tuple(r.parts or ()), r.at, r.index,
                                  dict(r.metrics))
        for run in runs for r in run.reports if r.checkpoint
    }  # fmt: skip
    after = max((c.index for c in commits.values()), default=-1) + 1
    for m in sorted(manifests, key=lambda m: m.created_at):
        if m.train_parts and m.name not in commits:
            commits[m.name] = TrainCommit(m.name, tuple(m.train_parts), m.created_at, after)
            after += 1
    return list(commits.values())


def train_snapshot(commit: TrainCommit | None) -> str:
    """Train's run snapshot for the next attempt, on the driver's node (rank 0): the commit
    resumed from alone, so `ray.train.get_checkpoint()` returns it; "" (none) to start over."""
    if commit is None:
        return ""
    from orchestrator.agents.ray_train_seams import resume_snapshot, seams  # Ray Train: here only

    return resume_snapshot(seams(), commit.name, commit.metrics, commit.index)


def _line(message: str) -> str:
    """A controller line about the job's checkpoints, as JobRun.say writes its own."""
    return f"[orchestrator {time.strftime('%H:%M:%S')}] [checkpoints] {message}"


@dataclass(frozen=True)
class RankEnding:
    """How a rank's commands ended, as its uploader needs to know."""

    rank: int
    clean: bool  # the last command exited 0: every checkpoint it left is complete
    how: str  # for an incomplete checkpoint's reason: "rank 0's command exited with code 137"
    at: float | None = None  # when, by the node's clock
    # The attempt whose commands these were: an ending told once the next attempt has begun
    # (a lost node's stream ends late) is not the new attempt's, and is dropped.
    attempt: int | None = None

"""The controller's side of checkpoints: resolving checkpoints to load, and the node uploaders."""

from __future__ import annotations

import time
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orchestrator.agents.checkpoint_uploader import CheckpointUploader
from orchestrator.errors import OrchestratorError
from orchestrator.spec.checkpoints import (
    _BasetenLatestCheckpoint,
    _BasetenNamedCheckpoint,
    _LoopsCheckpoint,
)
from orchestrator.storage.checkpoints import CheckpointStore, Manifest
from orchestrator.storage.job_store import JobNotFound, JobStore
from orchestrator.storage.records import CheckpointEntry, CheckpointSummary, JobRecord

POLL_EVERY_S = 1.0


class CheckpointNotFound(OrchestratorError):
    pass


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
        # An incomplete checkpoint (its writer died before it was whole) is never "latest".
        manifests = [m for m in checkpoints.list(job.project_key, job.job_id) if m.complete]
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

    def __init__(self, record: JobRecord, pg: PlacementGroup, group_size: int) -> None:
        """Started with the agents, so their workers start while the nodes prepare; each
        watches once its agent has noted what the checkpoint directory held before the job."""
        checkpointing = record.spec.job.runtime.checkpointing_config
        settings = record.checkpoint_upload.model_dump()
        self.actors = [
            ray.remote(CheckpointUploader)
            .options(
                name=f"orchestrator-{record.job_id}-uploader-{rank}",
                namespace="orchestrator",
                num_cpus=0,
                # A killed uploader comes back and redoes what it had not committed.
                max_restarts=-1,
                max_task_retries=-1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank
                ),
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
            )
            for rank in range(group_size)
        ]
        self.flush_timeout_s = record.checkpoint_upload.flush_timeout_s
        self._cursors = [0] * len(self.actors)
        self._last_poll = 0.0

    def wait_ready(self, timeout: float = 60) -> None:
        """Until every uploader watches its directory: a checkpoint renamed into place in the
        commands' first moment is seen as renamed."""
        if not all(ray.get([actor.ready.remote() for actor in self.actors], timeout=timeout)):
            raise TimeoutError("a checkpoint uploader did not start watching within 60 s")

    def poll(self) -> tuple[list[str], str | None]:
        """New event lines, and the over-volume error of a rank if one is over (at most 1/s)."""
        if time.monotonic() - self._last_poll < POLL_EVERY_S:
            return [], None
        self._last_poll = time.monotonic()
        lines: list[str] = []
        over = None
        for i, actor in enumerate(self.actors):
            try:
                state = ray.get(actor.poll.remote(self._cursors[i]), timeout=2)
            except Exception:
                continue  # restarting; the final flush reports it
            lines += state.events
            self._cursors[i] = state.next
            over = over or state.over_volume
        return lines, over

    def writer_ended(self, ending: RankEnding) -> None:
        """Tell a rank's uploader at once that its commands ended (not waited for)."""
        self.actors[ending.rank].writer_ended.remote(ending.clean, ending.how, ending.at)

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
        for rank, (ref, cursor) in enumerate(zip(refs, self._cursors, strict=True)):
            try:
                result = ray.get(ref, timeout=timeout + 30)
            except Exception as e:
                unreachable[f"rank-{rank}"] = f"uploader unreachable: {type(e).__name__}"
                continue
            lines += result.events[cursor:]
            entries += result.entries
        return lines, CheckpointSummary.of(entries, unreachable)


@dataclass(frozen=True)
class RankEnding:
    """How a rank's commands ended, as its uploader needs to know."""

    rank: int
    clean: bool  # the last command exited 0: every checkpoint it left is complete
    how: str  # for an incomplete checkpoint's reason: "rank 0's command exited with code 137"
    at: float | None = None  # when, by the node's clock

"""A job's resource metrics as one read: every rank's samples with the job's states, weights
delivery and checkpoint uploads, for the CLI, a notebook and the HTML report.

Read straight off the storage root (storage/metrics.py), so it works after the cluster is gone.
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from orchestrator.lifecycle import JobState
from orchestrator.storage.checkpoints import CheckpointStore, Manifest
from orchestrator.storage.metrics import (
    DISK_DIRS,
    MetricsSample,
    RankMetrics,
    UploadStats,
    read_job_metrics,
)
from orchestrator.storage.records import JobRecord, JobStatus, StatusEvent
from orchestrator.storage.root import StorageRoot
from orchestrator.storage.train_reports import TrainRun, read_train_runs

# The CSV's first columns, the same for every job; per-GPU and per-directory ones follow.
LEADING_COLUMNS = (
    "rank", "node_id", "hostname", "at", "cpu_cores", "cpu_request", "memory_bytes",
    "memory_request_bytes", "processes", "disk_free_bytes", "disk_total_bytes",
    "net_sent_bytes_per_s", "net_recv_bytes_per_s", "checkpoints_waiting",
    "checkpoints_waiting_bytes", "checkpoint_oldest_waiting_s", "checkpoints_uploaded",
    "checkpoints_uploaded_bytes",
)  # fmt: skip
GPU_COLUMNS = ("utilization_pct", "memory_used_bytes", "memory_total_bytes")


@dataclass(frozen=True)
class WeightDelivery:
    """How one node got one `weights` entry: "node" (a cache hit), "cluster" or "mirror"."""

    source: str
    mount_location: str
    rank: int
    tier: str
    seconds: float
    bytes_copied: int


@dataclass(frozen=True)
class UploadTotals:
    """Checkpoint uploads summed over the ranks, as each rank's latest sample saw them; once the
    job has ended, what the checkpoint store holds too (`stored`), and nothing waits."""

    waiting: int = 0
    waiting_bytes: int = 0
    oldest_waiting_s: float | None = None  # the longest any rank's oldest one has waited
    uploaded: int = 0
    uploaded_bytes: int = 0
    mean_upload_s: float | None = None  # None until something was uploaded
    stored: int | None = None  # the job's checkpoints in the store; None while the job runs
    stored_bytes: int | None = None

    @classmethod
    def of(cls, stats: list[UploadStats]) -> UploadTotals | None:
        """None when no rank reports an uploader (no sample yet, or no checkpointing)."""
        if not stats:
            return None
        uploaded = sum(s.uploaded for s in stats)
        oldest = [s.oldest_waiting_s for s in stats if s.oldest_waiting_s is not None]
        return cls(
            waiting=sum(s.waiting for s in stats),
            waiting_bytes=sum(s.waiting_bytes for s in stats),
            oldest_waiting_s=max(oldest) if oldest else None,
            uploaded=uploaded,
            uploaded_bytes=sum(s.uploaded_bytes for s in stats),
            mean_upload_s=sum(s.upload_seconds for s in stats) / uploaded if uploaded else None,
        )

    @classmethod
    def after_end(cls, sampled: UploadTotals | None, stored: list[Manifest]) -> UploadTotals | None:
        """An ended job's uploads: its last samples may predate its final uploads (the uploaders
        flush before the end is recorded), so the store says what was kept. None when no rank
        reported an uploader and nothing is stored (no checkpointing)."""
        if sampled is None and not stored:
            return None
        return replace(
            sampled or cls(),
            waiting=0,
            waiting_bytes=0,
            oldest_waiting_s=None,
            stored=len(stored),
            stored_bytes=sum(m.size_bytes for m in stored),
        )


@dataclass
class JobMetrics:
    """What a job's ranks used, read at `read_at`: `ranks` are those that stored a metrics file."""

    job_id: str
    project: str
    state: JobState
    read_at: float
    ranks: list[RankMetrics] = field(default_factory=list)
    time_in_state: dict[str, float] = field(default_factory=dict)  # state -> seconds, in order
    weights: list[WeightDelivery] = field(default_factory=list)
    uploads: UploadTotals | None = None
    # Once the job has ended: each rank's uploads as the store holds them (see `after_end`).
    rank_uploads: dict[int, UploadTotals] = field(default_factory=dict)
    # A ray_train job's `ray.train.report` rounds, one TrainRun per `fit` (storage/train_reports.py)
    train_reports: list[TrainRun] = field(default_factory=list)

    @classmethod
    def read(
        cls, root: StorageRoot, record: JobRecord, status: JobStatus, now: float | None = None
    ) -> JobMetrics:
        ranks = [_with_node(r, status) for r in read_job_metrics(root, record.job_id)]
        read_at = time.time() if now is None else now
        uploads = UploadTotals.of(
            [r.samples[-1].uploads for r in ranks if r.samples and r.samples[-1].uploads]
        )
        rank_uploads: dict[int, UploadTotals] = {}
        if status.state.is_terminal:
            stored = CheckpointStore(root).list(record.project_key, record.job_id)
            uploads = UploadTotals.after_end(uploads, stored)
            for r in ranks:
                last = r.samples[-1].uploads if r.samples else None
                mine = [m for m in stored if m.node_rank == r.rank]
                if ended := UploadTotals.after_end(UploadTotals.of([last] if last else []), mine):
                    rank_uploads[r.rank] = ended
        return cls(
            job_id=record.job_id,
            project=record.project,
            state=status.state,
            read_at=read_at,
            ranks=ranks,
            time_in_state=time_in_states(status.history, read_at),
            weights=[
                WeightDelivery(
                    w.source, w.mount_location, n.rank, n.tier, n.seconds, n.bytes_copied
                )
                for w in status.weights
                for n in w.nodes
            ],
            uploads=uploads,
            rank_uploads=rank_uploads,
            train_reports=read_train_runs(root, record.job_id),
        )

    @property
    def has_samples(self) -> bool:
        return any(r.samples for r in self.ranks)

    @property
    def latest_sample_at(self) -> float | None:
        return max((r.samples[-1].at for r in self.ranks if r.samples), default=None)

    @property
    def gpu_indexes(self) -> list[int]:
        """Every GPU index any rank reported, so CSV rows all have the same columns."""
        return sorted({g.index for r in self.ranks for s in r.samples for g in s.gpus})

    @property
    def disk_dirs(self) -> list[str]:
        """Every directory any rank measured: DISK_DIRS' order first, then any other."""
        found = {d for r in self.ranks for s in r.samples for d in s.disk_bytes}
        return [d for d in DISK_DIRS if d in found] + sorted(found - set(DISK_DIRS))

    def to_json(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "project": self.project,
            "state": self.state.value,
            "read_at": self.read_at,
            "latest_sample_at": self.latest_sample_at,
            "time_in_state": self.time_in_state,
            "weights": [asdict(w) for w in self.weights],
            "uploads": asdict(self.uploads) if self.uploads else None,
            "ranks": [r.model_dump(mode="json") for r in self.ranks],
            "train_reports": [r.model_dump(mode="json") for r in self.train_reports],
        }

    def columns(self) -> list[str]:
        gpus = [f"gpu{i}_{c}" for i in self.gpu_indexes for c in GPU_COLUMNS]
        return [*LEADING_COLUMNS, *gpus, *(f"disk_{d}_bytes" for d in self.disk_dirs)]

    def rows(self) -> list[dict[str, Any]]:
        """One flat row per (rank, sample), every row with `columns()` (None where unmeasured)."""
        gpu_indexes, dirs = self.gpu_indexes, self.disk_dirs
        return [_row(r, s, gpu_indexes, dirs) for r in self.ranks for s in r.samples]


def time_in_states(history: list[StatusEvent], now: float) -> dict[str, float]:
    """Seconds spent in each state (summed when a retry passes through one again): each state
    lasts until the next one; the current one until `now`, unless it is the end (0)."""
    spent: dict[str, float] = {}
    for event, following in zip(history, [*history[1:], None], strict=True):
        if following is not None:
            end = following.at
        else:
            end = event.at if event.state.is_terminal else now
        spent[event.state.value] = spent.get(event.state.value, 0.0) + max(0.0, end - event.at)
    return spent


def _with_node(rank: RankMetrics, status: JobStatus) -> RankMetrics:
    """The rank's host and node id from the status when its samples do not carry them."""
    node = next((n for n in status.nodes if n.rank == rank.rank), None)
    if node is None or (rank.hostname and rank.node_id):
        return rank
    return rank.model_copy(
        update={"hostname": rank.hostname or node.hostname, "node_id": rank.node_id or node.node_id}
    )


def _row(
    rank: RankMetrics, s: MetricsSample, gpu_indexes: list[int], dirs: list[str]
) -> dict[str, Any]:
    up = s.uploads
    row: dict[str, Any] = {
        "rank": rank.rank,
        "node_id": rank.node_id,
        "hostname": rank.hostname,
        "at": dt.datetime.fromtimestamp(s.at, dt.timezone.utc).isoformat(),
        "cpu_cores": s.cpu_cores,
        "cpu_request": rank.cpu_request,
        "memory_bytes": s.memory_bytes,
        "memory_request_bytes": rank.memory_request_bytes,
        "processes": s.processes,
        "disk_free_bytes": s.disk_free_bytes,
        "disk_total_bytes": s.disk_total_bytes,
        "net_sent_bytes_per_s": s.net_sent_bytes_per_s,
        "net_recv_bytes_per_s": s.net_recv_bytes_per_s,
        "checkpoints_waiting": up.waiting if up else None,
        "checkpoints_waiting_bytes": up.waiting_bytes if up else None,
        "checkpoint_oldest_waiting_s": up.oldest_waiting_s if up else None,
        "checkpoints_uploaded": up.uploaded if up else None,
        "checkpoints_uploaded_bytes": up.uploaded_bytes if up else None,
    }
    gpus = {g.index: g for g in s.gpus}
    for i in gpu_indexes:
        g = gpus.get(i)
        for column in GPU_COLUMNS:
            row[f"gpu{i}_{column}"] = getattr(g, column) if g else None
    for d in dirs:
        row[f"disk_{d}_bytes"] = s.disk_bytes.get(d)
    return row

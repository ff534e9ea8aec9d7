"""A job's resource samples, one file per rank beside its logs, readable after the cluster is gone.

Each rank's node agent samples while the rank's commands run (node/node_metrics.py) and
rewrites `jobs/<job_id>/metrics/rank-<rank>.json` every few seconds. A long job's file stays
bounded: past MAX_SAMPLES, every other sample of the older half is dropped, so the recent past
keeps its full resolution and the distant past grows sparser.
"""

from __future__ import annotations

from pydantic import Field

from orchestrator.storage import layout
from orchestrator.storage.root import StorageRoot
from orchestrator.storage.stored import Stored

MAX_SAMPLES = 1200  # per rank: 100 minutes at the default 5 s before any thinning

# The directories whose size a sample reports (`MetricsSample.disk_bytes` keys).
DISK_DIRS = ("workspace", "scratch", "checkpoints", "cache")


class GpuSample(Stored):
    """One GPU the rank was given, as NVML (and so `nvidia-smi`) sees the whole device."""

    index: int  # NVML's index, the one `nvidia-smi` prints
    utilization_pct: float
    memory_used_bytes: int
    memory_total_bytes: int


class UploadStats(Stored):
    """The rank's checkpoint uploader: what waits to be stored, and what it has stored."""

    waiting: int = 0  # complete checkpoints not yet stored as they are (incl. failed uploads)
    waiting_bytes: int = 0
    oldest_waiting_s: float | None = None  # since the oldest waiting one was complete
    uploaded: int = 0  # uploads this uploader made (a rewritten checkpoint counts again)
    uploaded_bytes: int = 0
    upload_seconds: float = 0.0  # the time those uploads took, together
    last_upload_s: float | None = None


class MetricsSample(Stored):
    at: float  # wall clock, seconds since the epoch
    cpu_cores: float  # CPU time the job's processes used per second since the last sample
    memory_bytes: int  # resident memory of the job's processes (RSS, summed)
    processes: int
    gpus: list[GpuSample] = Field(default_factory=list)
    # Bytes on disk under each of DISK_DIRS that the rank has (as last measured: a large tree
    # is walked less often, see node/node_metrics.py).
    disk_bytes: dict[str, int] = Field(default_factory=dict)
    disk_free_bytes: int | None = None  # the filesystem holding the job's directories
    disk_total_bytes: int | None = None
    # The node's network interfaces, all traffic (not only the job's), per second.
    net_sent_bytes_per_s: float = 0.0
    net_recv_bytes_per_s: float = 0.0
    uploads: UploadStats | None = None
    # The rank's latest `orchestrator.progress(step)` (node/progress_beat.py): when, and its
    # step; None: never called.
    beat_at: float | None = None
    beat_step: int | None = None


class RankMetrics(Stored):
    """One rank's samples and what they are measured against."""

    job_id: str
    rank: int
    node_id: str = ""
    hostname: str = ""
    interval_s: float = 5.0
    memory_request_bytes: int | None = None  # compute.memory
    cpu_request: float | None = None  # compute.cpu_count
    gpu_names: dict[int, str] = Field(default_factory=dict)  # NVML index -> model name
    samples: list[MetricsSample] = Field(default_factory=list)

    def add(self, sample: MetricsSample, max_samples: int = MAX_SAMPLES) -> None:
        """Append, thinning the older half once the series is longer than `max_samples`."""
        self.samples.append(sample)
        if len(self.samples) > max_samples:
            half = len(self.samples) // 2
            self.samples[:half] = self.samples[:half:2]


def write_rank_metrics(root: StorageRoot, metrics: RankMetrics) -> None:
    root.write_bytes(layout.rank_metrics(metrics.job_id, metrics.rank), _dump(metrics))


def _dump(metrics: RankMetrics) -> bytes:
    return metrics.model_dump_json(exclude_defaults=True).encode()


def read_rank_metrics(root: StorageRoot, job_id: str, rank: int) -> RankMetrics | None:
    rel = layout.rank_metrics(job_id, rank)
    try:
        return RankMetrics.model_validate_json(root.read_bytes(rel))
    except FileNotFoundError:
        return None


def read_job_metrics(root: StorageRoot, job_id: str) -> list[RankMetrics]:
    """Every rank's samples that were stored, by rank (empty for a job that never ran)."""
    ranks = sorted(
        int(name[len("rank-") : -len(".json")])
        for name in root.list_names(layout.metrics_dir(job_id))
        if name.startswith("rank-") and name.endswith(".json")
    )
    found = (read_rank_metrics(root, job_id, rank) for rank in ranks)
    return [m for m in found if m is not None]

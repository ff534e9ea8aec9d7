"""The Prometheus series a job's samples are exported as, through Ray's metrics agent.

Ray serves them on each node's metrics export port with a `ray_` prefix (so
`orchestrator_job_cpu_cores` is scraped as `ray_orchestrator_job_cpu_cores`) and adds its own
tags (SessionName, ...). docs/grafana/orchestrator-jobs.json charts exactly these.
"""

from __future__ import annotations

from dataclasses import dataclass

JOB_TAGS = ("job_id", "project", "rank")
TEAM_TAGS = ("team",)


@dataclass(frozen=True)
class Series:
    name: str
    description: str
    extra_tags: tuple[str, ...] = ()
    base_tags: tuple[str, ...] = JOB_TAGS

    @property
    def tag_keys(self) -> tuple[str, ...]:
        return (*self.base_tags, *self.extra_tags)


CPU_CORES = Series("orchestrator_job_cpu_cores", "CPU cores the job's processes use on the rank")
MEMORY = Series("orchestrator_job_memory_bytes", "Resident memory of the job's processes (RSS)")
MEMORY_REQUEST = Series("orchestrator_job_memory_request_bytes", "The job's compute.memory")
GPU_UTILIZATION = Series(
    "orchestrator_job_gpu_utilization_percent", "Utilisation of each GPU the rank holds", ("gpu",)
)
GPU_MEMORY = Series(
    "orchestrator_job_gpu_memory_used_bytes", "Memory used on each GPU the rank holds", ("gpu",)
)
GPU_MEMORY_TOTAL = Series(
    "orchestrator_job_gpu_memory_total_bytes", "Memory of each GPU the rank holds", ("gpu",)
)
DISK = Series(
    "orchestrator_job_disk_bytes",
    "Bytes on disk under the rank's workspace, scratch, checkpoints and cache",
    ("dir",),
)
DISK_FREE = Series("orchestrator_job_disk_free_bytes", "Free bytes on the job's filesystem")
NET_SENT = Series(
    "orchestrator_node_network_sent_bytes_per_second", "The node's network traffic out"
)
NET_RECV = Series(
    "orchestrator_node_network_received_bytes_per_second", "The node's network traffic in"
)
CHECKPOINTS_WAITING = Series(
    "orchestrator_checkpoint_backlog", "Complete checkpoints not yet in the storage root"
)
CHECKPOINT_BYTES_WAITING = Series(
    "orchestrator_checkpoint_backlog_bytes", "Bytes of checkpoints not yet in the storage root"
)
CHECKPOINT_OLDEST_WAITING = Series(
    "orchestrator_checkpoint_oldest_waiting_seconds",
    "How long the oldest waiting checkpoint has been complete",
)
CHECKPOINT_UPLOADED_BYTES = Series(
    "orchestrator_checkpoint_uploaded_bytes", "Bytes of checkpoints the rank has uploaded"
)
CHECKPOINT_LAST_UPLOAD = Series(
    "orchestrator_checkpoint_last_upload_seconds", "How long the rank's last upload took"
)

ALL = (
    CPU_CORES, MEMORY, MEMORY_REQUEST, GPU_UTILIZATION, GPU_MEMORY, GPU_MEMORY_TOTAL, DISK,
    DISK_FREE, NET_SENT, NET_RECV, CHECKPOINTS_WAITING, CHECKPOINT_BYTES_WAITING,
    CHECKPOINT_OLDEST_WAITING, CHECKPOINT_UPLOADED_BYTES, CHECKPOINT_LAST_UPLOAD,
)  # fmt: skip

# The queue service's, per team (scheduler/team_meters.py): what its admitted jobs hold, from
# admission to release, as the books count it; counters, so `rate()` is what it holds now.
TEAM_GPU_SECONDS = Series("orchestrator_team_gpu_seconds",
                          "GPU-seconds the team's admitted jobs have held", ("accelerator",),
                          TEAM_TAGS)  # fmt: skip
TEAM_CPU_SECONDS = Series(
    "orchestrator_team_cpu_seconds", "CPU-seconds the team's admitted jobs have held", (), TEAM_TAGS
)
TEAM_MEMORY_GIB_SECONDS = Series("orchestrator_team_memory_gib_seconds",
                                 "GiB-seconds of memory the team's admitted jobs have held", (),
                                 TEAM_TAGS)  # fmt: skip
TEAM_COUNTERS = (TEAM_GPU_SECONDS, TEAM_CPU_SECONDS, TEAM_MEMORY_GIB_SECONDS)

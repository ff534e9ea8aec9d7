"""What is stored about a job: its record (written once) and its status (rewritten per change)."""

from __future__ import annotations

import enum
import time

from pydantic import ConfigDict, Field

from orchestrator.lifecycle import FaultKind, JobState, check_transition
from orchestrator.spec.training import TrainingProject
from orchestrator.storage.checkpoints import UploadSettings
from orchestrator.storage.retry import StorageSettings
from orchestrator.storage.stored import Stored

_Record = Stored


class ArchiveRef(_Record):
    path: str  # relative to the storage root
    sha256: str
    size_bytes: int
    file_count: int
    config_dir: str  # where config.py sits inside the archive ("." at the root)


class RetryPolicy(_Record):
    """How often the job is carried over a fault (controller/failure_policy.py decides)."""

    retries: int = 0  # attempts after the first, for lost nodes/agents and (opt-in) failures
    retry_on_failure: bool = False  # a start command that exits non-zero is retried too
    max_preemptions: int = 20  # preemptions are retried without using `retries`, this often
    delay_s: float = 10.0  # the wait before retrying a failed command

    @classmethod
    def resolve(cls, retries: int | None = None, retry_on_failure: bool = False) -> RetryPolicy:
        """The job's policy: `retries` as given, else ORCHESTRATOR_MAX_RETRIES."""
        from orchestrator import settings

        if retries is not None and retries < 0:
            raise ValueError(f"retries must be 0 or more, not {retries}")
        return cls(
            retries=settings.MAX_RETRIES.get() if retries is None else retries,
            retry_on_failure=retry_on_failure,
            max_preemptions=settings.MAX_PREEMPTIONS.get(),
            delay_s=settings.RETRY_DELAY_S.get(),
        )


class JobRecord(_Record):
    """The job as submitted. Secrets appear only as references (the spec never holds values)."""

    job_id: str
    project: str  # the name, as written
    project_id: str | None = None  # None: stored before projects had ids (see project_key)
    team: str | None = None
    job_name: str | None = None
    created_at: float
    spec: TrainingProject
    archive: ArchiveRef
    storage_root: str
    ray_address: str | None = None
    embedded_cluster: bool = False  # the local cluster orchestrator started on this machine
    submitted_via: str = "push"  # push | ray-job-submit | recreate
    recreated_from: str | None = None  # the job whose record and code this one reuses
    colocate_ranks: bool = False  # all ranks on one node (a development machine)
    checkpoint_upload: UploadSettings = Field(default_factory=UploadSettings)
    storage: StorageSettings = Field(default_factory=StorageSettings)  # riding out outages
    retry: RetryPolicy = Field(default_factory=RetryPolicy)
    queue_timeout_s: float | None = None  # longest wait in the cluster's queue; None: no limit
    metrics_interval_s: float = 5.0  # resource samples on each rank; 0: none
    notices: list[str] = Field(default_factory=list)

    @property
    def project_key(self) -> str:
        """How storage paths name the job's project: its id (a record stored before projects
        had ids: its name, which was a safe path segment then, and is that project's id)."""
        return self.project_id or self.project


class StatusEvent(_Record):
    state: JobState
    at: float
    reason: str | None = None


class Failure(_Record):
    """Why a job ended badly, in the words a user needs to act on it."""

    cause: str
    exit_code: int | None = None
    command: str | None = None
    node_rank: int | None = None
    last_lines: list[str] = Field(default_factory=list)
    attempts: list[str] = Field(default_factory=list)  # each attempt's cause, when retried


class NodeInfo(_Record):
    rank: int
    node_id: str
    ip: str
    hostname: str
    working_dir: str | None = None
    prepared_for: int = 0  # the attempt this node was prepared for (a replacement's is later)
    # The digest of the image its commands ran in (image@digest pins it); None: on the host.
    image_digest: str | None = None


# The fields typed with these enums accept only their values, and hold them as plain strings
# (`use_enum_values`): f-strings and JSON show "uploaded", never "CheckpointOutcome.UPLOADED".
_PLAIN_ENUMS = ConfigDict(use_enum_values=True)


class DeliveryTier(str, enum.Enum):
    """Where a weight set's bytes came from to reach a node."""

    NODE = "node"  # this node's cache had it
    CLUSTER = "cluster"  # the cluster cache (a shared filesystem)
    MIRROR = "mirror"  # the mirror in the storage root


class MirrorOutcome(str, enum.Enum):
    """How a source reached the mirror for a job."""

    HIT = "hit"  # already mirrored
    MISS = "miss"  # this request copied it
    SHARED = "shared"  # another job's copy in flight was awaited


class CheckpointOutcome(str, enum.Enum):
    """What became of one name found in a rank's `$BT_CHECKPOINT_DIR`."""

    UPLOADED = "uploaded"
    INCOMPLETE = "incomplete"  # stored, marked so
    FAILED = "failed"
    PENDING = "pending"  # the flush deadline passed
    DELETED = "deleted"  # by the job, before it was stored
    EARLIER_JOB = "earlier_job"  # the directory held it before the job
    IGNORED = "ignored"  # not a checkpoint
    RESTORED = "restored"  # another rank's copy, put here for a retried attempt, unchanged


class Attempt(_Record):
    """One run of the job's commands (BT_RETRY_COUNT = `number`) and how it ended."""

    model_config = _PLAIN_ENUMS

    number: int
    started_at: float
    ended_at: float | None = None
    cause: FaultKind | None = None  # None: it completed, or ended over its volume
    reason: str | None = None  # in words, as the job's lines said it
    rank: int | None = None  # the rank that failed or was lost
    node_id: str | None = None  # the node lost or preempted
    resumed_from: str | None = None  # the checkpoint restored for it ("checkpoint-200")
    resumed_at: float | None = None  # when that checkpoint was stored (its newest part)
    decision: str | None = None  # what followed, in words: "retried: why", "completed", ...
    # When the newest checkpoint stored complete while it ran finished uploading (the books'
    # lost time runs from there to its end when no attempt follows, books/usage.py).
    checkpoint_at: float | None = None


class Hold(_Record):
    """What the job held from the queue's admission to the release of its nodes, as the queue
    accounts it, and the cluster's prices then (a later price change never rewrites it)."""

    since: float
    until: float | None = None  # None: held now (or its controller died holding it)
    bundle: dict[str, float]  # per node, in the queue's keys: CPU, memory (bytes), GPU:<type>
    nodes: int = 1
    prices: dict[str, float] = Field(default_factory=dict)  # per hour: GPU:<type>, CPU, memory


class CheckpointEntry(_Record):
    """What became of one name found in a rank's `$BT_CHECKPOINT_DIR`."""

    model_config = _PLAIN_ENUMS
    rank: int
    name: str
    state: CheckpointOutcome
    reason: str | None = None
    files: int = 0
    size_bytes: int = 0

    @property
    def key(self) -> str:
        return f"rank-{self.rank}/{self.name}"


NOT_STORED = ("failed", "pending")


class CheckpointSummary(_Record):
    """Whether every checkpoint reached the storage root when the job ended."""

    uploaded: list[str] = Field(default_factory=list)  # "rank-0/checkpoint-100", stored whole
    incomplete: dict[str, str] = Field(default_factory=dict)  # stored, marked incomplete: why
    pending: list[str] = Field(default_factory=list)
    failed: dict[str, str] = Field(default_factory=dict)
    all_uploaded: bool = True  # nothing failed or pending
    entries: list[CheckpointEntry] = Field(default_factory=list)

    @classmethod
    def of(cls, entries: list[CheckpointEntry], unreachable: dict[str, str]) -> CheckpointSummary:
        """`unreachable`: ranks whose uploader did not answer the flush, with why."""
        by = {state: [e for e in entries if e.state == state] for state in _STATES}
        failed = {e.key: e.reason or "" for e in by["failed"]} | unreachable
        return cls(
            uploaded=[e.key for e in by["uploaded"]],
            incomplete={e.key: e.reason or "" for e in by["incomplete"]},
            pending=[e.key for e in by["pending"]],
            failed=failed,
            all_uploaded=not by["pending"] and not failed,
            entries=entries,
        )

    def describe(self) -> str:
        """`3 stored`, `2 of 3 stored`, `3 stored (1 incomplete)`: for tables."""
        stored = len(self.uploaded) + len(self.incomplete)
        total = stored + len(self.pending) + len(self.failed)
        text = f"{stored} of {total} stored" if total > stored else f"{stored} stored"
        return text + (f" ({len(self.incomplete)} incomplete)" if self.incomplete else "")

    @property
    def sync_status(self) -> str:
        """One word, as Baseten's checkpoint_sync_status: synced, incomplete or not_synced."""
        if not self.all_uploaded:
            return "not_synced"
        return "incomplete" if self.incomplete else "synced"

    def problems(self) -> list[str]:
        """One line per checkpoint that is not stored whole, with why."""
        return [
            f"{e.key}: {e.state}" + (f": {e.reason}" if e.reason else "")
            for e in self.entries
            if e.state in (*NOT_STORED, "incomplete", "deleted")
        ] + [f"{rank}: failed: {why}" for rank, why in self.failed.items() if "/" not in rank]


_STATES = tuple(outcome.value for outcome in CheckpointOutcome)


class NodeDelivery(_Record):
    """How one node got a weight set: from its own cache (a hit), the cluster's, or the mirror."""

    model_config = _PLAIN_ENUMS
    rank: int
    tier: DeliveryTier
    seconds: float
    bytes_copied: int = 0


class WeightsStatus(_Record):
    """One `weights` entry: its mirror (revision, progress, hit or miss) and each node's copy."""

    model_config = _PLAIN_ENUMS

    source: str
    mount_location: str
    revision: str | None = None
    mirror: MirrorOutcome | None = None
    files_total: int = 0
    bytes_total: int = 0
    files_done: int = 0
    bytes_done: int = 0
    nodes: list[NodeDelivery] = Field(default_factory=list)


class CacheNode(_Record):
    """One node's seeding of the training cache (project and team caches together)."""

    rank: int
    node_id: str
    had_copy: bool  # the node held the project's cache before this job
    files_seeded: int
    bytes_seeded: int
    files_deleted: int
    seconds: float


class CacheStatus(_Record):
    """Where the training cache was and what moving it cost."""

    shared: bool = False  # on a filesystem every node mounts: nothing is seeded per node
    affinity: str | None = None  # how require_cache_affinity placed the job
    nodes: list[CacheNode] = Field(default_factory=list)
    written_back: dict[str, int] | None = None  # files, bytes, deleted (both caches)
    write_back_error: str | None = None


class JobStatus(_Record):
    job_id: str
    state: JobState
    history: list[StatusEvent]
    failure: Failure | None = None
    nodes: list[NodeInfo] = Field(default_factory=list)
    checkpoints: CheckpointSummary | None = None
    held_until: float | None = None  # an interactive session holds the nodes until then
    weights: list[WeightsStatus] = Field(default_factory=list)
    cache: CacheStatus | None = None
    attempts: list[Attempt] = Field(default_factory=list)
    holds: list[Hold] = Field(default_factory=list)  # each admission by the queue, in order

    @classmethod
    def new(cls, job_id: str, reason: str | None = None) -> JobStatus:
        event = StatusEvent(state=JobState.CREATED, at=time.time(), reason=reason)
        return cls(job_id=job_id, state=JobState.CREATED, history=[event])

    def moved_to(self, state: JobState, reason: str | None = None) -> JobStatus:
        """A copy in `state`; raises IllegalTransition for a move the state machine forbids."""
        if state == self.state:  # same state, new reason (e.g. a PENDING reason that changed)
            history = [*self.history[:-1], self.history[-1].model_copy(update={"reason": reason})]
        else:
            check_transition(self.state, state)
            history = [*self.history, StatusEvent(state=state, at=time.time(), reason=reason)]
        return self.model_copy(update={"state": state, "history": history})

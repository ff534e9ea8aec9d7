"""What crosses a Ray call between the controller and a job's node agents.

Small frozen dataclasses rather than positional argument lists, string-keyed dicts and tagged
tuples: a misspelt field is an error where it is written, not a KeyError in a worker later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.node.rank_writes import RankWrites
from orchestrator.storage.checkpoints import Manifest
from orchestrator.storage.records import (
    CheckpointEntry,
    DeliveryTier,
    MirrorOutcome,
    NodeInfo,
)
from orchestrator.storage.training_cache import SyncReport
from orchestrator.storage.weights import WeightSet


@dataclass(frozen=True)
class WeightPlacement:
    """One mirrored weight set and where the job sees it."""

    weight_set: WeightSet
    mount_location: str


@dataclass(frozen=True)
class CacheRequest:
    """The training cache a rank links in (controller/training_cache.py decides)."""

    team: str | None
    project: str
    mount_base_path: str
    explicit_base: bool
    legacy_hf: bool


@dataclass(frozen=True)
class ImageRequest:
    """The job's image, pulled onto the node while it is prepared (agents/runtimes.py
    `image_pull`); `registry` and `secret_name`: docker_auth's REGISTRY_SECRET, resolved on
    the node."""

    image: str
    registry: str | None = None
    secret_name: str | None = None


@dataclass(frozen=True)
class PrepareRequest:
    """Everything a node needs before the commands: code, directories, checkpoints, weights."""

    archive_path: str
    sha256: str
    checkpoint_dir: str | None = None  # checkpointing_config.checkpoint_path, when set
    secret_names: tuple[str, ...] = ()  # checked on the node before anything else
    load: tuple[Manifest, ...] = ()  # the checkpoints to load
    download_folder: str | None = None
    weights: tuple[WeightPlacement, ...] = ()
    cache: CacheRequest | None = None
    image: ImageRequest | None = None  # None: the commands run on the host


@dataclass(frozen=True)
class Delivered:
    """A node's weight cache's answer: the local directory holding the set, and its cost."""

    path: str
    tier: DeliveryTier
    bytes_copied: int
    seconds: float
    evicted: tuple[str, ...] = ()  # sets evicted to make room
    over_budget: bool = False  # kept although it does not fit the cache's budget


@dataclass(frozen=True)
class Delivery:
    """How one weight set reached a node (its node cache's answer, and the link placed)."""

    tier: DeliveryTier
    seconds: float
    bytes_copied: int
    mount_location: str
    evicted: tuple[str, ...] = ()
    over_budget: bool = False


@dataclass(frozen=True)
class CacheCopy:
    """One training cache (the project's or the team's) on a node, once seeded."""

    path: str
    had_copy: bool  # the node held a copy before (only what changed was fetched)
    fetched: SyncReport


@dataclass(frozen=True)
class CacheSeeded:
    """A node's cache seeder's answer; the agent adds the variables the job sees."""

    shared: bool  # the copies live on a filesystem every node mounts
    project: CacheCopy
    team: CacheCopy
    seconds: float
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CacheWrittenBack:
    """What rank 0's node sent back to the storage root at the end of a job."""

    project: SyncReport
    team: SyncReport
    seconds: float


@dataclass(frozen=True)
class PreparedNode:
    """A prepared rank: where it runs, and what its weights and cache cost."""

    rank: int
    node_id: str
    ip: str
    hostname: str
    working_dir: str
    weights: tuple[Delivery, ...] = ()
    cache: CacheSeeded | None = None
    image_digest: str | None = None  # the job's image as pulled here (container runtime)

    def node_info(self) -> NodeInfo:
        return NodeInfo(
            rank=self.rank, node_id=self.node_id, ip=self.ip, hostname=self.hostname,
            working_dir=self.working_dir, image_digest=self.image_digest,
        )  # fmt: skip


@dataclass(frozen=True)
class MetricsRequest:
    """How a rank's resources are sampled while its commands run (node/node_metrics.py)."""

    project: str
    interval_s: float  # 0: not sampled
    memory_request_bytes: int | None = None
    cpu_request: float | None = None
    checkpointing: bool = False  # the rank has a checkpoint uploader to ask for its backlog


@dataclass(frozen=True)
class OutputLines:
    """Lines the rank's commands printed (tagged, secrets masked). With `continues`, the last
    line goes on in the next item: a long line comes in pieces, each small enough for Ray to
    pass inline, and the controller joins them before it is shown or stored."""

    lines: list[str]
    continues: bool = False


@dataclass(frozen=True)
class CommandsEnded:
    """How a rank's commands ended: the last item of its stream."""

    exit_code: int
    command: str | None = None  # the one that failed; None when all exited 0 or none ran
    last_lines: list[str] = field(default_factory=list)
    stopped: bool = False  # the rank was asked to stop
    ended_at: float | None = None
    why: str | None = None  # what the exit code means, where it is known ("out of memory: ...")


@dataclass(frozen=True)
class StoredCheckpoint:
    """A checkpoint a rank's uploader stored in the storage root, and when (epoch seconds)."""

    name: str
    at: float


@dataclass(frozen=True)
class EventCursor:
    """Where the controller is in one uploader's event list. A restarted uploader (its node
    was lost) starts a new list under a new `incarnation`: a cursor of the old one reads the
    new list from its start, however long that list has grown by the first poll."""

    incarnation: str = ""
    index: int = 0

    def start_in(self, incarnation: str) -> int:
        """The index to read `incarnation`'s list from."""
        return self.index if incarnation == self.incarnation else 0


@dataclass(frozen=True)
class UploaderPoll:
    """A rank's checkpoint uploader while the job runs: its events since the cursor."""

    events: list[str]
    next: EventCursor  # the cursor for the next poll
    over_volume: str | None = None  # the checkpoint directory is over volume_size_gib: why
    scans: int = 0  # scans of the directory completed: what "nothing happened yet" waits on
    last_stored: StoredCheckpoint | None = None  # the newest checkpoint it stored complete
    writes: RankWrites | None = None  # what it has seen the rank write (for the resume point)


@dataclass(frozen=True)
class UploaderFlush:
    """What became of every name the uploader found, once the commands ended."""

    entries: list[CheckpointEntry]
    events: list[str]  # all of this incarnation's
    writes: RankWrites | None = None  # what it has seen the rank write, to the commands' end
    incarnation: str = ""


@dataclass(frozen=True)
class MirrorProgress:
    """The weight mirror's copy of one source, so far."""

    files_total: int
    bytes_total: int
    files_done: int
    bytes_done: int


@dataclass(frozen=True)
class MirrorDone:
    """The source is in the mirror: its set's manifest and how it got there."""

    weight_set: WeightSet
    mirror: MirrorOutcome


@dataclass(frozen=True)
class MirrorFailed:
    """The source cannot be read (secrets masked in `error`)."""

    error: str


@dataclass(frozen=True)
class Group:
    """The ranks of one attempt once all have met: the leader and every rank's address."""

    leader_addr: str
    master_port: int | None  # offered by the leader for torch.distributed
    addresses: tuple[str, ...]  # by rank


@dataclass(frozen=True)
class ShellResult:
    """One `orchestrator shell -- <command>` run on a rank: its exit code and output (masked)."""

    exit_code: int
    output: str

"""Every `ORCHESTRATOR_*` variable in one place: its name, default, parser, and who reads it.

A bad value is one clear error naming the variable (`SettingError`), wherever it is read: in
the client before anything is submitted, on a node before a job uses it. docs/configuration.md
lists exactly these names (tests/test_settings.py checks it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from orchestrator.errors import SettingError

T = TypeVar("T")

CLIENT = "client"  # the machine you push from (and `orchestrator run` on the head)
HEAD = "head"  # the controller, in `ray start`'s environment on the head node
NODE = "node"  # every Ray node, in `ray start`'s environment


@dataclass(frozen=True)
class Setting(Generic[T]):
    name: str
    default: T
    parse: Callable[[str], T]  # raises ValueError with a short reason
    read_by: str

    def get(self) -> T:
        raw = os.environ.get(self.name, "").strip()
        if not raw:
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise SettingError(f"{self.name} {e} (got {raw!r})") from None


def positive_float(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError("must be a number above 0")
    return value


def whole_number(raw: str) -> int:
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError("must be a whole number of at least 1")
    return int(raw)


def count(raw: str) -> int:
    if not raw.isdigit():
        raise ValueError("must be a whole number (0 or more)")
    return int(raw)


def seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError("must be a number of seconds, 0 or more")
    return value


def whole_bytes(raw: str) -> int:
    if not raw.isdigit():
        raise ValueError("is not a whole number of bytes, e.g. 10737418240 for 10 GiB")
    return int(raw)


_OFF = ("", "0", "false", "no", "off")


def flag(raw: str) -> bool:
    """On unless empty, 0, false, no or off (any case)."""
    return raw.strip().lower() not in _OFF


def text(raw: str) -> str:
    return raw


def within_team(raw: str) -> str:
    """never, resumable or always (scheduler/policy.py WithinTeam)."""
    value = raw.strip().lower()
    if value not in ("never", "resumable", "always"):
        raise ValueError("must be never, resumable or always")
    return value


def job_runtime(raw: str) -> str:
    """host or container (node/podman.py)."""
    value = raw.strip().lower()
    if value not in ("host", "container"):
        raise ValueError("must be host or container")
    return value


def controllers(raw: str) -> str:
    """hosted or ray-job (scheduler/launcher.py)."""
    value = raw.strip().lower()
    if value not in ("hosted", "ray-job"):
        raise ValueError("must be hosted or ray-job")
    return value


_ALL: dict[str, Setting] = {}


def _setting(name: str, default: T, parse: Callable[[str], T], read_by: str) -> Setting[T]:
    setting = Setting(f"ORCHESTRATOR_{name}", default, parse, read_by)
    _ALL[setting.name] = setting
    return setting


def all_settings() -> list[Setting]:
    return list(_ALL.values())


# --- the client ---------------------------------------------------------------------------------
HOME = _setting("HOME", None, text, CLIENT)  # default: ~/.orchestrator (home.py)
STORAGE_ROOT = _setting("STORAGE_ROOT", None, text, CLIENT)  # default: $HOME/storage
SHARED_FILESYSTEM = _setting("SHARED_FILESYSTEM", False, flag, CLIENT)
SCHEDULING_TIMEOUT_S = _setting("SCHEDULING_TIMEOUT_S", 600.0, positive_float, CLIENT)
PYTHON = _setting("PYTHON", None, text, CLIENT)
MAX_ARCHIVE_BYTES = _setting("MAX_ARCHIVE_BYTES", 5 * 1024**3, whole_bytes, CLIENT)
CONFIG_LOAD_TIMEOUT_S = _setting("CONFIG_LOAD_TIMEOUT_S", 60.0, positive_float, CLIENT)
MAX_NODE_COUNT = _setting("MAX_NODE_COUNT", 256, whole_number, CLIENT)
MAX_CPU_COUNT = _setting("MAX_CPU_COUNT", 1024, whole_number, CLIENT)
MAX_GPUS_PER_NODE = _setting("MAX_GPUS_PER_NODE", 16, whole_number, CLIENT)
MAX_MEMORY_BYTES = _setting("MAX_MEMORY_BYTES", 64 * 1024**4, whole_bytes, CLIENT)  # 64 TiB
RAY_CLIENT_ADDRESS = _setting("RAY_CLIENT_ADDRESS", None, text, CLIENT)
TERMINAL_LOST_S = _setting("TERMINAL_LOST_S", 60.0, positive_float, CLIENT)
# How long a submission waits out a Ray head that is still starting (its dashboard not up, or
# up before its agent: "No available agent"); 0: no wait.
SUBMIT_WAIT_S = _setting("SUBMIT_WAIT_S", 30.0, seconds, CLIENT)
# Read at push and stored in the job's record (storage/checkpoints.py, storage/retry.py parse
# them as a group, each named here).
CHECKPOINT_CONCURRENCY = _setting("CHECKPOINT_CONCURRENCY", None, text, CLIENT)
CHECKPOINT_BANDWIDTH_MBPS = _setting("CHECKPOINT_BANDWIDTH_MBPS", None, text, CLIENT)
CHECKPOINT_SETTLE_S = _setting("CHECKPOINT_SETTLE_S", None, text, CLIENT)
CHECKPOINT_FORMAT_WAIT_S = _setting("CHECKPOINT_FORMAT_WAIT_S", None, text, CLIENT)
CHECKPOINT_FLUSH_TIMEOUT_S = _setting("CHECKPOINT_FLUSH_TIMEOUT_S", None, text, CLIENT)
CHECKPOINT_DELETE_LOCAL = _setting("CHECKPOINT_DELETE_LOCAL", False, flag, CLIENT)
CHECKPOINT_TEMPORARY_PATTERNS = _setting("CHECKPOINT_TEMPORARY_PATTERNS", "", text, CLIENT)
STORAGE_OUTAGE_S = _setting("STORAGE_OUTAGE_S", None, text, CLIENT)
ON_STORAGE_ERROR = _setting("ON_STORAGE_ERROR", None, text, CLIENT)
# The retry policy, read where the job is recorded (storage/records.py RetryPolicy).
MAX_RETRIES = _setting("MAX_RETRIES", 0, count, CLIENT)
MAX_PREEMPTIONS = _setting("MAX_PREEMPTIONS", 20, count, CLIENT)
RETRY_DELAY_S = _setting("RETRY_DELAY_S", 10.0, seconds, CLIENT)
# deploy_checkpoints: where Serve's HTTP proxy listens (used when it is first started on a
# cluster) and how long a deployment may take to become ready.
SERVE_HOST = _setting("SERVE_HOST", None, text, CLIENT)  # default: loopback on the embedded cluster
SERVE_PORT = _setting("SERVE_PORT", 8000, whole_number, CLIENT)
DEPLOY_TIMEOUT_S = _setting("DEPLOY_TIMEOUT_S", 900.0, positive_float, CLIENT)
# How long a pushed job may wait in the queue before it ends DEPLOY_FAILED; unset: no limit.
QUEUE_TIMEOUT_S = _setting("QUEUE_TIMEOUT_S", None, positive_float, CLIENT)
# How often each rank's resources are sampled (node/node_metrics.py); 0: not sampled.
METRICS_INTERVAL_S = _setting("METRICS_INTERVAL_S", 5.0, seconds, CLIENT)

# --- the head node ------------------------------------------------------------------------------
USE_IMAGE_URI = _setting("USE_IMAGE_URI", False, flag, HEAD)
# Where a job's commands run: in the node's own environment (host), or in a container of the
# job's base_image, with podman on each node (container; node/podman.py).
JOB_RUNTIME = _setting("JOB_RUNTIME", "host", job_runtime, HEAD)
SECRETS_DIR = _setting("SECRETS_DIR", None, text, HEAD)  # default: $HOME/secrets
# Nodes join on demand: a job larger than today's cluster waits (up to the scheduling timeout)
# instead of failing at once.
CLUSTER_AUTOSCALES = _setting("CLUSTER_AUTOSCALES", False, flag, HEAD)
# The queue (scheduler/policy.py): a job within its quota that has waited this long has what
# frees up held for it (no starvation); a preempted job's commands and uploads get this long.
QUEUE_HOLD_AFTER_S = _setting("QUEUE_HOLD_AFTER_S", 600.0, positive_float, HEAD)
# Whether a job may preempt lower-priority running jobs of its own team: never (Kueue's default),
# resumable (only jobs that checkpoint), always (also jobs that would start over).
QUEUE_PREEMPT_WITHIN_TEAM = _setting("QUEUE_PREEMPT_WITHIN_TEAM", "never", within_team, HEAD)
PREEMPTION_GRACE_S = _setting("PREEMPTION_GRACE_S", 60.0, positive_float, HEAD)
# A rank on which nothing moved this long (or 5x the job's longest silence, if more) is stuck
# (controller/stuck.py); a job's `stuck_after_s` overrides it.
STUCK_AFTER_S = _setting("STUCK_AFTER_S", 600.0, positive_float, HEAD)
# How the queue service starts the controllers of the jobs it admits (its launcher,
# scheduler/launcher.py `launcher_for`): as threads of one resident process on the head
# (hosted; controller/host.py), or each as its own Ray job.
CONTROLLERS = _setting("CONTROLLERS", "hosted", controllers, HEAD)
# A directory through which a client on the head's machine has the queue service watch a new
# storage root without a Ray job (scheduler/roots_inbox.py); the embedded cluster sets it.
ROOTS_INBOX = _setting("ROOTS_INBOX", None, text, HEAD)

# --- every node ---------------------------------------------------------------------------------
NODE_ROOT = _setting("NODE_ROOT", None, text, NODE)  # default: <tmp>/orchestrator
# podman's global options for job containers; default: runc and cgroupfs on a cgroup v1 node.
PODMAN_ARGS = _setting("PODMAN_ARGS", None, text, NODE)
# Job images this node pulled are removed (least recently used first) past this many GiB.
IMAGE_CACHE_GIB = _setting("IMAGE_CACHE_GIB", None, positive_float, NODE)
NODE_CACHE_DIR = _setting("NODE_CACHE_DIR", None, text, NODE)
NODE_CACHE_GIB = _setting("NODE_CACHE_GIB", None, positive_float, NODE)
CLUSTER_CACHE_DIR = _setting("CLUSTER_CACHE_DIR", None, text, NODE)
CLUSTER_CACHE_GIB = _setting("CLUSTER_CACHE_GIB", None, positive_float, NODE)
WEIGHTS_CONCURRENCY = _setting("WEIGHTS_CONCURRENCY", 8, whole_number, NODE)
R2_ENDPOINT_URL = _setting(
    "R2_ENDPOINT_URL", "https://{account_id}.r2.cloudflarestorage.com", text, NODE
)
CW_ENDPOINT_URL = _setting("CW_ENDPOINT_URL", "https://cwobject.com", text, NODE)
SHARED_CACHE_DIR = _setting("SHARED_CACHE_DIR", None, text, NODE)
TRAINING_CACHE_DIR = _setting("TRAINING_CACHE_DIR", None, text, NODE)

# Not settings: ORCHESTRATOR_SECRET_<NAME> (secret values, storage/secret_store.py) and
# what a job's commands are given: ORCHESTRATOR_RAY_ADDRESS (agents/rank_program.py) and a Ray
# Train job's ORCHESTRATOR_TRAIN_PG and ORCHESTRATOR_TRAIN_WORKERS (agents/ray_train_seams.py);
# ORCHESTRATOR_PROGRESS_FILE, where orchestrator.progress() beats (node/progress_beat.py).

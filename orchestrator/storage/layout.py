"""Where things live under the storage root: `TREE` declares every path, whichever module writes
it; this module builds the paths of jobs, archives and projects. docs/architecture.md's storage
tree lists exactly TREE's paths (tests/test_docs_contract.py checks it, and that what the
storage modules write matches TREE).
"""

from __future__ import annotations

import hashlib

from orchestrator.spec.base import check_safe_name

# (path, what it holds). `<...>` is one path segment, `<path>` any number; the module that
# writes a path is named the first time its area appears.
TREE: tuple[tuple[str, str], ...] = (
    ("archives/<sha256>.tar", "code archives, content-addressed (a re-push uploads nothing)"),
    ("jobs/<job_id>/record.json", "JobRecord: the job as submitted, written once"),
    ("jobs/<job_id>/status.json", "JobStatus: state, history, failure, nodes; rewritten on change"),
    ("jobs/<job_id>/logs/<seq>.log", "log segments (seq zero-padded to 8 digits), in order"),
    ("jobs/<job_id>/metrics/rank-<rank>.json", "RankMetrics: a rank's resource samples"),
    (
        "jobs/<job_id>/metrics/train-<run>-<part>.json",
        "TrainReportPart: a Ray Train run's reports (storage/train_reports.py)",
    ),
    ("jobs/<job_id>/session.json", "what `orchestrator isession` asked of the job's session"),
    (
        "jobs/<job_id>/stacks/attempt-<n>/rank-<rank>.txt",
        "a rank's Python stacks when the attempt was stuck (storage/stacks.py)",
    ),
    ("jobs/<job_id>/stacks/attempt-<n>/silent.json", "SilentRanks: which rank went silent first"),
    ("jobs/<job_id>/stacks/taken-<time>/rank-<rank>.txt", "stacks `orchestrator stacks` took"),
    ("projects/names/<name_sha256>.json", "the id a name was given, created if absent: the commit"),
    ("projects/<project_id>.json", "ProjectRecord {id, name, created_at}, written after"),
    (
        "checkpoints/<project_id>/<job_id>/rank-<rank>/<name>/v<version>/<path>",
        "a checkpoint version's files, uploaded first (storage/checkpoints.py)",
    ),
    (
        "checkpoints/<project_id>/<job_id>/manifests/rank-<rank>/<name>.json",
        "its manifest, written last: the commit",
    ),
    (
        "caches/<team>/projects/<project_id>/manifest.json",
        "a project's training cache: every file with its version (storage/training_cache.py)",
    ),
    ("caches/<team>/projects/<project_id>/objects/<version>", "one file's content at one version"),
    ("caches/<team>/projects/<project_id>/nodes/<node_id>.json", "nodes holding a copy"),
    ("caches/<team>/team/manifest.json", "the team's cache, laid out as a project's"),
    ("caches/<team>/team/objects/<version>", "one file of the team's cache at one version"),
    ("weights/<key>/files/<path>", "a mirrored weight set's files (storage/weights.py)"),
    ("weights/<key>/manifest.json", "WeightSet: written last, the commit"),
    (
        "audit/<month>/<time>-<hex>.json",
        "AuditEvent: one change made through us, created once (storage/audit.py)",
    ),
    (
        "notify/subscriptions/<id>.json",
        "Subscription: a webhook, its team, events and secret's name (storage/notify_store.py)",
    ),
    ("notify/outbox/<job_id>/<seq>.json", "NotifyEvent: one event of the job, created once"),
    ("notify/delivered/<job_id>/<seq>-<id>.json", "Delivery: the event delivered to <id>, or not"),
    ("notify/settled/<job_id>.json", "the job ended and no delivery of its events is owed"),
    ("notify/deliverer.json", "DelivererLease: the queue service delivering this root's webhooks"),
    ("queue/quotas.json", "each team's quota (storage/queue_store.py)"),
    ("queue/prices.json", "the operator's prices per hour (storage/prices.py)"),
    ("queue/entries/<job_id>.json", "QueueEntry: a job waiting or admitted"),
    ("queue/incoming/<job_id>.json", "QueueEntry of a pushed job the service has not taken yet"),
    ("queue/requests/<job_id>.json", "PriorityRequest from `update --priority`"),
    ("queue/stops/<job_id>.json", "StopRequest: `stop` of a job that has no controller yet"),
    ("queue/services/<session>.json", "ServiceBeat: a queue service watches this root"),
    ("queue/starting/<session>.json", "ServiceBeat: the push that started its queue service"),
    ("queue/view.json", "QueueView: the queue service's last decision"),
    (
        "serving/<model>/adapters/<adapter>/<path>",
        "LoRA adapters published for vLLM (serving/vllm_app.py)",
    ),
    ("doctor/probe-<hex>", "`orchestrator doctor`'s probe object, deleted at once"),
)


def archive(sha256: str) -> str:
    return f"archives/{sha256}.tar"


def jobs() -> str:
    return "jobs"


def record(job_id: str) -> str:
    return f"jobs/{job_id}/record.json"


def status(job_id: str) -> str:
    return f"jobs/{job_id}/status.json"


def logs_dir(job_id: str) -> str:
    return f"jobs/{job_id}/logs"


def log_segment(job_id: str, seq: int) -> str:
    return f"jobs/{job_id}/logs/{seq:08d}.log"


def metrics_dir(job_id: str) -> str:
    return f"jobs/{job_id}/metrics"


def rank_metrics(job_id: str, rank: int) -> str:
    return f"jobs/{job_id}/metrics/rank-{rank}.json"


def train_report_part(job_id: str, run: str, part: int) -> str:
    return f"jobs/{job_id}/metrics/train-{run}-{part:06d}.json"


def session(job_id: str) -> str:
    """What a user asked of the job's interactive session (`orchestrator isession`)."""
    return f"jobs/{job_id}/session.json"


def stacks_root(job_id: str) -> str:
    return f"jobs/{job_id}/stacks"


def stacks_dir(job_id: str, name: str) -> str:
    """A set of every rank's stacks: `attempt-<n>` (stuck) or `taken-<time>` (on demand)."""
    return f"jobs/{job_id}/stacks/{name}"


def stacks_file(job_id: str, name: str, rank: int) -> str:
    return f"jobs/{job_id}/stacks/{name}/rank-{rank}.txt"


def stacks_silent(job_id: str, name: str) -> str:
    return f"jobs/{job_id}/stacks/{name}/silent.json"


def projects() -> str:
    return "projects"


def project(project_id: str) -> str:
    return f"projects/{project_id}.json"


def project_name(name: str) -> str:
    """A name may hold any character: its path is a hash of it."""
    return f"projects/names/{hashlib.sha256(name.encode()).hexdigest()}.json"


def is_segment(value: str) -> bool:
    """Whether storage may have put `value` in a path as one segment: a job's id, a project's
    (generated, or its name from before ids) and a team are safe names, at most 128 characters.
    Anything else (a name with '/', one longer than a file name may be) names nothing stored,
    and must never become a path."""
    try:
        check_safe_name(value)
    except ValueError:
        return False
    return True

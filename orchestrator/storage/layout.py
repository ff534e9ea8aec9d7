"""Where things live under the storage root (kept in step with docs/architecture.md).

archives/<sha256>.tar                 code archives, content-addressed (re-pushes upload nothing)
jobs/<job_id>/record.json             JobRecord, written once at submission
jobs/<job_id>/status.json             JobStatus, rewritten on every change
jobs/<job_id>/logs/<seq>.log          log segments, tagged lines, in order
jobs/<job_id>/metrics/rank-<r>.json   a rank's resource samples (storage/metrics.py)
projects/<project_id>.json            ProjectRecord: a project's id and name
projects/names/<sha256 of name>.json  the id a name was given (written last: the commit)
"""

from __future__ import annotations

import hashlib


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


def session(job_id: str) -> str:
    """What a user asked of the job's interactive session (`orchestrator isession`)."""
    return f"jobs/{job_id}/session.json"


def projects() -> str:
    return "projects"


def project(project_id: str) -> str:
    return f"projects/{project_id}.json"


def project_name(name: str) -> str:
    """A name may hold any character: its path is a hash of it."""
    return f"projects/names/{hashlib.sha256(name.encode()).hexdigest()}.json"

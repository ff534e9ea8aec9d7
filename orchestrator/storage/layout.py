"""Where things live under the storage root (kept in step with docs/architecture.md).

archives/<sha256>.tar                 code archives, content-addressed (re-pushes upload nothing)
jobs/<job_id>/record.json             JobRecord, written once at submission
jobs/<job_id>/status.json             JobStatus, rewritten on every change
jobs/<job_id>/logs/<seq>.log          log segments, tagged lines, in order
jobs/<job_id>/metrics/rank-<r>.json   a rank's resource samples (storage/metrics.py)
projects/names/<sha256 of name>.json  the id a name was given (created if absent: the commit)
projects/<project_id>.json            ProjectRecord: a project's id and name (written after)
"""

from __future__ import annotations

import hashlib

from orchestrator.spec.base import check_safe_name


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

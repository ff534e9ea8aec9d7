"""Job records, statuses and code archives under a storage root."""

from __future__ import annotations

from pathlib import Path

from orchestrator.errors import JobNotFound, OrchestratorError
from orchestrator.storage import layout
from orchestrator.storage.records import JobRecord, JobStatus
from orchestrator.storage.root import StorageRoot


class JobStore:
    def __init__(self, root: StorageRoot | str) -> None:
        self.root = root if isinstance(root, StorageRoot) else StorageRoot(root)

    def create(self, record: JobRecord, status: JobStatus) -> None:
        if self.root.exists(layout.record(record.job_id)):
            raise OrchestratorError(f"job {record.job_id} already exists in {self.root.url}")
        self.root.write_json(layout.status(record.job_id), status.model_dump(mode="json"))
        self.root.write_json(layout.record(record.job_id), record.model_dump(mode="json"))

    def record(self, job_id: str) -> JobRecord:
        self._check_id(job_id)
        try:
            return JobRecord.model_validate(self.root.read_json(layout.record(job_id)))
        except FileNotFoundError:
            raise JobNotFound(f"no job {job_id!r} in {self.root.url}") from None

    def status(self, job_id: str) -> JobStatus:
        self._check_id(job_id)
        try:
            return JobStatus.model_validate(self.root.read_json(layout.status(job_id)))
        except FileNotFoundError:
            raise JobNotFound(f"no job {job_id!r} in {self.root.url}") from None

    def _check_id(self, job_id: str) -> None:
        """A value that is not an id (a name longer than a path segment may be, one with '/') is
        no job's: said so, never made a path."""
        if not layout.is_segment(job_id):
            raise JobNotFound(f"no job {job_id!r} in {self.root.url}")

    def put_status(self, status: JobStatus) -> None:
        self.root.write_json(layout.status(status.job_id), status.model_dump(mode="json"))

    def job_ids(self) -> list[str]:
        return [
            name for name in self.root.list_names(layout.jobs())
            if self.root.exists(layout.record(name))
        ]  # fmt: skip

    def records(self) -> list[JobRecord]:
        """Every job's record, oldest first."""
        return sorted((self.record(i) for i in self.job_ids()), key=lambda r: r.created_at)

    def has_archive(self, sha256: str) -> bool:
        return self.root.exists(layout.archive(sha256))

    def put_archive(self, local: Path, sha256: str) -> str:
        rel = layout.archive(sha256)
        if not self.root.exists(rel):
            self.root.put_file(local, rel)
        return rel

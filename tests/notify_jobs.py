"""Jobs and a webhook receiver for the notification tests: a job's status driven through its
states as a controller writes it (`JobScript`), and an HTTP server on 127.0.0.1 that can be down,
answer 500 now and then, and checks each signature (`Receiver`)."""

from __future__ import annotations

import hashlib
import hmac
import http.server
import json
import threading
import time

from orchestrator import definitions as d
from orchestrator.lifecycle import JobState
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.records import ArchiveRef, Attempt, Failure, JobRecord, JobStatus

SECRET = "whsec-5f0c2a9e71d4"


def job_record(job_id: str, team: str | None = None, ray_address: str | None = None) -> JobRecord:
    project = d.TrainingProject(name="demo", job=d.TrainingJob(image=d.Image(base_image="x")))
    archive = ArchiveRef(path="archives/x.tar", sha256="x", size_bytes=1, file_count=1,
                         config_dir=".")  # fmt: skip
    return JobRecord(job_id=job_id, project="demo", team=team, job_name=f"name-{job_id}",
                     created_at=time.time(), spec=project, archive=archive, storage_root="r",
                     ray_address=ray_address)  # fmt: skip


class JobScript:
    """One job's status, moved as its controller moves it, stored after each step."""

    def __init__(self, store: JobStore | None, job_id: str, team: str | None = None,
                 ray_address: str | None = None) -> None:  # fmt: skip
        self.store, self.record = store, job_record(job_id, team, ray_address)
        self.status = JobStatus.new(job_id)
        if store is not None:
            store.create(self.record, self.status)

    def _put(self, status: JobStatus) -> JobScript:
        self.status = status
        if self.store is not None:
            self.store.put_status(status)
        return self

    def to(self, state: JobState, reason: str | None = None) -> JobScript:
        return self._put(self.status.moved_to(state, reason))

    def run(self) -> JobScript:
        """Through PENDING and DEPLOYING to RUNNING, with a new attempt."""
        for state in (JobState.PENDING, JobState.DEPLOYING):
            if self.status.state != state:
                self.to(state)
        attempt = Attempt(number=len(self.status.attempts), started_at=time.time())
        self._put(self.status.model_copy(update={"attempts": [*self.status.attempts, attempt]}))
        return self.to(JobState.RUNNING)

    def end_attempt(self, cause: str | None, reason: str | None = None,
                    decision: str = "retried") -> JobScript:  # fmt: skip
        """The attempt's end as `Attempts._record_end` stores it: the job is still RUNNING."""
        last = self.status.attempts[-1].model_copy(
            update={"ended_at": time.time(), "cause": cause, "reason": reason, "decision": decision}
        )
        return self._put(self.status.model_copy(update={"attempts": [*self.status.attempts[:-1],
                                                                      last]}))  # fmt: skip

    def fail(self, cause: str, state: JobState = JobState.FAILED) -> JobScript:
        failed = self.status.model_copy(update={"failure": Failure(cause=cause)})
        return self._put(failed.moved_to(state, cause))


class Receiver:
    """A webhook receiver on 127.0.0.1:`port`: `up`/`down`; answers 500 to every
    `fail_every`-th request (counted over all requests) and records what it accepted."""

    def __init__(self, port: int, secret: str = SECRET, fail_every: int = 0) -> None:
        self.port, self.secret, self.fail_every = port, secret, fail_every
        self.accepted: list[dict] = []  # bodies answered 2xx, in arrival order
        self.headers: list[dict[str, str]] = []
        self.requests = 0
        self.bad_signatures = 0
        self.lock = threading.Lock()
        self.server: http.server.ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks/orchestrator"

    def up(self) -> None:
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                code = receiver.take(body, dict(self.headers))
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def down(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def take(self, body: bytes, headers: dict[str, str]) -> int:
        with self.lock:
            self.requests += 1
            expected = "sha256=" + hmac.new(self.secret.encode(), body, hashlib.sha256).hexdigest()
            if headers.get("X-Orchestrator-Signature") != expected:
                self.bad_signatures += 1
                return 401
            if self.fail_every and self.requests % self.fail_every == 0:
                return 500
            self.accepted.append(json.loads(body))
            self.headers.append(headers)
            return 200

    def ids(self) -> list[str]:
        with self.lock:
            return [b["id"] for b in self.accepted]

"""Starting an admitted job's controller (`ControllerLauncher`): a pushed job waits in the queue
as a file and a line in the service's memory, with no process of its own; when the queue admits
it, the service submits its controller as a Ray job (`RayJobLauncher`, through the head's own Job
API), so a running job is a Ray job in the dashboard with our metadata, as before.

The job id is the Ray job's submission id: a second submission of the same job (a service that
restarted between the submit and recording it) is answered "already exists", and is the same job.
"""

from __future__ import annotations

from typing import Any, Protocol

from orchestrator import ray_private
from orchestrator.storage.queue_store import QueueEntry

ENDED = ("FAILED", "STOPPED", "SUCCEEDED")
MISSING = "its Ray job does not exist"


class LaunchFailed(Exception):
    """The controller's Ray job could not be submitted; the message says why."""


class ControllerLauncher(Protocol):
    """Starts and stops controllers' Ray jobs: the Job API in the service, a fake in tests."""

    def session(self) -> str:
        """The Ray cluster session the service runs in (pushes name the one they went to)."""

    def launch(self, entry: QueueEntry) -> None:
        """Submit the entry's controller (entry.launch); LaunchFailed if the Job API refuses."""

    def stop(self, job_id: str) -> None:
        """Ask the controller's Ray job to stop (it flushes and records STOPPED itself)."""

    def ended(self, job_id: str) -> str | None:
        """ "FAILED: message" once the controller's Ray job has ended, MISSING if Ray knows no
        such job (not yet submitted, or lost with a head); None while it lives or cannot be
        told."""


class RayJobLauncher:
    """The head's Job API, reached on its own dashboard address from inside the service."""

    def __init__(self) -> None:
        self._client: Any = None

    def session(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_session_name())

    def launch(self, entry: QueueEntry) -> None:
        assert entry.launch is not None
        try:
            self.client().submit_job(
                submission_id=entry.job_id, entrypoint=entry.launch.entrypoint,
                metadata=dict(entry.launch.metadata), entrypoint_num_cpus=0,
            )  # fmt: skip
        except Exception as e:
            if "already exists" in str(e):  # submitted before, by this service or a controller
                return
            self._client = None
            raise LaunchFailed(" ".join(str(e).split()) or type(e).__name__) from e

    def stop(self, job_id: str) -> None:
        try:
            self.client().stop_job(job_id)
        except Exception:
            self._client = None

    def ended(self, job_id: str) -> str | None:
        try:
            info = self.client().get_job_info(job_id)
        except Exception as e:
            if "does not exist" in str(e) or "404" in str(e):
                return MISSING
            self._client = None
            return None
        state = str(info.status.value)
        return f"{state}: {info.message or 'no message'}" if state in ENDED else None

    def client(self) -> Any:
        if self._client is None:
            from ray.job_submission import JobSubmissionClient

            address = ray_private.dashboard_address()
            if not address:
                raise LaunchFailed("this Ray cluster runs no dashboard, whose Job API starts "
                                   "controllers: start the head with its dashboard")  # fmt: skip
            self._client = JobSubmissionClient(address if "://" in address else f"http://{address}")
        return self._client

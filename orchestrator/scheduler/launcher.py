"""Starting an admitted job's controller (`ControllerLauncher`): a pushed job waits in the queue
as a file and a line in the service's memory, with no process of its own; when the queue admits
it, the service starts its controller: by default as a thread of the head's controller host
(`HostedLauncher`, scheduler/controller_host.py), or, with ORCHESTRATOR_CONTROLLERS=ray-job, as
a Ray job of its own (`RayJobLauncher`, through the head's own Job API).

As a Ray job, the job id is its submission id: a second submission of the same job (a service
that restarted between the submit and recording it) is answered "already exists", and is the
same job. The host, likewise, starts a job's controller once.
"""

from __future__ import annotations

import traceback
from typing import Any, Protocol

from orchestrator import ray_private
from orchestrator.storage.queue_store import QueueEntry

ENDED = ("FAILED", "STOPPED", "SUCCEEDED")
MISSING = "its Ray job does not exist"
HOST_ASK_S = 10.0  # the controller host's answer; none: asked again at the next tick


class LaunchFailed(Exception):
    """The controller's Ray job could not be submitted; the message says why."""


class ControllerLauncher(Protocol):
    """Starts and stops controllers: the controller host or the Job API in the service, a fake
    in tests."""

    hosts: bool  # whether it starts controllers in the controller host (entry.hosted)

    def session(self) -> str:
        """The Ray cluster session the service runs in (pushes name the one they went to)."""

    def launch(self, entry: QueueEntry) -> str | None:
        """Start the entry's controller (entry.launch); LaunchFailed if it cannot be. A hosted
        one: the incarnation of the host that runs it."""

    def stop(self, job_id: str) -> None:
        """Ask the controller's Ray job to stop (it flushes and records STOPPED itself)."""

    def ended(self, job_id: str) -> str | None:
        """ "FAILED: message" once the controller's Ray job has ended, MISSING if Ray knows no
        such job (not yet submitted, or lost with a head); None while it lives or cannot be
        told."""

    def hosted_ended(self, entry: QueueEntry) -> str | None:
        """For a hosted controller (entry.hosted): "FAILED: why" once it is gone without its
        job's end recorded, "ENDED" once it ended after recording it, MISSING while the host
        has not started it yet; None while it runs or the host cannot be asked."""

    def gone(self, job_id: str, cause: str) -> None:
        """A hosted controller found gone (hosted_ended): what shows it as a Ray job ends too."""


class RayJobLauncher:
    """The head's Job API, reached on its own dashboard address from inside the service."""

    hosts = False

    def __init__(self) -> None:
        self._client: Any = None

    def session(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_session_name())

    def launch(self, entry: QueueEntry) -> str | None:
        assert entry.launch is not None
        try:
            self.client().submit_job(
                submission_id=entry.job_id, entrypoint=entry.launch.entrypoint,
                metadata=dict(entry.launch.metadata), entrypoint_num_cpus=0,
            )  # fmt: skip
        except Exception as e:
            if "already exists" in str(e):  # submitted before, by this service or a controller
                return None
            self._client = None
            raise LaunchFailed(" ".join(str(e).split()) or type(e).__name__) from e
        return None

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

    def hosted_ended(self, entry: QueueEntry) -> str | None:
        return None  # this launcher hosts none; one a host ran is failed by a hosting service

    def gone(self, job_id: str, cause: str) -> None:
        return None

    def client(self) -> Any:
        if self._client is None:
            from ray.job_submission import JobSubmissionClient

            address = ray_private.dashboard_address()
            if not address:
                raise LaunchFailed("this Ray cluster runs no dashboard, whose Job API starts "
                                   "controllers: start the head with its dashboard")  # fmt: skip
            self._client = JobSubmissionClient(address if "://" in address else f"http://{address}")
        return self._client


class HostedLauncher(RayJobLauncher):
    """Controllers as threads of the head's controller host; the Job API still for the Ray-job
    controllers a push starts itself (a root's first push, a job mirroring weights)."""

    hosts = True

    def __init__(self) -> None:
        super().__init__()
        self._host: Any = None
        self._table: dict[str, Any] | None = None
        self._table_at = -1.0

    def launch(self, entry: QueueEntry) -> str | None:
        if not entry.hosted:
            return super().launch(entry)
        import ray
        from ray.exceptions import RayActorError

        launch = entry.launch
        assert launch is not None and launch.storage_root and launch.scheduling_timeout_s
        row = {"entrypoint": launch.entrypoint, "metadata": launch.metadata}
        for tries_left in (1, 0):  # a host known to have died: a new one is started
            try:
                incarnation = ray.get(self.host().start.remote(
                    entry.job_id, launch.storage_root, launch.scheduling_timeout_s, row
                ), timeout=HOST_ASK_S)  # fmt: skip
                break
            except Exception as e:
                self._host = None
                if not (tries_left and isinstance(e, RayActorError)):
                    raise LaunchFailed(
                        f"the controller host did not take it: {type(e).__name__}: {e}"
                    ) from e
        self._table = None  # read afresh: it runs there now
        return str(incarnation)

    def stop(self, job_id: str) -> None:
        import ray

        try:
            if ray.get(self.host().stop.remote(job_id), timeout=HOST_ASK_S):
                return
        except Exception:
            self._host = None
        super().stop(job_id)  # a Ray-job controller (or none: nothing happens)

    def hosted_ended(self, entry: QueueEntry) -> str | None:
        table = self.table()
        if table is None:
            return None
        job_id = entry.job_id
        if job_id in table["running"]:
            return None
        if job_id in table["ended"]:
            why = table["ended"][job_id]
            return "ENDED" if why is None else f"FAILED: {why}"
        if entry.hosted_by is None:
            return MISSING
        if entry.hosted_by != table["incarnation"]:
            return (
                "FAILED: the controller host's process on the head ended (it died or was "
                "killed), and this job's controller with it; what it held was released"
            )
        return "ENDED"  # it ran here, and ended long enough ago to be forgotten

    def gone(self, job_id: str, cause: str) -> None:
        from orchestrator import ray_private

        try:
            ray_private.end_job_row(job_id, "FAILED", f"FAILED: {cause}")
        except Exception:  # the dashboard's row only: the job's own status is what counts
            traceback.print_exc()

    def table(self) -> dict[str, Any] | None:
        """The host's table, read at most once a second; an empty one when no host runs (a
        host that died is gone by name: every controller it ran is gone too). None when the
        host does not answer."""
        import time

        import ray

        if self._table is not None and time.monotonic() - self._table_at < 1.0:
            return self._table
        from orchestrator.agents.services import NAMESPACE
        from orchestrator.scheduler.controller_host import HOST_NAME

        try:
            host = ray.get_actor(HOST_NAME, namespace=NAMESPACE)
        except ValueError:
            self._table = {"incarnation": None, "running": [], "ended": {}}
        else:
            try:
                self._table = dict(ray.get(host.table.remote(), timeout=HOST_ASK_S))
            except Exception:
                return None
        self._table_at = time.monotonic()
        return self._table

    def host(self) -> Any:
        if self._host is None:
            from orchestrator.scheduler.controller_host import controller_host

            self._host = controller_host()
        return self._host

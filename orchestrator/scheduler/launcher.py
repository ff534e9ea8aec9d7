"""Starting an admitted job's controller (`ControllerLauncher`): a pushed job waits in the queue
as a file and a line in the service's memory, with no process of its own; when the queue admits
it, the service starts its controller: by default as a thread of the head's controller host
(`HostedLauncher`; the host is controller/host.py), or, with ORCHESTRATOR_CONTROLLERS=ray-job, as
a Ray job of its own (`RayJobLauncher`, through the head's own Job API).

As a Ray job, the job id is its submission id: a second submission of the same job (a service
that restarted between the submit and recording it) is answered "already exists", and is the
same job. The host, likewise, starts a job's controller once.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any, Protocol

from orchestrator import actor_names, ray_private
from orchestrator.storage.queue_store import QueueEntry

ENDED = ("FAILED", "STOPPED", "SUCCEEDED")
MISSING = "its Ray job does not exist"
HOST_ASK_S = 10.0  # the controller host's answer; none: asked again at the next tick


@dataclass(frozen=True)
class HostedJob:
    """What the controller host starts a job's controller with (ControllerHost.start)."""

    job_id: str
    storage_root: str
    scheduling_timeout_s: float
    entrypoint: str  # for its row in Ray's job table: what the dashboard shows
    metadata: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class HostTable:
    """What the controller host says of its controllers (ControllerHost.table)."""

    incarnation: str | None  # None: no host runs
    running: frozenset[str] = frozenset()
    ended: tuple[tuple[str, str | None], ...] = ()  # job id, why (None: its end was recorded)

    def why_ended(self, job_id: str) -> tuple[bool, str | None]:
        """Whether the job's controller ended here, and why (None: it recorded its end)."""
        for ended, why in self.ended:
            if ended == job_id:
                return True, why
        return False, None


def hosted_standing(table: HostTable, entry: QueueEntry) -> str | None:
    """What `hosted_ended` answers for a hosted entry, from the host's table."""
    if entry.job_id in table.running:
        return None
    ended, why = table.why_ended(entry.job_id)
    if ended:
        return "ENDED" if why is None else f"FAILED: {why}"
    if entry.hosted_by is None:
        return MISSING
    if entry.hosted_by != table.incarnation:
        return (
            "FAILED: the controller host's process on the head ended (it died or was "
            "killed), and this job's controller with it; what it held was released"
        )
    return "ENDED"  # it ran here, and ended long enough ago to be forgotten


class LaunchFailed(Exception):
    """The controller's Ray job could not be submitted; the message says why."""


class HostGone(LaunchFailed):
    """The controller host is not running: the job is started as a Ray job instead."""


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
    """Controllers as threads of the head's controller host, found by name; the Job API for the
    Ray-job controllers a push starts itself (a root's first push, a job mirroring weights) and
    for the jobs admitted while no host runs (a Ray-job controller starts one again: the host's
    class is the controller layer's, controller/host.py)."""

    def __init__(self) -> None:
        super().__init__()
        self._table: HostTable | None = None
        self._table_at = -1.0

    @property
    def hosts(self) -> bool:  # type: ignore[override]
        """Whether a controller host runs (its table answers)."""
        table = self.table()
        return table is not None and table.incarnation is not None

    def launch(self, entry: QueueEntry) -> str | None:
        if not entry.hosted:
            return super().launch(entry)
        import ray
        from ray.exceptions import RayActorError

        launch = entry.launch
        assert launch is not None and launch.storage_root and launch.scheduling_timeout_s
        job = HostedJob(entry.job_id, launch.storage_root, launch.scheduling_timeout_s,
                        launch.entrypoint, tuple(sorted(launch.metadata.items())))  # fmt: skip
        try:
            incarnation = ray.get(self._host().start.remote(job), timeout=HOST_ASK_S)
        except (ValueError, RayActorError) as e:
            self._table = None
            raise HostGone(f"the controller host is gone: {type(e).__name__}") from e
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
            raise LaunchFailed(f"the controller host did not take it: {why}") from e
        self._table = None  # read afresh: it runs there now
        return str(incarnation)

    def stop(self, job_id: str) -> None:
        import ray

        try:
            if ray.get(self._host().stop.remote(job_id), timeout=HOST_ASK_S):
                return
        except Exception:
            pass
        super().stop(job_id)  # a Ray-job controller (or none: nothing happens)

    def hosted_ended(self, entry: QueueEntry) -> str | None:
        table = self.table()
        return None if table is None else hosted_standing(table, entry)

    def gone(self, job_id: str, cause: str) -> None:
        from orchestrator import ray_private

        try:
            ray_private.end_job_row(job_id, "FAILED", f"FAILED: {cause}")
        except Exception:  # the dashboard's row only: the job's own status is what counts
            traceback.print_exc()

    def table(self) -> HostTable | None:
        """The host's table, read at most once a second; an empty one when no host runs (a
        host that died is gone by name: every controller it ran is gone too). None when the
        host does not answer."""
        import time

        import ray

        if self._table is not None and time.monotonic() - self._table_at < 1.0:
            return self._table
        try:
            host = self._host()
        except ValueError:
            self._table = HostTable(incarnation=None)
        else:
            try:
                self._table = ray.get(host.table.remote(), timeout=HOST_ASK_S)
            except Exception:
                return None
        self._table_at = time.monotonic()
        return self._table

    def _host(self) -> Any:
        """The host's handle, by name; ValueError when none runs."""
        import ray

        return ray.get_actor(actor_names.CONTROLLER_HOST, namespace=actor_names.NAMESPACE)

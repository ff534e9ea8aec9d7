"""How a job's controller comes to exist: `ControllerLauncher`, the one seam a cluster kind
implements to start, stop and watch controllers (a KubeRay backend would be one more: `launch`
a RayJob resource, `standing` from its status), chosen by `launcher_for`.

Every way a controller starts, in one list:
- **Admitted by the queue service** (the usual way): a pushed job waits in the queue as a file
  and a line in the service's memory, with no process; when the queue admits it, the service
  marks on its entry how it starts (`hosts`, stored first) and `launch`es it with the
  launcher of its head. `HostedLauncher` (ORCHESTRATOR_CONTROLLERS=hosted, the default) starts
  it as a thread of the head's controller host (controller/host.py); as a Ray job of its own
  where no host runs, where the entry lacks what the host needs (an older client's push), or
  where the host is found gone at the start (`HOST_GONE`: the queue marks it a Ray job and
  launches again). `RayJobLauncher` (ray-job) starts each as a Ray job, through the head's own
  Job API, its submission id the job id: a second submission of the same job is answered
  "already exists", and is the same job.
- **The push's own** (client/bootstrap.py): a root's first push to a cluster, which no service
  watches yet, submits its controller as a Ray job, which starts the service; so does a job
  that mirrors weights while it waits. Every later push of the root is the service's.
- **`ray job submit ... orchestrator run`**: the controller runs in the user's own Ray job.

The controller host is not started here (its code is the controller layer's, above this one):
every controller that is a Ray job of its own starts it if none runs (`ensure_host`), and the
service finds it by name. The service's reaper (orphan_reaper.py) asks the launcher how each
controller it started stands (`standing`, a `ControllerStanding`).
"""

from __future__ import annotations

import enum
import traceback
from dataclasses import dataclass
from typing import Any, Protocol

from orchestrator import actor_names, ray_private
from orchestrator.storage.queue_store import QueueEntry

RAY_ENDED = ("FAILED", "STOPPED", "SUCCEEDED")  # a Ray job's terminal states
HOST_ASK_S = 10.0  # the controller host's answer; none: asked again at the next tick


class ControllerState(enum.Enum):
    RUNNING_OR_UNKNOWN = "running or unknown"  # it runs, or the launcher cannot tell now
    NOT_STARTED = "not started"  # no such controller: its start has not answered, or was lost
    ENDED = "ended"  # it ended; `cause`: how, where the launcher knows (a Ray job's end)
    FAILED = "failed"  # gone without recording its job's end; `cause`: why (the job's cause)


@dataclass(frozen=True)
class ControllerStanding:
    """How a started controller stands, as its launcher sees it (what the reaper acts on)."""

    state: ControllerState
    cause: str = ""

    @classmethod
    def ended(cls, cause: str = "") -> ControllerStanding:
        return cls(ControllerState.ENDED, cause)

    @classmethod
    def failed(cls, cause: str) -> ControllerStanding:
        return cls(ControllerState.FAILED, cause)


RUNNING_OR_UNKNOWN = ControllerStanding(ControllerState.RUNNING_OR_UNKNOWN)
NOT_STARTED = ControllerStanding(ControllerState.NOT_STARTED)


class Launched(enum.Enum):
    HOSTED = "hosted"  # a thread of the controller host; `host` is its incarnation
    RAY_JOB = "ray-job"  # a Ray job of its own (or submitted before: the same job)
    HOST_GONE = "host gone"  # nothing started: the host was gone; start it as a Ray job
    REFUSED = "refused"  # it cannot be started; `cause` says why (the job is DEPLOY_FAILED)


@dataclass(frozen=True)
class LaunchOutcome:
    """What `launch` did."""

    launched: Launched
    host: str | None = None
    cause: str = ""

    @classmethod
    def refused(cls, cause: str) -> LaunchOutcome:
        return cls(Launched.REFUSED, cause=cause)


AS_RAY_JOB = LaunchOutcome(Launched.RAY_JOB)


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


def hosted_standing(table: HostTable, entry: QueueEntry) -> ControllerStanding:
    """How a hosted entry's controller stands, from the host's table."""
    if entry.job_id in table.running:
        return RUNNING_OR_UNKNOWN
    ended, why = table.why_ended(entry.job_id)
    if ended:
        return ControllerStanding.ended() if why is None else ControllerStanding.failed(why)
    if entry.hosted_by is None:
        return NOT_STARTED
    if entry.hosted_by != table.incarnation:
        return ControllerStanding.failed(
            "the controller host's process on the head ended (it died or was killed), and this "
            "job's controller with it; what it held was released"
        )
    return ControllerStanding.ended()  # it ran here, and ended long enough ago to be forgotten


def hostable(entry: QueueEntry) -> bool:
    """Whether the entry carries what the host starts a controller with (one pushed by an
    older client does not: it is started as a Ray job)."""
    launch = entry.launch
    return bool(launch is not None and launch.storage_root and launch.scheduling_timeout_s)


class ControllerLauncher(Protocol):
    """Starts, stops and watches a cluster's controllers: the service's, from inside Ray; a
    fake in tests."""

    def session(self) -> str:
        """The Ray cluster session the service runs in (pushes name the one they went to)."""

    def hosts(self, entry: QueueEntry) -> bool:
        """Whether `launch` would start this entry's controller in the controller host (the
        queue stores it on the entry, `hosted`, before launching)."""

    def launch(self, entry: QueueEntry) -> LaunchOutcome:
        """Start the entry's controller (entry.launch), hosted if the entry is marked so."""

    def stop(self, job_id: str) -> None:
        """Ask the job's controller to stop (it flushes and records STOPPED itself)."""

    def standing(self, entry: QueueEntry) -> ControllerStanding:
        """How the controller `launch` started stands: a hosted one (entry.hosted) by the
        host's table, a Ray job by Ray's."""

    def gone(self, job_id: str, cause: str) -> None:
        """A hosted controller found gone (FAILED): what shows it as a Ray job ends too."""


def launcher_for(controllers: str) -> ControllerLauncher:
    """The launcher of a head whose ORCHESTRATOR_CONTROLLERS is `controllers`."""
    return HostedLauncher() if controllers == "hosted" else RayJobLauncher()


class RayJobLauncher:
    """Controllers as Ray jobs of their own, through the head's Job API, reached on its own
    dashboard address from inside the service."""

    def __init__(self) -> None:
        self._client: Any = None

    def session(self) -> str:
        return ray_private.session_name()

    def hosts(self, entry: QueueEntry) -> bool:
        return False

    def launch(self, entry: QueueEntry) -> LaunchOutcome:
        assert entry.launch is not None
        try:
            self.client().submit_job(
                submission_id=entry.job_id, entrypoint=entry.launch.entrypoint,
                metadata=dict(entry.launch.metadata), entrypoint_num_cpus=0,
            )  # fmt: skip
        except Exception as e:
            if "already exists" in str(e):  # submitted before, by this service or a push
                return AS_RAY_JOB
            self._client = None
            return LaunchOutcome.refused(" ".join(str(e).split()) or type(e).__name__)
        return AS_RAY_JOB

    def stop(self, job_id: str) -> None:
        try:
            self.client().stop_job(job_id)
        except Exception:
            self._client = None

    def standing(self, entry: QueueEntry) -> ControllerStanding:
        if entry.hosted:  # this launcher hosts none: one a host ran, a hosting service fails
            return RUNNING_OR_UNKNOWN
        try:
            info = self.client().get_job_info(entry.job_id)
        except Exception as e:
            if "does not exist" in str(e) or "404" in str(e):
                return NOT_STARTED  # not submitted yet, or lost with a head
            self._client = None
            return RUNNING_OR_UNKNOWN
        state = str(info.status.value)
        if state in RAY_ENDED:
            return ControllerStanding.ended(f"{state}: {info.message or 'no message'}")
        return RUNNING_OR_UNKNOWN

    def gone(self, job_id: str, cause: str) -> None:
        return None

    def client(self) -> Any:
        """The head's Job API client (made once; RuntimeError without a dashboard)."""
        if self._client is None:
            from ray.job_submission import JobSubmissionClient

            address = ray_private.dashboard_address()
            if not address:
                raise RuntimeError("this Ray cluster runs no dashboard, whose Job API starts "
                                   "controllers: start the head with its dashboard")  # fmt: skip
            self._client = JobSubmissionClient(address if "://" in address else f"http://{address}")
        return self._client


class HostedLauncher(RayJobLauncher):
    """Controllers as threads of the head's controller host, found by name; Ray jobs (the Job
    API) for the entries not marked hosted: admitted while no host ran, or whose host was
    found gone at their start, or pushed without what the host needs."""

    def __init__(self) -> None:
        super().__init__()
        self._table: HostTable | None = None
        self._table_at = -1.0

    def hosts(self, entry: QueueEntry) -> bool:
        """A controller host runs (its table answers) and the entry can be started there."""
        if not hostable(entry):
            return False
        table = self.table()
        return table is not None and table.incarnation is not None

    def launch(self, entry: QueueEntry) -> LaunchOutcome:
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
        except (ValueError, RayActorError) as e:  # gone by name, or died as it was asked
            self._table = None
            return LaunchOutcome(Launched.HOST_GONE, cause=f"the controller host is gone: "
                                 f"{type(e).__name__}")  # fmt: skip
        except Exception as e:
            return LaunchOutcome.refused(
                f"the controller host did not take it: {type(e).__name__}: {e}"
            )
        self._table = None  # read afresh: it runs there now
        return LaunchOutcome(Launched.HOSTED, host=str(incarnation))

    def stop(self, job_id: str) -> None:
        import ray

        try:
            if ray.get(self._host().stop.remote(job_id), timeout=HOST_ASK_S):
                return
        except Exception:
            pass
        super().stop(job_id)  # a Ray-job controller (or none: nothing happens)

    def standing(self, entry: QueueEntry) -> ControllerStanding:
        if not entry.hosted:
            return super().standing(entry)
        table = self.table()
        return RUNNING_OR_UNKNOWN if table is None else hosted_standing(table, entry)

    def gone(self, job_id: str, cause: str) -> None:
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

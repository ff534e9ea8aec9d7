"""Job handles: status, logs, wait and stop, read straight off the storage root."""

from __future__ import annotations

import hashlib
import shlex
import tarfile
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.books.usage import JobUsage, job_usage
from orchestrator.client.audit import audited
from orchestrator.client.connection import Connection
from orchestrator.client.log_view import FOLLOW_PROGRESS_S, thin_progress
from orchestrator.client.metrics import JobMetrics
from orchestrator.client.rank_exec import run_on_rank
from orchestrator.client.stacks import job_stacks
from orchestrator.errors import OrchestratorError
from orchestrator.lifecycle import JobState
from orchestrator.storage import layout
from orchestrator.storage.checkpoints import CheckpointStore, Manifest, ManifestFile
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.logs import read_logs
from orchestrator.storage.queue_store import QueueEntry, QueueStore
from orchestrator.storage.records import Attempt, Failure, JobRecord, JobStatus
from orchestrator.storage.stacks import StackStore

if TYPE_CHECKING:
    from plotly.graph_objects import Figure

POLL_S = 0.25
FOLLOW_POLL_LOCAL_S = 0.1  # a local storage root is cheap to read: follow logs closely
_GONE = "GONE"  # the job's (loopback) cluster does not answer at all


class JobHandle:
    """A pushed job. Works after the Ray cluster is gone (except `stop`)."""

    def __init__(self, store: JobStore, record: JobRecord) -> None:
        self._store = store
        self.record = record
        self._ray_client: Any = None

    @property
    def id(self) -> str:
        return self.record.job_id

    @property
    def project(self) -> str:
        """The project's name, as written in its config."""
        return self.record.project

    @property
    def project_id(self) -> str:
        return self.record.project_key

    @property
    def dashboard_url(self) -> str | None:
        """The job's page in the Ray dashboard (its Ray job: the controller's, submission id =
        job id), where the cluster was reached through its dashboard; None otherwise. A queued
        job has no page until it is admitted: the queue is `orchestrator queue`."""
        address = (self.record.ray_address or "").rstrip("/")
        if not address.startswith(("http://", "https://")):
            return None
        return f"{address}/#/jobs/{self.id}"

    def __repr__(self) -> str:
        return f"<TrainingJob {self.id} project={self.project!r} status={self.status().value}>"

    def __getitem__(self, key: str) -> Any:
        """Dict access as Baseten's `push` result: `["training_project"]`, `["training_job"]`."""
        views = {
            "training_project": {"id": self.project_id, "name": self.project},
            "training_job": {
                "id": self.id,
                "name": self.record.job_name,
                "current_status": self.status().value,
                "training_project": {"id": self.project_id, "name": self.project},
            },
        }
        return views[key]

    def details(self) -> JobStatus:
        """The stored status, as the job's controller last recorded it (a read, no network)."""
        return self._store.status(self.id)

    def refresh(self) -> JobStatus:
        """The stored status, reconciled with Ray: a job whose controller or cluster died
        without a word is recorded FAILED (or STOPPED) here, with why."""
        status = self._store.status(self.id)
        if status.state.is_terminal or self.record.ray_address is None:
            return status
        ray_state = self._ray_job_state()
        if ray_state in ("FAILED", "STOPPED", "SUCCEEDED", _GONE):
            status = self._store.status(self.id)  # it may have just been written
            if not status.state.is_terminal:
                cause = (
                    f"the Ray cluster at {self.record.ray_address} is no longer running"
                    if ray_state == _GONE
                    else f"the job's controller ended ({ray_state}) without recording an outcome"
                )
                failure = Failure(cause=cause)
                new = JobState.STOPPED if ray_state == "STOPPED" else JobState.FAILED
                status = status.moved_to(new, cause).model_copy(update={"failure": failure})
                self._store.put_status(status)
        return status

    def status(self) -> JobState:
        """The stored state (no network: `refresh()` asks Ray)."""
        return self.details().state

    def wait(self, timeout: float | None = None) -> JobState:
        """Block until the job ends; TimeoutError after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            state = self.refresh().state
            if state.is_terminal:
                return state
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {self.id} is still {state.value} after {timeout} s")
            time.sleep(POLL_S)

    def logs(
        self, follow: bool = False, progress_every_s: float = FOLLOW_PROGRESS_S
    ) -> list[str] | Iterator[str]:
        """All stored lines; with `follow`, an iterator that ends when the job does.

        A progress bar's states are lines tagged `progress` (`[rank 0 12:00:01 progress] ...`);
        following, a rank's latest state comes at most every `progress_every_s` (0: every one
        stored), so printing each line does not flood a notebook cell. Other lines, and each
        bar's final state, always come.
        """
        if not follow:
            return read_logs(self._store.root, self.id)[0]
        return thin_progress(self._follow(), progress_every_s)

    def _follow(self) -> Iterator[list[str]]:
        """The new lines of each read of the stored logs, until the job has ended."""
        cursor = -1
        while True:
            ended = self.refresh().state.is_terminal
            lines, cursor = read_logs(self._store.root, self.id, cursor)
            if lines:
                yield lines
            if ended:
                return
            time.sleep(FOLLOW_POLL_LOCAL_S if self._store.root.is_local else POLL_S)

    def stop(self, timeout: float = 90) -> JobState:
        """Stop the job (SIGTERM to its commands, SIGKILL after a grace period) and wait. A job
        that waits in the queue with no controller yet is stopped by the queue service."""
        if (state := self.refresh().state).is_terminal:
            return state
        with self._audited("stop") as event:
            if (waiting := self._waiting_entry()) is not None:
                state = stop_waiting(self._store, waiting, timeout)
            elif self._hosted_entry() is not None:
                state = self._stop_hosted(timeout)
            else:
                client = self._client()
                try:
                    client.stop_job(self.id)
                except Exception as e:
                    raise OrchestratorError(f"could not stop job {self.id}: {e}") from e
                state = self.wait(timeout)
            event["detail"] = (f"ended {state.value}" if state.is_terminal
                               else f"still {state.value} after {timeout:g} s")  # fmt: skip
        return state

    def attempts(self) -> list[Attempt]:
        """Each run of the job's commands (BT_RETRY_COUNT), with how it ended and why."""
        return self.refresh().attempts

    def usage(self) -> JobUsage:
        """What the job has held (GPU-, CPU-, memory-seconds), waited, lost to faults and cost,
        at the prices of its admissions (books/usage.py)."""
        return job_usage(self.record, self.refresh(), time.time())

    def cost_per_hour(self) -> str | None:
        """What the job's nodes cost an hour at the cluster's prices now, in words (None: no
        prices set); what it cost so far is `usage().usage.cost`."""
        from orchestrator.client.books import cost_line
        from orchestrator.storage.prices import read_prices

        return cost_line(self.record.spec.job.compute, read_prices(self._store.root))

    def metrics(self) -> JobMetrics:
        """Each rank's resource samples, with the time in each state, weights delivery and
        checkpoint uploads (client/metrics.py)."""
        return JobMetrics.read(self._store.root, self.record, self.refresh())

    def plot_metrics(self) -> Figure:
        """The samples as a plotly figure, one panel per resource (shown inline in Jupyter)."""
        from orchestrator.client.metrics_plot import figure  # plotly only when plotting

        return figure(self.metrics())

    def checkpoints(self) -> list[Manifest]:
        """This job's uploaded checkpoints, every rank's, oldest first."""
        return CheckpointStore(self._store.root).list(self.project_id, self.id)

    def checkpoint(self, name: str | None = None, rank: int | None = None) -> Manifest:
        """One checkpoint: `name` (default: the newest whole one) from `rank` (default: 0 if it
        has it, else the lowest); an error that lists what exists when nothing matches."""
        return _choose(self, name, rank)

    def checkpoint_urls(
        self, name: str | None = None, rank: int | None = None, expires_s: int = 3600
    ) -> list[tuple[ManifestFile, str]]:
        """Time-limited URLs for one checkpoint's files (storage roots on S3 or GCS)."""
        manifest = self.checkpoint(name, rank)
        return CheckpointStore(self._store.root).signed_urls(manifest, expires_s)

    def download_checkpoint(
        self, manifest: Manifest, dest: Path, progress: Callable[[int], None] | None = None
    ) -> Path:
        """One checkpoint's files into `dest`, each checked against its manifest; `progress`
        gets the bytes as they arrive."""
        CheckpointStore(self._store.root).download(manifest, dest, progress=progress)
        return dest

    def checkpoint_file(self, manifest: Manifest, path: str) -> bytes:
        """One file of an uploaded checkpoint (e.g. its adapter_config.json)."""
        return self._store.root.read_bytes(f"{manifest.files_dir}/{path}")

    def download_code(self, target: Path) -> Path:
        """The job's code archive, as pushed, unpacked into `target` (new or empty)."""
        if target.exists() and (not target.is_dir() or any(target.iterdir())):
            raise OrchestratorError(f"{target} already exists and is not empty: pick another")
        archive = self.record.archive
        if not self._store.has_archive(archive.sha256):
            raise OrchestratorError(f"job {self.id}'s code archive {archive.path} is no longer "
                                    f"in {self._store.root.url}: nothing to download")  # fmt: skip
        target.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="orchestrator-code-") as tmp:
            local = Path(tmp) / "workspace.tar"
            self._store.root.get_file(archive.path, local)
            if _sha256(local) != archive.sha256:
                raise OrchestratorError(f"code archive {archive.path} does not match its sha256")
            with tarfile.open(local) as tar:
                tar.extractall(target, filter="data")
        return target

    def update_session(self, minutes: float) -> float:
        """Hold the job's nodes until `minutes` from now once its commands end (or longer, if
        its interactive_session already does): `truss train isession --update-timeout`."""
        if self.record.spec.job.interactive_session is None:
            raise OrchestratorError(f"job {self.id} has no interactive_session in its config: set "
                                    "one (trigger on_demand holds the nodes only when asked) and "
                                    "push again")  # fmt: skip
        if (state := self.refresh().state).is_terminal:
            raise OrchestratorError(f"job {self.id} has ended ({state.value})")
        until = time.time() + minutes * 60
        with self._audited("isession", detail=f"hold {minutes:g} minutes"):
            self._store.root.write_json(layout.session(self.id), {"held_until": until})
        return until

    def attach(self, rank: int = 0, stdin_fd: int = 0, stdout_fd: int = 1) -> int:
        """An interactive shell (a real PTY) in the running job's rank `rank`, on this terminal,
        through Ray Client; the shell's exit code (client/terminal.py)."""
        from orchestrator.client.terminal import attach

        if (state := self.refresh().state).is_terminal:
            raise OrchestratorError(f"job {self.id} has ended ({state.value})")
        with self._audited("shell", detail=f"terminal, rank {rank}"):
            return attach(self, rank, stdin_fd, stdout_fd)

    def exec(self, command: str, rank: int = 0, timeout_s: float = 600) -> tuple[int, str]:
        """Run one shell command in the running job's rank `rank`, as its commands run (working
        directory, environment, secrets resolved on the node and masked in the output); its
        exit code and output. Goes through the Job API as a short Ray job: no SSH, no ports."""
        if (state := self.refresh().state).is_terminal:
            raise OrchestratorError(f"job {self.id} has ended ({state.value})")
        with self._audited("shell", detail=f"command, rank {rank}") as event:  # not its text
            code, output = run_on_rank(self.record, self._client, command, rank, timeout_s)
            event["detail"] += f", exit {code}"
        return code, output

    def stacks(self, timeout_s: float = 120) -> dict[int, str]:
        """Every rank's Python stacks by rank (py-spy, all threads): taken now from a running
        job, else the last set stored (a stuck attempt's); client/stacks.py."""
        return job_stacks(self, self._store.root, timeout_s)

    def stack_sets(self) -> list[str]:
        """The job's stored stack sets, oldest first: `attempt-<n>` (stuck), `taken-<time>`."""
        return StackStore(self._store.root, self.id).sets()

    def _audited(self, verb: str, **target: Any) -> Any:
        """`audited` of a change to this job (client/audit.py)."""
        return audited(self._store.root, verb, job=self.id, project=self.project,
                       team=self.record.team, **target)  # fmt: skip

    def _waiting_entry(self) -> QueueEntry | None:
        queue = QueueStore(self._store.root)
        entry = queue.entry(self.id) or queue.incoming_entry(self.id)
        return entry if entry is not None and entry.awaits_controller else None

    def _stop_hosted(self, timeout: float) -> JobState:
        """A job whose controller is a thread of the controller host: stopped through a short
        Ray job that asks the host (the Job API's authentication, as a Ray job's stop has, and
        no write to the storage root, which may be out); then its end is waited for."""
        from orchestrator.client.submit import dashboard_name, remote_python, submit_ray_job

        client = self._client()
        stop_id = f"{self.id}-stop-{uuid.uuid4().hex[:8]}"
        entrypoint = shlex.join(
            [
                remote_python(self.record.embedded_cluster),
                "-m",
                "orchestrator.controller.host",
                "--stop",
                self.id,
            ]
        )
        submit_ray_job(self._client, str(self.record.ray_address), stop_id,
                       entrypoint=entrypoint, entrypoint_num_cpus=0,
                       metadata={"orchestrator_stop_of": self.id,
                                 "job_name": f"{dashboard_name(self.record)}: stop"})  # fmt: skip
        deadline = time.monotonic() + timeout
        while not (state := self.refresh().state).is_terminal:
            if client.get_job_status(stop_id).value == "FAILED":
                info = client.get_job_info(stop_id)
                raise OrchestratorError(f"could not stop job {self.id}: {info.message}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {self.id} is still {state.value} after {timeout} s")
            time.sleep(POLL_S)
        return state

    def _hosted_entry(self) -> QueueEntry | None:
        """The queue's entry of a job whose controller is a thread of the controller host."""
        entry = QueueStore(self._store.root).entry(self.id)
        return entry if entry is not None and entry.hosted else None

    def _client(self) -> Any:
        address = self.record.ray_address
        if address is None:
            raise OrchestratorError(f"job {self.id} was not submitted through the Job API")
        if self._ray_client is None:
            embedded = bool(self.record.embedded_cluster)
            self._ray_client = Connection(address=address, embedded=embedded).client()
        return self._ray_client

    def _ray_job_state(self) -> str | None:
        import requests

        try:
            info = self._client().get_job_info(self.id)
            if (info.metadata or {}).get("orchestrator_controller") == "hosted":
                return None  # a row the controller host keeps: the record says more, first
            return str(info.status.value)
        except (ConnectionError, requests.exceptions.ConnectionError):
            self._ray_client = None
            # Nothing answers. Our own embedded cluster gone means its jobs are gone; any other
            # cluster (a tunnel, a remote head) may only be out of reach: trust the record.
            return _GONE if self.record.embedded_cluster else None
        except Exception:
            return None


def stop_waiting(store: JobStore, entry: QueueEntry, timeout: float) -> JobState:
    """Ask the queue service to stop a job that has no controller, and wait for its end. With no
    service watching the root, nothing can start the job meanwhile: it is ended here."""
    queue = QueueStore(store.root)
    queue.request_stop(entry.job_id, time.time())
    deadline = time.monotonic() + timeout
    while not (state := store.status(entry.job_id).state).is_terminal:
        if entry.cluster is None or not queue.watched_by(entry.cluster):
            queue.drop_incoming(entry.job_id)
            queue.remove(entry.job_id)  # no service holds it in memory now
            status = store.status(entry.job_id)
            if not status.state.is_terminal:
                store.put_status(status.moved_to(JobState.STOPPED, "stopped by user"))
            continue
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {entry.job_id} is still {state.value} after {timeout} s")
        time.sleep(POLL_S / 4)
    return state


def _choose(job: JobHandle, name: str | None, rank: int | None) -> Manifest:
    """The checkpoint asked for; an error that lists what exists when nothing matches."""
    every = job.checkpoints()
    if not every:
        raise OrchestratorError(f"job {job.id} has no uploaded checkpoints")
    found = every
    if rank is not None:
        found = [m for m in found if m.node_rank == rank]
        if not found:
            raise OrchestratorError(
                f"rank {rank} of job {job.id} uploaded no checkpoints; it has: {_inventory(every)}"
            )
    if name is None:  # the newest whole one: an incomplete checkpoint only when named
        whole = [m for m in found if m.complete]
        if not whole:
            raise OrchestratorError(
                f"job {job.id} has only incomplete checkpoints ({_inventory(every)}): "
                "name one with --name to download it anyway"
            )
        name = whole[-1].name
    found = [m for m in found if m.name == name]
    if not found:
        raise OrchestratorError(
            f"job {job.id} has no checkpoint {name!r}"
            + (f" from rank {rank}" if rank is not None else "")
            + f"; it has: {_inventory(every)}"
        )
    if rank is None:
        return next((m for m in found if m.node_rank == 0), min(found, key=lambda m: m.node_rank))
    return found[-1]


def _inventory(manifests: list[Manifest]) -> str:
    """`checkpoint-1 (ranks 0, 1), checkpoint-2 (rank 0)`, oldest first."""
    ranks: dict[str, list[int]] = {}
    for m in manifests:
        ranks.setdefault(m.name, []).append(m.node_rank)
    return ", ".join(
        f"{n} (rank{'s' if len(r) > 1 else ''} {', '.join(map(str, sorted(r)))})"
        for n, r in ranks.items()
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()

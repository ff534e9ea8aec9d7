"""Controllers hosted in one resident process on the head (`ControllerHost`), a thread each.

A controller started as its own Ray job pays Ray's JobSupervisor actor (a worker process), a
shell and a Python interpreter with its imports: about 6 CPU-seconds and 150-280 MiB on the
head for each running job, and 3-4 s before its first step. The queue service starts the jobs
it admits here instead: the host has imported everything once, so a controller is a thread
that starts in milliseconds and costs what its own objects take.

What a thread cannot have, the host does for it: a stop is asked of the host (`stop`), which
sets the controller's stop event as its SIGTERM handler would; a controller that raised
anyway is recorded FAILED here; and the queue service asks the host which controllers run
(`table`), so one that is gone without recording its end is failed with a cause, as a dead
Ray job's is. The host is a detached actor that Ray does not restart: when its process dies,
so do the agents and placement groups its controllers held, the service fails their jobs, and
the next admission starts a new host (a new `incarnation`).
"""

from __future__ import annotations

import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, TextIO

HOST_NAME = "orchestrator-controllers"
ENDED_KEPT = 1000  # how many ended controllers the host remembers (the service reads them)


class ControllerHost:
    """Runs `JobController`s in threads; every method returns at once."""

    def __init__(self) -> None:
        self.incarnation = uuid.uuid4().hex
        self.lock = threading.Lock()
        self.threads: dict[str, threading.Thread] = {}
        self.stop_events: dict[str, threading.Event] = {}
        self.ended: dict[str, str | None] = {}  # job id: None, or why it ended without a record

    def start(
        self, job_id: str, storage_root: str, scheduling_timeout_s: float,
        row: dict[str, Any] | None = None,
    ) -> str:  # fmt: skip
        """Start the job's controller unless this host runs or ran it; the host's incarnation.
        `row`: its entrypoint and metadata, for its row in Ray's job table (the dashboard)."""
        with self.lock:
            if job_id not in self.threads and job_id not in self.ended:
                self.stop_events[job_id] = threading.Event()
                thread = threading.Thread(
                    target=self._run, args=(job_id, storage_root, scheduling_timeout_s, row),
                    name=f"controller-{job_id}", daemon=True,
                )  # fmt: skip
                self.threads[job_id] = thread
                thread.start()
        return self.incarnation

    def stop(self, job_id: str) -> bool:
        """Ask the job's controller to stop (it flushes and records STOPPED); whether it runs."""
        with self.lock:
            event = self.stop_events.get(job_id)
        if event is not None:
            event.set()
        return event is not None

    def table(self) -> dict[str, Any]:
        """This host's incarnation, the job ids whose controllers run, and those that ended
        (with why, for one that ended without recording its end)."""
        with self.lock:
            return {
                "incarnation": self.incarnation,
                "running": sorted(self.threads),
                "ended": dict(self.ended),
            }

    def stop_all(self, timeout_s: float) -> list[str]:
        """Stop every controller and wait for them (up to `timeout_s`); those still running."""
        with self.lock:
            events, threads = list(self.stop_events.values()), list(self.threads.values())
        for event in events:
            event.set()
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self.lock:
            return sorted(self.threads)

    def _run(
        self, job_id: str, storage_root: str, scheduling_timeout_s: float,
        row: dict[str, Any] | None,
    ) -> None:  # fmt: skip
        from orchestrator.controller.controller import JobController
        from orchestrator.controller.queueing import HostedJobQueue
        from orchestrator.storage.job_store import JobStore

        why: str | None = None
        shown = JobRow(job_id, row)
        try:
            controller = JobController(JobStore(storage_root), job_id, scheduling_timeout_s,
                                       queue=HostedJobQueue, echo=shown.log)  # fmt: skip
            with self.lock:  # a stop asked while it was being made is carried over
                if self.stop_events[job_id].is_set():
                    controller.stop_requested.set()
                self.stop_events[job_id] = controller.stop_requested
            state = controller.run()
            history = controller.status.history
            shown.end(state.value, history[-1].reason if history else None)
        except BaseException as e:
            traceback.print_exc()
            why = f"the job's controller raised {type(e).__name__}: {e}"
            record_failed(storage_root, job_id, why)
            shown.end("FAILED", why)
        finally:
            with self.lock:
                self.threads.pop(job_id, None)
                self.stop_events.pop(job_id, None)
                self.ended[job_id] = why
                while len(self.ended) > ENDED_KEPT:
                    self.ended.pop(next(iter(self.ended)))


class JobRow:
    """A hosted job as a Ray job in the dashboard: its row in Ray's job table (RUNNING while
    its controller runs, then how it ended) and its controller's lines in the file `ray job
    logs` reads. Best effort: a failure here is printed and never touches the job."""

    STATES = {"COMPLETED": "SUCCEEDED", "STOPPED": "STOPPED"}  # any other end: FAILED

    def __init__(self, job_id: str, row: dict[str, Any] | None) -> None:
        self.job_id = job_id
        self.log: TextIO | None = None
        if row is None:
            return
        try:
            from orchestrator import ray_private

            agent, node_id, logs = ray_private.job_driver_place()
            self.log = open(Path(logs) / f"job-driver-{job_id}.log", "a", buffering=1)  # noqa: SIM115
            ray_private.put_job_row(job_id, {
                "status": "RUNNING", "entrypoint": row["entrypoint"],
                "message": "its controller runs in the controller host (orchestrator-controllers)",
                "start_time": int(time.time() * 1000), "entrypoint_num_cpus": 0,
                "metadata": {**row["metadata"], "orchestrator_controller": "hosted"},
                "driver_agent_http_address": agent, "driver_node_id": node_id,
            })  # fmt: skip
        except Exception:
            traceback.print_exc()

    def end(self, state: str, reason: str | None) -> None:
        try:
            from orchestrator import ray_private

            status = self.STATES.get(state, "FAILED")
            ray_private.end_job_row(self.job_id, status, f"{state}: {reason or 'no reason'}")
        except Exception:
            traceback.print_exc()
        finally:
            if self.log is not None:
                self.log.close()


def record_failed(storage_root: str, job_id: str, cause: str) -> None:
    """A controller that raised before or after its own records: its job FAILED, with why."""
    from orchestrator.lifecycle import JobState
    from orchestrator.storage.job_store import JobStore
    from orchestrator.storage.records import Failure

    try:
        store = JobStore(storage_root)
        status = store.status(job_id)
        if not status.state.is_terminal:
            store.put_status(status.moved_to(JobState.FAILED, cause).model_copy(
                update={"failure": Failure(cause=cause)}
            ))  # fmt: skip
    except Exception:
        traceback.print_exc()


def controller_host() -> Any:
    """The cluster's controller host, started on this node (the head) if it is not running."""
    import ray

    from orchestrator.agents.services import NAMESPACE, shared_actor

    try:
        return ray.get_actor(HOST_NAME, namespace=NAMESPACE)
    except ValueError:
        pass
    return shared_actor(ControllerHost, HOST_NAME, pinned_here=True, max_concurrency=64)


def stop_every_controller(timeout_s: float) -> list[str]:
    """Stop the hosted controllers of the cluster this driver is connected to, and wait; the
    job ids still running after `timeout_s`. (`orchestrator cluster stop`, through a Ray job.)"""
    import ray

    from orchestrator.agents.services import NAMESPACE

    try:
        host = ray.get_actor(HOST_NAME, namespace=NAMESPACE)
    except ValueError:
        return []
    return list(ray.get(host.stop_all.remote(timeout_s), timeout=timeout_s + 30))


if __name__ == "__main__":  # `python -m orchestrator.scheduler.controller_host STOP_TIMEOUT_S`
    import sys

    import ray

    ray.init(address="auto", log_to_driver=False)
    left = stop_every_controller(float(sys.argv[1]))
    print(f"controllers still running: {', '.join(left)}" if left else "every controller ended")
    sys.exit(1 if left else 0)

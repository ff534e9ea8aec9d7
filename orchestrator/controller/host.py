"""Controllers hosted in one resident process on the head (`ControllerHost`), a thread each.

A controller started as its own Ray job pays Ray's JobSupervisor actor (a worker process), a
shell and a Python interpreter with its imports: 146 MiB (USS) on the head for each running
job, and 1-4 s before its first step. The queue service starts the jobs it admits here
instead: the host has imported everything once, so a controller is a thread that starts in
milliseconds and costs what its own objects take (about 4 MiB; docs/performance.md).

What a thread cannot have, the host does for it: a stop is asked of the host (`stop`), which
sets the controller's stop event as its SIGTERM handler would; a controller that raised
anyway is recorded FAILED here; and the queue service asks the host which controllers run
(`table`), so one that is gone without recording its end is failed with a cause, as a dead
Ray job's is. The host is a detached actor that Ray does not restart: when its process dies,
so do the agents and placement groups its controllers held, the service fails their jobs, and
the next controller that is a Ray job of its own (a root's first push, or the job the service
starts that way because no host runs) starts a new host (a new `incarnation`), through a
resident Ray job whose driver stays while the host lives (`ensure_host`): Ray starts workers
ahead only for a Ray job that lives (warm_workers.py).
"""

from __future__ import annotations

import functools
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, TextIO

from orchestrator import actor_names, settings
from orchestrator.agents import services
from orchestrator.scheduler.launcher import HostedJob, HostTable, RayJobLauncher

HOST_NAME = actor_names.CONTROLLER_HOST
ENDED_KEPT = 1000  # how many ended controllers the host remembers (the service reads them)


class ControllerHost:
    """Runs `JobController`s in threads; every method returns at once."""

    def __init__(self) -> None:
        self.incarnation = uuid.uuid4().hex
        self.lock = threading.Lock()
        self.threads: dict[str, threading.Thread] = {}
        self.stop_events: dict[str, threading.Event] = {}
        self.ended: dict[str, str | None] = {}  # job id: None, or why it ended without a record
        self.stopped_early: set[str] = set()  # stops of jobs not started (yet)
        threading.Thread(target=self._follow_ray_stops, name="ray-job-stops", daemon=True).start()

    def start(self, job: HostedJob) -> str:
        """Start the job's controller unless this host runs or ran it; the host's incarnation."""
        with self.lock:
            if job.job_id not in self.threads and job.job_id not in self.ended:
                event = self.stop_events[job.job_id] = threading.Event()
                if job.job_id in self.stopped_early:
                    self.stopped_early.discard(job.job_id)
                    event.set()
                thread = threading.Thread(target=self._run, args=(job,),
                                          name=f"controller-{job.job_id}", daemon=True)  # fmt: skip
                self.threads[job.job_id] = thread
                thread.start()
        return self.incarnation

    def stop(self, job_id: str) -> bool:
        """Ask the job's controller to stop (it flushes and records STOPPED); whether it runs.
        A job not started yet starts stopped (the service may be about to start it)."""
        with self.lock:
            event = self.stop_events.get(job_id)
            if event is None and job_id not in self.ended:
                self.stopped_early.add(job_id)
                while len(self.stopped_early) > ENDED_KEPT:
                    self.stopped_early.pop()
        if event is not None:
            event.set()
        return event is not None

    def table(self) -> HostTable:
        """This host's incarnation, the job ids whose controllers run, and those that ended
        (with why, for one that ended without recording its end)."""
        with self.lock:
            return HostTable(self.incarnation, frozenset(self.threads),
                             tuple(self.ended.items()))  # fmt: skip

    def ray_job(self) -> str | None:
        """The Ray job this host belongs to (its resident driver's, when that started it)."""
        import ray

        return ray.get_runtime_context().get_job_id() if ray.is_initialized() else None

    def keep_workers_warm(self) -> None:
        """Its Ray job's driver stays (`--resident`): workers started ahead for the next jobs'
        agents are taken now, not ended with a finished Ray job (warm_workers.py)."""
        from orchestrator.controller import warm_workers

        warm_workers.turn_on()

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

    def _follow_ray_stops(self) -> None:
        """`ray job stop J` of a job run here stops it (ray_stops.py): in Ray, on the head."""
        import ray

        if not ray.is_initialized():
            return  # a host made outside Ray (tests): no dashboard to follow
        try:
            from orchestrator import ray_private
            from orchestrator.controller.ray_stops import follow_stops

            logs = ray_private.job_driver_place()[2]
            # Never closed: it ends with the host's process.
            follow_stops(Path(logs) / "dashboard.log", self._ray_stop, threading.Event())
        except Exception:
            traceback.print_exc()

    def _ray_stop(self, job_id: str) -> None:
        with self.lock:
            running = job_id in self.threads
        if running:
            print(f"job {job_id}: stopped through Ray's Job API (`ray job stop`)", flush=True)
            self.stop(job_id)

    def _run(self, job: HostedJob) -> None:
        from orchestrator.controller.controller import JobController, exit_code
        from orchestrator.controller.queueing import HostedJobQueue
        from orchestrator.storage.job_store import JobStore

        job_id, why = job.job_id, None
        shown = JobRow(job)
        try:
            queue = functools.partial(HostedJobQueue, incarnation=self.incarnation)
            controller = JobController(JobStore(job.storage_root), job_id,
                                       job.scheduling_timeout_s, queue=queue,
                                       echo=shown.log)  # fmt: skip
            with self.lock:  # a stop asked while it was being made is carried over
                if self.stop_events[job_id].is_set():
                    controller.stop_requested.set()
                self.stop_events[job_id] = controller.stop_requested
            state = controller.run()
            history = controller.status.history
            shown.end(state.value, history[-1].reason if history else None,
                      exit_code(controller, state))  # fmt: skip
        except BaseException as e:  # a thread's end: said, never raised further
            traceback.print_exc()
            why = f"the job's controller raised {type(e).__name__}: {e}"
            record_failed(job.storage_root, job_id, why)
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

    def __init__(self, job: HostedJob) -> None:
        self.job_id = job_id = job.job_id
        self.log: TextIO | None = None
        try:
            from orchestrator import ray_private

            agent, node_id, logs = ray_private.job_driver_place()
            self.log = open(Path(logs) / f"job-driver-{job_id}.log", "a", buffering=1)  # noqa: SIM115
            ray_private.put_job_row(job_id, {
                "status": "RUNNING", "entrypoint": job.entrypoint,
                "message": "its controller runs in the controller host (orchestrator-controllers)",
                "start_time": int(time.time() * 1000), "entrypoint_num_cpus": 0,
                "metadata": {**dict(job.metadata), "orchestrator_controller": "hosted"},
                "driver_agent_http_address": agent, "driver_node_id": node_id,
            })  # fmt: skip
        except Exception:
            traceback.print_exc()

    def end(self, state: str, reason: str | None, code: int = 0) -> None:
        """`code`: the exit code the controller's Ray job would have (controller.exit_code): a
        COMPLETED job whose outcome or checkpoints were not all stored is FAILED in Ray's
        table, as that Ray job would be."""
        try:
            from orchestrator import ray_private

            status, said = self.STATES.get(state, "FAILED"), f"{state}: {reason or 'no reason'}"
            if state == "COMPLETED" and code != 0:  # its outcome or checkpoints not all stored
                status, said = "FAILED", f"{said} (not a plain success: exit code {code})"
            ray_private.end_job_row(self.job_id, status, said)
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


def ensure_host() -> None:
    """Start the cluster's controller host on this node (the head) unless it runs or the head
    says controllers are Ray jobs: called by each controller that is a Ray job of its own
    (scheduler/launcher.py lists when one is), so the queue service, which finds the host by
    name and cannot create it (this layer is above its own), has one again after it died.

    The host is started by a Ray job of its own whose driver stays (`python -m
    orchestrator.controller.host --resident`, a RUNNING job in the dashboard): a detached
    actor of a Ray job that has ended gets no workers started ahead (warm_workers.py). When
    that job cannot start the host, the host is started from here, as a detached actor of
    this job, and works without them."""
    if settings.CONTROLLERS.get() != "hosted" or _running_host() is not None:
        return
    try:
        _start_resident()
    except Exception:
        traceback.print_exc()
    if _running_host() is None:
        _make_host(services.this_node_id())


RESIDENT_START_S = 60.0
RESIDENT_ROLE = "controller-host"  # the resident Ray job's metadata `orchestrator_role`
RESIDENT_PREFIX = "orchestrator-controller-host-"


def _make_host(node_id: str) -> Any:
    return services.shared_actor(ControllerHost, HOST_NAME, on_node=node_id, max_concurrency=64)


def _start_resident() -> None:
    """Have the host's resident Ray job run and wait until its host answers.

    Several controllers may ask at once (every Ray-job controller started while no host ran):
    one that finds a resident job not ended waits for its host, and the submission ids are
    numbered (`next_resident_id`), so two that see the same jobs submit one: the Job API
    refuses a second with that id."""
    import shlex
    import sys

    client = RayJobLauncher().client()  # the head's own Job API, as the queue service's
    for _ in range(2):  # a second time if the one waited on ended with its host (it was dying)
        residents = [job for job in client.list_jobs()
                     if (job.metadata or {}).get("orchestrator_role") == RESIDENT_ROLE]  # fmt: skip
        live = [job.submission_id for job in residents if not job.status.is_terminal()]
        submission = live[0] if live else next_resident_id([j.submission_id for j in residents])
        if not live:
            try:
                client.submit_job(
                    submission_id=submission,
                    entrypoint=f"{shlex.quote(sys.executable)} -m orchestrator.controller.host "
                    f"--resident {services.this_node_id()}",
                    entrypoint_num_cpus=0,
                    metadata={"orchestrator_role": RESIDENT_ROLE},
                )  # fmt: skip
            except Exception as e:
                if "already exists" not in str(e):
                    raise
        deadline = time.monotonic() + RESIDENT_START_S
        while time.monotonic() < deadline:
            if _running_host() is not None:
                return
            if client.get_job_status(submission).is_terminal():
                break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"the controller host's Ray job {submission} started no host "
                               f"in {RESIDENT_START_S:g} s")  # fmt: skip
    raise RuntimeError(f"the controller host's Ray job {submission} ended: "
                       f"{client.get_job_info(submission).message}")  # fmt: skip


def next_resident_id(submitted: list[str | None]) -> str:
    """One past the highest number among the resident jobs Ray lists: not their count, which a
    `ray job delete` of an ended one lowers to a number still in use."""
    numbers = [int(tail) for s in submitted if s and s.startswith(RESIDENT_PREFIX)
               if (tail := s.removeprefix(RESIDENT_PREFIX)).isdigit()]  # fmt: skip
    return f"{RESIDENT_PREFIX}{max(numbers, default=0) + 1}"


def resident(node_id: str) -> int:
    """The driver of the host's Ray job: start the host on `node_id` and stay while it lives,
    so that the host's Ray job lives. A host another driver started is left to that one."""
    import ray

    host = _make_host(node_id)
    if ray.get(host.ray_job.remote(), timeout=60) != ray.get_runtime_context().get_job_id():
        print("a controller host runs already, started by another Ray job; nothing to do")
        return 0
    ray.get(host.keep_workers_warm.remote(), timeout=60)
    print("the controller host runs; this Ray job lives as long as it does", flush=True)
    while True:
        try:
            ray.get(host.table.remote(), timeout=60)
        except ray.exceptions.ActorDiedError as e:
            print(f"the controller host is gone ({type(e).__name__}); this Ray job ends")
            return 0
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
            pass  # busy or out of reach for a moment, not gone
        time.sleep(5)


def _running_host() -> Any | None:
    """The cluster's controller host, for a driver connected to it; None when none runs."""
    import ray

    from orchestrator.agents.services import NAMESPACE

    try:
        return ray.get_actor(HOST_NAME, namespace=NAMESPACE)
    except ValueError:
        return None


def stop_controller(job_id: str) -> bool:
    """Stop one hosted controller of the cluster this driver is connected to (`orchestrator
    stop`, through a Ray job: the Job API's authentication, and no storage needed); whether it
    was running."""
    import ray

    host = _running_host()
    return host is not None and bool(ray.get(host.stop.remote(job_id), timeout=60))


def stop_every_controller(timeout_s: float) -> list[str]:
    """Stop the hosted controllers of the cluster this driver is connected to, and wait; the
    job ids still running after `timeout_s`. (`orchestrator cluster stop`, through a Ray job.)"""
    import ray

    host = _running_host()
    if host is None:
        return []
    return list(ray.get(host.stop_all.remote(timeout_s), timeout=timeout_s + 30))


def main(argv: list[str]) -> int:
    """`python -m orchestrator.controller.host --stop JOB_ID | --stop-all TIMEOUT_S |
    --resident NODE_ID`"""
    import argparse

    import ray

    parser = argparse.ArgumentParser(prog="python -m orchestrator.controller.host")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--stop", metavar="JOB_ID")
    what.add_argument("--stop-all", metavar="TIMEOUT_S", type=float)
    what.add_argument("--resident", metavar="NODE_ID")
    args = parser.parse_args(argv)
    ray.init(address="auto", log_to_driver=False)
    if args.resident:
        return resident(args.resident)
    if args.stop:
        running = stop_controller(args.stop)
        print(f"job {args.stop}: " + ("its controller stops" if running else "not running here"))
        return 0
    left = stop_every_controller(args.stop_all)
    print(f"controllers still running: {', '.join(left)}" if left else "every controller ended")
    return 1 if left else 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))

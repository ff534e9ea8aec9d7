"""What a queued job costs the head, against a bare Ray job that waits.

    .venv/bin/python benchmarks/queued_jobs.py [--jobs N] [--bare N] [--run-all]

Starts a private embedded cluster (stopped at the end) and pushes a blocker that holds every CPU
until a gate file appears, so everything pushed after it waits in the queue. Then:

1. baseline, in the same run: `--bare` bare Ray jobs whose entrypoint waits (`python -c
   "...sleep..."`), what a waiting job costs when it is a Ray job (a JobSupervisor and a driver
   process), as every pushed job was before the queue held them; measured, then stopped;
2. `--jobs` pushes (`orchestrator.push`) of a one-line job: the machine's used memory and its
   process count before and after, each push's time, the time until every job is PENDING (the
   queue service took it);
3. `orchestrator queue` over them, a priority change applied (`update_priority`: request,
   the service's tick and decision, the entry rewritten), a stop of a queued job;
4. the queue service's process killed: the time until Ray has started it again and it applies a
   request, and whether every job is still queued, in the same order;
5. with `--run-all`: the gate opened, and every job must end COMPLETED; the time it took
   against the ideal (jobs x `--sleep` seconds / the machine's CPUs, each job taking one CPU).
   `--jobs 40 --sleep 5 --run-all` is the sweep of 40 five-second jobs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil
from common import code_state, private_environment

from orchestrator.client.api import push
from orchestrator.client.jobs import JobHandle
from orchestrator.client.queue import queue, update_priority
from orchestrator.cluster.local import LocalCluster
from orchestrator.lifecycle import JobState

CONFIG = """\
from orchestrator import definitions as d

project = d.TrainingProject(
    name="bench-queued",
    job=d.TrainingJob(
        image=d.Image(base_image="python:3.11"),
        compute=d.Compute(cpu_count={cpus}, memory="64Mi"),
        runtime=d.Runtime(start_commands=[{command!r}]),
    ),
)
"""
GATE_WAIT = (
    "python -c \"import pathlib,time\nwhile not pathlib.Path('{gate}').exists(): time.sleep(0.1)\""
)
MIB = 2**20


def used_memory() -> float:
    """The machine's used memory (what the head pays, on a one-machine cluster), in MiB."""
    return (psutil.virtual_memory().total - psutil.virtual_memory().available) / MIB


def settle(seconds: float = 3.0) -> tuple[float, int]:
    """Memory (MiB) and process count once the machine has been quiet a moment."""
    time.sleep(seconds)
    return used_memory(), len(psutil.pids())


def until(predicate: Callable[[], bool], what: str, timeout: float = 600) -> float:
    """Seconds until `predicate` holds."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"{what}: not after {timeout:g} s")
        time.sleep(0.05)
    return time.monotonic() - started


def job_dir(work: Path, name: str, cpus: int, command: str) -> Path:
    directory = work / name
    directory.mkdir()
    (directory / "config.py").write_text(CONFIG.format(cpus=cpus, command=command))
    return directory / "config.py"


def timed(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def bare_waiting_jobs(address: str, count: int) -> tuple[float, int, float]:
    """Memory (MiB) and processes per waiting bare Ray job, and the median submit time."""
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(address)
    before_mem, before_procs = settle()
    ids, submits = [], []
    for _ in range(count):
        started = time.perf_counter()
        ids.append(
            client.submit_job(
                entrypoint="python -c 'import time; time.sleep(600)'", entrypoint_num_cpus=0
            )
        )
        submits.append(time.perf_counter() - started)
    until(
        lambda: all(str(client.get_job_status(i).value) == "RUNNING" for i in ids),
        "the bare jobs to run",
        120,
    )
    after_mem, after_procs = settle(5.0)
    for job_id in ids:
        client.stop_job(job_id)
    until(
        lambda: all(str(client.get_job_status(i).value) == "STOPPED" for i in ids),
        "the bare jobs to stop",
        120,
    )
    return (
        (after_mem - before_mem) / count,
        (after_procs - before_procs) / count,
        statistics.median(submits),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=200, help="jobs pushed into the queue")
    parser.add_argument("--bare", type=int, default=10, help="waiting bare Ray jobs (baseline)")
    parser.add_argument("--run-all", action="store_true", help="open the gate, run them all")
    parser.add_argument("--sleep", type=float, default=0.0, help="each queued job's seconds")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-queued-"))
    private_environment(work)
    root = str(work / "storage")
    cluster = LocalCluster(state_dir=work / "home" / "local-cluster")
    print(
        f"code {code_state()}; cpus {os.cpu_count()}, memory "
        f"{psutil.virtual_memory().total / 2**30:.1f} GiB, load {os.getloadavg()[0]:.2f}"
    )
    info = None
    try:
        info = cluster.start()
        cpus = int(os.cpu_count() or 2)
        gate = work / "gate"
        blocker = push(
            job_dir(work, "blocker", cpus, GATE_WAIT.format(gate=gate)), storage_root=root
        )
        until(lambda: blocker.status() == JobState.RUNNING, "the blocker to run", 120)

        print_running_overhead(info.dashboard_url, blocker.id)
        bare_mem, bare_procs, bare_submit = bare_waiting_jobs(info.dashboard_url, args.bare)
        print(
            f"\nbaseline: {args.bare} bare Ray jobs waiting: {bare_mem:.1f} MiB and "
            f"{bare_procs:.1f} processes each; submit_job median {bare_submit * 1e3:.1f} ms"
        )

        command = f"sleep {args.sleep:g} && echo ran" if args.sleep else "echo ran"
        config = job_dir(work, "queued", 1, command)
        before_mem, before_procs = settle(10.0)  # the bare jobs' memory given back
        before_service = service_rss(info.gcs_address)
        handles: list[JobHandle] = []
        pushes = []
        for _ in range(args.jobs):
            started = time.perf_counter()
            handles.append(push(config, storage_root=root))
            pushes.append(time.perf_counter() - started)
        taken = until(
            lambda: all(h.status() == JobState.PENDING for h in handles), "every job PENDING"
        )
        after_mem, after_procs = settle(5.0)
        after_service = service_rss(info.gcs_address)
        per_job = (after_mem - before_mem) / args.jobs
        print(
            f"\n{args.jobs} pushed jobs queued: push median {statistics.median(pushes) * 1e3:.1f}"
            f" ms (p90 {statistics.quantiles(pushes, n=10)[-1] * 1e3:.1f} ms); every one PENDING "
            f"{taken:.2f} s after the last push returned"
        )
        print(
            f"  machine memory {before_mem:.0f} -> {after_mem:.0f} MiB: "
            f"{after_mem - before_mem:+.0f} MiB in all, {per_job:+.2f} MiB a job "
            f"({per_job / bare_mem:.3f}x a waiting bare Ray job's)"
        )
        print(
            f"  the queue service's process: {before_service:.0f} -> {after_service:.0f} MiB RSS "
            f"({(after_service - before_service) * 1024 / args.jobs:.1f} KiB a job)"
        )
        print(
            f"  processes {before_procs} -> {after_procs} ({after_procs - before_procs:+d}; a "
            f"waiting bare Ray job: {bare_procs:+.1f} each)"
        )

        listing = [timed(lambda: queue(storage_root=root)) for _ in range(5)]
        rows = queue(storage_root=root)
        print(f"  `queue` over {len(rows)} waiting jobs: median {statistics.median(listing):.3f} s")
        order = [row["job_id"] for row in rows]
        last = handles[-1]
        applied = [
            timed(lambda p=p: update_priority(last.id, p, storage_root=root)) for p in (1, 2, 3)
        ]
        print(
            f"  a priority change applied (request -> tick -> decision -> entry): median "
            f"{statistics.median(applied) * 1e3:.0f} ms"
        )
        stops = [timed(lambda h=h: h.stop(timeout=60)) for h in handles[:3]]
        assert all(h.status() == JobState.STOPPED for h in handles[:3])
        print(
            f"  a queued job stopped (stop() -> STOPPED): median "
            f"{statistics.median(stops) * 1e3:.0f} ms"
        )

        order = [row["job_id"] for row in queue(storage_root=root)]
        restart = restart_service(
            info.gcs_address, lambda: update_priority(last.id, 4, storage_root=root, timeout_s=120)
        )
        kept = [row["job_id"] for row in queue(storage_root=root)]
        print(
            f"  queue service process killed: Ray started it again and it applied a request "
            f"{restart:.2f} s later; the {len(kept)} waiting jobs "
            f"{'kept their order' if kept == order else 'CHANGED ORDER'}"
        )

        if args.run_all:
            gate.touch()
            started = time.monotonic()
            ended = [h.wait(timeout=3600) for h in handles[3:]]
            took = time.monotonic() - started
            done = sum(state == JobState.COMPLETED for state in ended)
            ideal = len(ended) * args.sleep / cpus
            against = f" ({took / ideal:.2f}x the ideal {ideal:g} s)" if ideal else ""
            print(f"\ngate opened: {done} of {len(ended)} COMPLETED in {took:.1f} s{against}")
            print_phases([h.details().history for h in handles[3:]], args.sleep)
        print_host_overhead(info.dashboard_url)
        print(f"\nload average at the end {os.getloadavg()[0]:.2f}")
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
        if info is not None and info.temp_dir:  # Ray's session files
            shutil.rmtree(info.temp_dir, ignore_errors=True)


def print_phases(histories: list, sleep_s: float) -> None:
    """Where a slot's time goes beyond the jobs' own seconds, medians over the jobs: admitted
    (DEPLOYING) after the job before it on the slot ended; its node agent started and prepared
    (DEPLOYING to RUNNING); RUNNING to COMPLETED beyond its sleep."""
    at = [{e.state: e.at for e in history} for history in histories]
    ends = sorted(a[JobState.COMPLETED] for a in at if JobState.COMPLETED in a)
    deploys = sorted(a[JobState.DEPLOYING] for a in at if JobState.DEPLOYING in a)
    # The k-th admission after the first wave follows the k-th end.
    first = len(deploys) - len([d for d in deploys if d > ends[0]]) if ends else 0
    handoff = [d - e for d, e in zip(deploys[first:], ends, strict=False)]
    prepare = [a[JobState.RUNNING] - a[JobState.DEPLOYING] for a in at if JobState.RUNNING in a]
    beyond = [a[JobState.COMPLETED] - a[JobState.RUNNING] - sleep_s for a in at
              if JobState.COMPLETED in a and JobState.RUNNING in a]  # fmt: skip
    for name, values in (("a job's end to the next admission", handoff),
                         ("DEPLOYING to RUNNING", prepare),
                         ("RUNNING to COMPLETED beyond the sleep", beyond)):  # fmt: skip
        if values:
            print(f"  {name}: median {statistics.median(values):.3f} s, max {max(values):.3f} s")


def print_running_overhead(address: str, job_id: str) -> None:
    """The processes a running job's control costs the head: its controller (the Ray job's
    driver) and what Ray runs above it for the Ray job, up to the raylet, with their memory."""
    from ray.job_submission import JobSubmissionClient

    pid = JobSubmissionClient(address).get_job_info(job_id).driver_info.pid
    proc = psutil.Process(int(pid))
    chain = []
    while proc is not None and "raylet" not in proc.name():
        chain.append(proc)
        proc = proc.parent()
    total_rss = total_uss = 0.0
    print("\na running job's control processes on the head (RSS / USS, MiB):")
    for p in chain:
        info = p.memory_full_info()
        total_rss, total_uss = total_rss + info.rss / MIB, total_uss + info.uss / MIB
        title = " ".join(p.cmdline())[:70]
        print(f"  {p.pid:>7} {info.rss / MIB:7.1f} {info.uss / MIB:7.1f}  {title}")
    print(f"  in all: {total_rss:.0f} MiB RSS, {total_uss:.0f} MiB USS (not shared)")


def print_host_overhead(address: str) -> None:
    """The controller host's resident Ray job (its supervisor and driver; once per cluster,
    not per job: controller/host.py), if one runs."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    from orchestrator.controller.host import RESIDENT_ROLE

    for job in JobSubmissionClient(address).list_jobs():
        if (job.metadata or {}).get("orchestrator_role") == RESIDENT_ROLE and (
            job.status == JobStatus.RUNNING
        ):
            print("\nthe controller host's resident Ray job, once per cluster:", end="")
            print_running_overhead(address, job.submission_id)


def service_pid(gcs_address: str) -> int:
    import ray

    from orchestrator.agents.services import NAMESPACE
    from orchestrator.scheduler import QUEUE_SERVICE_NAME

    ray.init(address=gcs_address, namespace=NAMESPACE, log_to_driver=False)
    try:
        service = ray.get_actor(QUEUE_SERVICE_NAME, namespace=NAMESPACE)
        return int(ray.get(service.__ray_call__.remote(lambda self: os.getpid())))
    finally:
        ray.shutdown()


def service_rss(gcs_address: str) -> float:
    """The queue service process's resident memory, MiB."""
    return psutil.Process(service_pid(gcs_address)).memory_info().rss / MIB


def restart_service(gcs_address: str, applied: Callable[[], object]) -> float:
    """Kill the queue service's process (Ray restarts it); seconds until `applied` succeeds."""

    pid = service_pid(gcs_address)
    started = time.monotonic()
    psutil.Process(pid).kill()
    applied()
    return time.monotonic() - started


if __name__ == "__main__":
    sys.exit(main())

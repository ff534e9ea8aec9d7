"""Submit to first log line: a bare Ray Job API submission against `orchestrator.push`.

    .venv/bin/python benchmarks/push_first_line.py [--runs N] [--poll S] [--hold S] [--probes N]

Starts a private local Ray cluster (stopped at the end), warms each path once, then runs N
alternating rounds of the same one-line script through:

- `ray (working_dir)`: `JobSubmissionClient.submit_job("python first_line.py",
  runtime_env={"working_dir": ...})`, what `ray job submit --working-dir . -- python ...` does;
  polls `get_job_logs`.
- `ray (abs path)`: the same with `python /abs/first_line.py` and no runtime_env at all.
- `orchestrator`: `push(config.py)` whose start_command is `python first_line.py`; polls
  `job.logs()`.

Each latency runs from just before the submit call to the first poll that shows the line, so
the poll interval (`--poll`, 20 ms) bounds the resolution. The script prints its own clock in
that line, which splits each latency into "printed" and "seen". Every job is waited for before
the next starts. Afterwards a probe Ray job repeats the controller's start-up steps one by one
(interpreter, imports, `ray.init`, placement group, NodeAgent actor) to show what each costs,
once with the job-level runtime_env `push` sends and once without.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from common import code_state, private_environment

from orchestrator.client.api import push
from orchestrator.cluster.local import LocalCluster, LocalClusterInfo
from orchestrator.lifecycle import JobState
from orchestrator.storage import layout
from orchestrator.storage.root import StorageRoot

MARKER = "FIRST-LINE"
SCRIPT = f"""\
import time
print(f"{MARKER} {{time.time():.6f}}", flush=True)
import sys
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""
CONFIG = """\
from orchestrator import definitions as d

project = d.TrainingProject(
    name="bench-first-line",
    job=d.TrainingJob(
        image=d.Image(base_image="python:3.11"),
        compute=d.Compute(cpu_count=1, memory="512Mi"),
        runtime=d.Runtime(
            start_commands=[{command!r}],
            checkpointing_config=d.CheckpointingConfig(enabled={checkpointing}),
        ),
    ),
)
"""
LINE_RE = re.compile(rf"{MARKER} (\d+\.\d+)")
TIMEOUT_S = 120.0
RAY_TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}

BARE_WORKDIR = "ray (working_dir)"
BARE_ABS = "ray (abs path)"
ORCHESTRATOR = "orchestrator"
PATHS = (BARE_WORKDIR, BARE_ABS, ORCHESTRATOR)
CONTROLLER_UP = "controller up"  # not a state: when the first log segment was written

# The controller's start-up, step by step, submitted as a Ray job as `push` submits it.
PROBE = """\
import json, sys, time
t_start = time.time()
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
import orchestrator.controller.controller
from orchestrator.agents.node_agent import TERMINAL_GROUP, TERMINAL_THREADS, NodeAgent
t_imported = time.time()
ray.init(address="auto", namespace="bench-first-line", log_to_driver=False)
t_connected = time.time()
pg = placement_group([{"CPU": 1, "memory": 512 * 2**20}], strategy="PACK")
ray.get(pg.ready())
t_placed = time.time()
agent = ray.remote(concurrency_groups={TERMINAL_GROUP: TERMINAL_THREADS})(NodeAgent).options(
    num_cpus=1, memory=512 * 2**20,
    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
).remote("probe", 0, sys.argv[1])
ray.get(agent.node_info.remote())
t_agent = time.time()
ray.kill(agent)
remove_placement_group(pg)
print("PROBE", json.dumps([t_start, t_imported, t_connected, t_placed, t_agent]))
"""
PROBE_STEPS = (
    "Ray job start -> interpreter up",
    "import ray + orchestrator",
    "ray.init(address=auto)",
    "placement group ready",
    "NodeAgent actor: start + first call",
)
# `push` used to send a job-level runtime_env (env_vars only); any job-level runtime_env keeps
# the job's actors off Ray's idle pooled workers. The probe keeps measuring both.
WITH_RUNTIME_ENV = {"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "60"}}
PROBE_VARIANTS = {"a job runtime_env (env_vars)": WITH_RUNTIME_ENV, "no job runtime_env": None}


@dataclass
class Sample:
    """One job: wall-clock times (time.time()) of what happened to it."""

    path: str
    submitted: float  # just before submit_job / push
    returned: float  # submit_job / push returned
    printed: float  # the script's own clock, in its first line
    seen: float  # the first poll that showed the line
    states: dict[str, float] = field(default_factory=dict)  # orchestrator: state -> entered at

    @property
    def latency(self) -> float:
        return self.seen - self.submitted


def wait_for_line(read: Callable[[], str], poll: float, what: str) -> tuple[float, float]:
    """Poll `read` until the marker line shows: (when it was seen, the clock it printed)."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        match = LINE_RE.search(read())
        if match:
            return time.time(), float(match.group(1))
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: no first line after {TIMEOUT_S:g} s")
        time.sleep(poll)


class Bench:
    """The three paths on one cluster, sharing one job directory and one storage root."""

    def __init__(
        self, info: LocalClusterInfo, work: Path, poll: float, hold: float, checkpointing: bool
    ) -> None:
        from ray.job_submission import JobSubmissionClient

        self.client = JobSubmissionClient(info.dashboard_url)
        self.poll = poll
        self.job_dir = work / "job"
        self.job_dir.mkdir()
        (self.job_dir / "first_line.py").write_text(SCRIPT)
        args = f" {hold:g}" if hold else ""
        self.command = f"python first_line.py{args}"
        self.abs_command = f"python {self.job_dir / 'first_line.py'}{args}"
        self.config = self.job_dir / "config.py"
        self.config.write_text(CONFIG.format(command=self.command, checkpointing=checkpointing))
        self.storage_root = str(work / "storage")

    def run(self, path: str) -> Sample:
        if path == ORCHESTRATOR:
            return self.orchestrator()
        if path == BARE_WORKDIR:
            return self.bare(self.command, {"working_dir": str(self.job_dir)})
        return self.bare(self.abs_command, None)

    def bare(self, entrypoint: str, runtime_env: dict[str, str] | None) -> Sample:
        path = BARE_WORKDIR if runtime_env else BARE_ABS
        submitted = time.time()
        job_id = self.client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env)
        returned = time.time()
        seen, printed = wait_for_line(lambda: self.client.get_job_logs(job_id), self.poll, path)
        deadline = time.monotonic() + TIMEOUT_S
        while (status := str(self.client.get_job_status(job_id).value)) not in RAY_TERMINAL:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path}: job {job_id} still {status}")
            time.sleep(0.1)
        if status != "SUCCEEDED":
            raise RuntimeError(f"{path}: job {job_id} ended {status}")
        return Sample(path, submitted, returned, printed, seen)

    def orchestrator(self) -> Sample:
        submitted = time.time()
        job = push(self.config, storage_root=self.storage_root)
        returned = time.time()
        seen, printed = wait_for_line(
            lambda: "\n".join(job.logs()), self.poll, f"{ORCHESTRATOR} job {job.id}"
        )
        final = job.wait(timeout=TIMEOUT_S)
        if final != JobState.COMPLETED:
            raise RuntimeError(f"orchestrator: job {job.id} ended {final.value}: {job.logs()}")
        states = {event.state.value: event.at for event in job.details().history}
        states[CONTROLLER_UP] = min(self.first_segment_written(job.id), states["DEPLOYING"])
        return Sample(ORCHESTRATOR, submitted, returned, printed, seen, states)

    def first_segment_written(self, job_id: str) -> float:
        """When the controller's first log line landed: it says it once it is connected."""
        path = StorageRoot(self.storage_root).path(layout.log_segment(job_id, 0))
        return os.stat(path).st_mtime

    def probe(self, runtime_env: dict[str, dict[str, str]] | None) -> list[float]:
        """Seconds per PROBE_STEPS of one PROBE job."""
        script = self.job_dir.parent / "probe.py"
        script.write_text(PROBE)
        submitted = time.time()
        job_id = self.client.submit_job(
            entrypoint=f"python {script} {self.storage_root}",
            runtime_env=runtime_env,
            entrypoint_num_cpus=0,
        )
        deadline = time.monotonic() + TIMEOUT_S
        while (status := str(self.client.get_job_status(job_id).value)) not in RAY_TERMINAL:
            if time.monotonic() > deadline:
                raise TimeoutError(f"probe job {job_id} still {status}")
            time.sleep(0.1)
        logs = self.client.get_job_logs(job_id)
        found = re.search(r"^PROBE (\[.*\])$", logs, re.MULTILINE)
        if status != "SUCCEEDED" or not found:
            raise RuntimeError(f"probe job {job_id} ended {status}:\n{logs}")
        times = [submitted, *json.loads(found.group(1))]
        return [b - a for a, b in itertools.pairwise(times)]


# --- report -------------------------------------------------------------------------------


def med(values: list[float]) -> float:
    return statistics.median(values)


def orchestrator_breakdown(s: Sample) -> list[tuple[str, float]]:
    """Consecutive steps of one orchestrator job, in seconds (they sum to its latency)."""
    created, up, deploying, running = (
        s.states[k] for k in ("CREATED", CONTROLLER_UP, "DEPLOYING", "RUNNING")
    )
    return [
        ("push: load config, archive, store record (-> CREATED)", created - s.submitted),
        ("push: queue entry (CREATED -> push returned)", s.returned - created),
        ("the controller starts (hosted: a thread) (-> 1st log line)", up - s.returned),
        ("placement group (1st log line -> DEPLOYING)", deploying - up),
        ("NodeAgent actor start + prepare (DEPLOYING -> RUNNING)", running - deploying),
        ("RUNNING -> script printed its line", s.printed - running),
        ("printed -> line seen in job.logs()", s.seen - s.printed),
    ]


def bare_breakdown(s: Sample) -> list[tuple[str, float]]:
    return [
        ("submit_job call", s.returned - s.submitted),
        ("submit_job returned -> script printed its line", s.printed - s.returned),
        ("printed -> line seen in get_job_logs()", s.seen - s.printed),
    ]


def print_rows(title: str, rows: list[list[tuple[str, float]]]) -> None:
    """One line per step: median and min over the runs."""
    print(f"\n{title}")
    width = max(len(name) for name, _ in rows[0])
    print(f"  {'step':<{width}}  {'median':>7}  {'min':>7}")
    for i, (name, _) in enumerate(rows[0]):
        values = [row[i][1] for row in rows]
        print(f"  {name:<{width}}  {med(values):7.3f}  {min(values):7.3f}")


def report(samples: list[Sample], probes: dict[str, list[list[float]]], poll: float) -> None:
    by_path = {p: [s for s in samples if s.path == p] for p in PATHS}
    print(f"\nsubmit -> first line seen, seconds over {len(by_path[ORCHESTRATOR])} runs")
    print(f"(polling every {poll * 1000:.0f} ms: each 'seen' is up to that much late)")
    print(f"  {'path':<18}  {'median':>7}  {'min':>7}  {'max':>7}  {'printed (median)':>16}")
    for path, runs in by_path.items():
        lat = [s.latency for s in runs]
        printed = med([s.printed - s.submitted for s in runs])
        print(f"  {path:<18}  {med(lat):7.3f}  {min(lat):7.3f}  {max(lat):7.3f}  {printed:16.3f}")
    orch = [s.latency for s in by_path[ORCHESTRATOR]]
    for base in (BARE_WORKDIR, BARE_ABS):
        bare = [s.latency for s in by_path[base]]
        print(
            f"  orchestrator vs {base}: ratio {med(orch) / med(bare):.2f}x (median), "
            f"{min(orch) / min(bare):.2f}x (min); overhead {med(orch) - med(bare):+.3f} s "
            f"(median), {min(orch) - min(bare):+.3f} s (min)"
        )
    print_rows(
        "orchestrator breakdown (from the job's status history), seconds",
        [orchestrator_breakdown(s) for s in by_path[ORCHESTRATOR]],
    )
    for base in (BARE_WORKDIR, BARE_ABS):
        print_rows(f"{base} breakdown, seconds", [bare_breakdown(s) for s in by_path[base]])
    for variant, runs in probes.items():
        if runs:
            print_rows(
                f"controller start-up replayed step by step, {variant}, seconds",
                [list(zip(PROBE_STEPS, p, strict=True)) for p in runs],
            )


def print_runs(samples: list[Sample]) -> None:
    print("\nruns (seconds from submit):  path, submit returned, printed, seen")
    for s in samples:
        print(
            f"  {s.path:<18} {s.returned - s.submitted:6.3f} {s.printed - s.submitted:6.3f} "
            f"{s.latency:6.3f}"
        )


# --- main ---------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="measured rounds (default 5)")
    parser.add_argument("--poll", type=float, default=0.02, help="log poll interval, seconds")
    parser.add_argument(
        "--hold", type=float, default=0.0, help="the script sleeps this long after its line"
    )
    parser.add_argument(
        "--probes", type=int, default=3, help="controller start-up replays per variant"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp dirs")
    parser.add_argument(
        "--checkpointing",
        action="store_true",
        help="the pushed job enables checkpointing (its uploader watches before the command)",
    )
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-first-line-"))
    private_environment(work)  # `push` finds the private cluster through ORCHESTRATOR_HOME
    cluster = LocalCluster(state_dir=work / "home" / "local-cluster")
    info: LocalClusterInfo | None = None
    print(f"code {code_state()}; cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}")
    try:
        started = time.monotonic()
        info = cluster.start()
        print(f"local cluster {info.dashboard_url} up in {time.monotonic() - started:.1f} s")
        bench = Bench(info, work, args.poll, args.hold, args.checkpointing)
        for path in PATHS:
            s = bench.run(path)
            print(f"warm-up {path:<18} {s.latency:6.3f} s")
        samples: list[Sample] = []
        for i in range(args.runs):
            order = PATHS if i % 2 == 0 else tuple(reversed(PATHS))
            samples += [bench.run(path) for path in order]
        probes: dict[str, list[list[float]]] = {v: [] for v in PROBE_VARIANTS}
        for _ in range(args.probes):
            for variant, runtime_env in PROBE_VARIANTS.items():
                probes[variant].append(bench.probe(runtime_env))
        print_runs(samples)
        report(samples, probes, args.poll)
        print(f"\nload average at the end {os.getloadavg()[0]:.2f}")
    finally:
        cluster.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
            if info is not None and info.temp_dir:
                shutil.rmtree(info.temp_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

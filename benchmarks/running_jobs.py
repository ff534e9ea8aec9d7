"""What a running job's control costs: controllers in the controller host against Ray jobs.

    .venv/bin/python benchmarks/running_jobs.py [--jobs N] [--cpus N]

For each mode, `ray-job` (the baseline: each admitted job's controller its own Ray job, a
JobSupervisor and an interpreter) then `hosted` (threads of the head's controller host), a
private embedded cluster with `--cpus` logical CPUs is started (stopped at the end), and:

1. one warm-up job (a root's first push has a Ray-job controller in both modes: it starts the
   queue service), waited for;
2. `--jobs` jobs of one CPU each, whose command waits for a gate file, pushed at once; the
   time from each push to RUNNING and to its command's first line;
3. once all run: the machine's used memory and processes against before the pushes, and the
   USS (memory not shared) of the processes that control them on the head: JobSupervisors,
   controllers, the controller host (its growth), apart from what runs on the node for each
   (node agents, the commands), which both modes share;
4. the gate opened: the time until every job is COMPLETED, and the machine's busy CPU-seconds
   from the first push to the last completion (from /proc/stat), per job.

Run it on an otherwise idle machine: the CPU-seconds are the machine's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
from common import code_state

from orchestrator.client.api import push
from orchestrator.cluster.local import LocalCluster, embedded_env
from orchestrator.lifecycle import JobState

CONFIG = """\
from orchestrator import definitions as d

project = d.TrainingProject(
    name="bench-running",
    job=d.TrainingJob(
        image=d.Image(base_image="python:3.11"),
        compute=d.Compute(cpu_count=1, memory="64Mi"),
        runtime=d.Runtime(start_commands=[{command!r}]),
    ),
)
"""
GATE_WAIT = (
    "python -c \"import pathlib,time\nprint('up', flush=True)\n"
    "while not pathlib.Path('{gate}').exists(): time.sleep(0.1)\""
)
MIB = 2**20
CONTROL = ("JobSupervisor", "orchestrator.controller", "ControllerHost")


def busy_cpu_s() -> float:
    """The machine's busy CPU-seconds so far (all cores), from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def control_uss() -> tuple[float, int]:
    """The USS (MiB) and count of the head's processes that control jobs."""
    total, count = 0.0, 0
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        if any(mark in line for mark in CONTROL):
            try:
                total += proc.memory_full_info().uss / MIB
                count += 1
            except psutil.Error:
                pass
    return total, count


def used_memory() -> float:
    memory = psutil.virtual_memory()
    return (memory.total - memory.available) / MIB


def wait(predicate, what: str, timeout: float = 600) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def run_mode(mode: str, jobs: int, cpus: int) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(prefix=f"bench-running-{mode}-"))
    os.environ.update(ORCHESTRATOR_HOME=str(work / "home"), ORCHESTRATOR_CONTROLLERS=mode,
                      ORCHESTRATOR_NODE_ROOT=str(work / "nodes"))  # fmt: skip
    os.environ.update(embedded_env())  # the token file of that home
    root = str(work / "storage")
    cluster = LocalCluster(state_dir=work / "home" / "local-cluster")
    try:
        cluster.start(num_cpus=cpus)
        gate = work / "gate"
        configs = []
        for name in ("warm", "job"):
            (work / name).mkdir()
            command = "echo warm" if name == "warm" else GATE_WAIT.format(gate=gate)
            (work / name / "config.py").write_text(CONFIG.format(command=command))
            configs.append(work / name / "config.py")
        assert push(configs[0], storage_root=root).wait(timeout=300) == JobState.COMPLETED
        time.sleep(5)
        before_mem, before_procs = used_memory(), len(psutil.pids())
        before_uss, _ = control_uss()
        cpu_start = busy_cpu_s()
        pushed_at, handles = [], []
        for _ in range(jobs):
            pushed_at.append(time.time())
            handles.append(push(configs[1], storage_root=root))
        wait(lambda: all(any(line.endswith("] up") for line in h.logs()) for h in handles),
             "every job's first line")  # fmt: skip
        time.sleep(3)
        after_mem, after_procs = used_memory(), len(psutil.pids())
        after_uss, control_procs = control_uss()
        to_running = [
            next(e.at for e in h.details().history if e.state == JobState.RUNNING) - at
            for h, at in zip(handles, pushed_at, strict=True)
        ]
        gate.touch()
        opened = time.monotonic()
        ended = [h.wait(timeout=600) for h in handles]
        assert all(state == JobState.COMPLETED for state in ended), ended
        return {
            "push -> RUNNING, median (s)": statistics.median(to_running),
            "push -> RUNNING, max (s)": max(to_running),
            "machine memory per running job (MiB)": (after_mem - before_mem) / jobs,
            "processes per running job": (after_procs - before_procs) / jobs,
            "control USS per running job (MiB)": (after_uss - before_uss) / jobs,
            "control processes while they ran": control_procs,
            "gate -> all COMPLETED (s)": time.monotonic() - opened,
            "busy CPU-s per job, push to end": (busy_cpu_s() - cpu_start) / jobs,
        }
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10, help="jobs running at once (default 10)")
    parser.add_argument("--cpus", type=int, default=16, help="the cluster's logical CPUs")
    args = parser.parse_args()
    os.environ.pop("RAY_ADDRESS", None)
    print(f"code {code_state()}; {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; "
          f"{args.jobs} jobs running at once")  # fmt: skip
    results = {mode: run_mode(mode, args.jobs, args.cpus) for mode in ("ray-job", "hosted")}
    print(f"\n{'measure':<42} {'ray-job':>10} {'hosted':>10} {'ratio':>7}")
    for key, base in results["ray-job"].items():
        hosted = results["hosted"][key]
        ratio = f"{hosted / base:.2f}x" if base else "-"
        print(f"{key:<42} {base:>10.2f} {hosted:>10.2f} {ratio:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

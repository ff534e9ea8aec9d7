"""`max_duration` on the embedded cluster (controller/time_limit.py): a checkpointing job that
would run forever gets SIGTERM within a second of its limit, counted from the queue's admission,
its last checkpoint (saved on SIGTERM) is stored and it ends FAILED `max_duration 8s reached`;
a job queued behind it for longer than its own limit still gets all of it once admitted."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from conftest import make_job
from ray.util.state import list_nodes

from orchestrator.client.api import push
from orchestrator.client.jobs import JobHandle
from orchestrator.lifecycle import JobState

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("ray_cluster")]

JOB = """
from orchestrator import definitions as d
project = d.TrainingProject(
    name="time-limit",
    job=d.TrainingJob(
        image=d.Image(base_image="python:3.11"),
        name="{name}",
        compute=d.Compute(cpu_count={cpus}, memory="512Mi"),
        runtime=d.Runtime(
            start_commands=["python train.py"],
            checkpointing_config=d.CheckpointingConfig(enabled=True),
        ),
        max_duration={limit!r},
    ),
)
"""

# A trainer that saves a checkpoint every 0.5 s, forever, and once more on SIGTERM.
TRAIN = """
import os, pathlib, signal, time

ROOT = pathlib.Path(os.environ["BT_CHECKPOINT_DIR"])
stop, saved = [], [0]


def save():
    saved[0] += 1
    name = f"checkpoint-{saved[0]}"
    tmp = ROOT / f".{name}.partial"
    tmp.mkdir(parents=True)
    (tmp / "state.txt").write_text(f"step {saved[0]}\\n")
    tmp.rename(ROOT / name)
    return name


def on_term(signum, frame):
    print(f"SIGTERM at {time.time():.3f}", flush=True)
    stop.append(signum)


signal.signal(signal.SIGTERM, on_term)
print(f"started at {time.time():.3f}", flush=True)
while not stop:
    save()
    until = time.time() + 0.5
    while not stop and time.time() < until:
        time.sleep(0.02)
print(f"saved {save()} on SIGTERM", flush=True)
"""


def stamp(logs: list[str], what: str) -> float:
    found = [float(m.group(1)) for line in logs if (m := re.search(rf"{what} at ([\d.]+)", line))]
    assert found, f"no line says {what!r}: {logs}"
    return found[-1]


def limited(directory: Path, name: str, cpus: int, limit: str) -> Path:
    body = JOB.format(name=name, cpus=cpus, limit=limit)
    return make_job(directory, body, {"train.py": TRAIN})


def wait_running(job: JobHandle, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while job.status() != JobState.RUNNING:
        assert not job.status().is_terminal, job.logs()
        assert time.monotonic() < deadline, f"still {job.status().value}"
        time.sleep(0.1)


def test_a_job_over_its_limit_is_stopped_in_time_and_a_queued_jobs_wait_is_not_counted(
    tmp_path, storage_root, ray_cluster
):
    cpus = int(max(n.resources_total.get("CPU", 0) for n in
                   list_nodes(address=ray_cluster.dashboard_url, detail=True)))  # fmt: skip
    first = push(limited(tmp_path / "first", "first", cpus, "8s"), storage_root=storage_root)
    wait_running(first)
    # Every CPU is the first job's: the second waits in the queue, longer than its own limit.
    second = push(limited(tmp_path / "second", "second", cpus, "3s"), storage_root=storage_root)

    assert first.wait(timeout=90) == JobState.FAILED, first.logs()
    status, logs = first.details(), first.logs()
    assert status.failure.cause.startswith("max_duration 8s reached (held its nodes 8"), logs
    assert [a.cause for a in status.attempts] == ["max_duration"]
    (held,) = status.holds
    limit_at = held.since + 8
    late = stamp(logs, "SIGTERM") - limit_at
    assert 0 <= late < 1.0, (late, logs)
    saved = next(line.split("saved ")[1].split()[0] for line in logs if "on SIGTERM" in line)
    assert saved in {m.name for m in first.checkpoints()}, logs  # flushed before FAILED
    failed_after = status.history[-1].at - limit_at

    assert second.wait(timeout=90) == JobState.FAILED, second.logs()
    status, logs = second.details(), second.logs()
    (held,) = status.holds
    queued = held.since - status.history[0].at
    assert queued > 3, status.history  # queued past its limit
    assert stamp(logs, "started") > held.since  # and then ran
    late_2 = stamp(logs, "SIGTERM") - (held.since + 3)
    assert 0 <= late_2 < 1.0, (late_2, logs)
    assert re.match(r"max_duration 3s reached \(held its nodes 3(\.\d)?s; [\d.ms ]+ queued, not "
                    r"counted\)", status.failure.cause), status.failure.cause  # fmt: skip
    print(f"SIGTERM {late:.2f} s and {late_2:.2f} s after the limit; the first job FAILED "
          f"{failed_after:.1f} s after it, its checkpoints stored; the second queued "
          f"{queued:.1f} s: {status.failure.cause}")  # fmt: skip

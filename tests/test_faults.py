"""Jobs that survive faults, on a simulated GPU cluster with a spare node.

Each worker raylet has its own node root (its "local disk"): a replacement node starts with
nothing of the job, so what a retried rank finds in $BT_CHECKPOINT_DIR came from the storage
root. A node is lost with `Cluster.remove_node`; a preemption is a drain with
DRAIN_NODE_REASON_PREEMPTION and a deadline, then the node's removal, as a cloud does it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import psutil
import pytest
from conftest import eventually, make_job, simulated_cluster
from ray.cluster_utils import Cluster
from ray.util.state import list_actors, list_placement_groups

from orchestrator.agents.weight_cache import NODE_CACHE_DIR_ENV
from orchestrator.client.api import get_job, push
from orchestrator.client.jobs import JobHandle
from orchestrator.client.overrides import Overrides
from orchestrator.lifecycle import JobState

pytestmark = pytest.mark.cluster  # starts Ray itself (a simulated or local cluster)

REPO = Path(__file__).resolve().parents[1]

# A trainer that resumes from the newest checkpoint in $BT_CHECKPOINT_DIR, saves one per step
# (renamed into place) and, on SIGTERM, saves the step it is in the way Hugging Face's Trainer
# writes: the directory made first and filled file by file, then marked complete. (Its exit
# code cannot say so: the stop's SIGTERM ends the `sh -c` around it, whose 143 is reported.)
TRAIN = """
import os, pathlib, signal, sys, time
from orchestrator import mark_checkpoint_complete
rank, attempt = os.environ["BT_NODE_RANK"], os.environ["BT_RETRY_COUNT"]
ck = pathlib.Path(os.environ["BT_CHECKPOINT_DIR"])
steps, step_s = int(sys.argv[1]), float(sys.argv[2])
marker = pathlib.Path("unpacked-for-attempt")  # gone if the workspace is unpacked again
if not marker.exists():
    marker.write_text(attempt)
done = [int(p.name.split("-")[1]) for p in ck.glob("checkpoint-*") if (p / "state").exists()]
start = max(done, default=0)
print(f"attempt {attempt} pid {os.getpid()} unpacked for {marker.read_text()} "
      f"resumes at {start}", flush=True)
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
for step in range(start + 1, steps + 1):
    until = time.time() + step_s
    while time.time() < until and not stop:
        time.sleep(0.05)
    if stop:
        saved = ck / f"checkpoint-{step}"
        saved.mkdir()
        for part in ("model", "optimizer"):
            (saved / part).write_bytes(os.urandom(1 << 16))
            time.sleep(0.3)
        (saved / "state").write_text(str(step))
        mark_checkpoint_complete(saved)
        print(f"SIGTERM: saved checkpoint-{step}", flush=True)
        sys.exit(0)
    tmp = ck / f".tmp-{step}"
    tmp.mkdir()
    (tmp / "state").write_text(str(step))
    os.rename(tmp, ck / f"checkpoint-{step}")
    print(f"step {step}", flush=True)
print("done", flush=True)
"""


class FaultCluster:
    def __init__(self, cluster: Cluster, dashboard_url: str, disks: Path) -> None:
        self.cluster, self.dashboard_url, self.disks = cluster, dashboard_url, disks
        self.added = 0

    def add_worker(self) -> None:
        disk = self.disks / f"node-{self.added}"
        self.added += 1
        env = {"ORCHESTRATOR_NODE_ROOT": str(disk / "root"), NODE_CACHE_DIR_ENV: str(disk / "w")}
        self.cluster.add_node(num_cpus=2, num_gpus=2, resources={"accelerator_type:H100": 1},
                              env_vars=env)  # fmt: skip
        self.cluster.wait_for_nodes()

    def node(self, node_id: str):
        return next(n for n in self.cluster.worker_nodes if n.node_id == node_id)

    def ensure_workers(self, count: int) -> None:
        while len(self.cluster.worker_nodes) < count:
            self.add_worker()


@pytest.fixture(scope="module")
def faults(orchestrator_home, s3_server, tmp_path_factory) -> Iterator[FaultCluster]:
    cluster, dashboard_url = simulated_cluster()
    try:
        fc = FaultCluster(cluster, dashboard_url, tmp_path_factory.mktemp("disks"))
        fc.ensure_workers(3)  # a 2-node job and a spare
        yield fc
    finally:
        cluster.shutdown()


def two_node_job(directory: Path, script: str, args: str, weights: str = "[]") -> Path:
    """A 2-node job with checkpointing that runs `python train.py <args>` (`script`)."""
    return make_job(
        directory,
        f"""
        from truss_train import definitions
        project = definitions.TrainingProject(
            name="faults",
            job=definitions.TrainingJob(
                image=definitions.Image(base_image="pytorch/pytorch:2.7.1"),
                compute=definitions.Compute(
                    node_count=2, cpu_count=1, memory="512Mi", accelerator="H100:2"
                ),
                runtime=definitions.Runtime(
                    start_commands=["python train.py {args}"],
                    checkpointing_config=definitions.CheckpointingConfig(enabled=True),
                ),
                weights={weights},
            ),
        )
        """,
        {"train.py": script},
    )


def gang(directory: Path, steps: int, step_s: float, weights: str = "[]") -> Path:
    return two_node_job(directory, TRAIN, f"{steps} {step_s}", weights)


def lines_of(job: JobHandle, rank: int) -> list[str]:
    prefix = f"[rank {rank} "
    return [line.split("] ", 1)[1] for line in job.logs() if line.startswith(prefix)]


def stored(job: JobHandle, rank: int) -> set[str]:
    return {m.name for m in job.checkpoints() if m.node_rank == rank and m.complete}


def pids(job: JobHandle) -> set[int]:
    return {int(line.split("pid ")[1].split()[0]) for r in (0, 1) for line in lines_of(job, r)
            if " pid " in line}  # fmt: skip


def assert_nothing_left(job: JobHandle, fc: FaultCluster) -> None:
    """No process of any attempt, no actor and no placement group of the job."""
    eventually(lambda: not [p for p in pids(job) if psutil.pid_exists(p)
                            and psutil.Process(p).status() != "zombie"],
               "every attempt's processes to be gone")  # fmt: skip

    def leftovers() -> list[str]:
        actors = list_actors(address=fc.dashboard_url, filters=[("state", "!=", "DEAD")])
        groups = list_placement_groups(address=fc.dashboard_url)
        return [a.name for a in actors if job.id in (a.name or "")] + [
            g.name for g in groups if job.id in g.name and g.state != "REMOVED"
        ]

    eventually(lambda: not leftovers(), "the job's actors and placement group to be gone")


def test_a_lost_node_is_replaced_and_the_job_resumes_from_its_checkpoint(
    tmp_path, storage_root, faults
):
    faults.ensure_workers(3)
    bucket = f"faults-{uuid.uuid4().hex[:8]}"
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir(bucket)
    fs.pipe(f"{bucket}/model/w.bin", b"weights")
    weights = (
        f"[definitions.WeightsSource(source='s3://{bucket}/model', "
        f"mount_location='{tmp_path / 'mnt'}')]"
    )
    config = gang(tmp_path / "job", steps=7, step_s=1.0, weights=weights)
    job = push(config, address=faults.dashboard_url, storage_root=storage_root, retries=1)
    eventually(lambda: {"checkpoint-2"} <= stored(job, 1), "rank 1's second checkpoint", 90)
    lost = job.details().nodes[1].node_id
    faults.cluster.remove_node(faults.node(lost))

    assert job.wait(timeout=150) == JobState.COMPLETED, "\n".join(job.logs()[-40:])
    status = job.details()
    first, second = status.attempts
    assert (first.cause, first.rank, first.node_id) == ("node_lost", 1, lost)
    assert first.decision == "retried: retry 1 of 1"
    assert second.decision == "completed" and second.resumed_from is not None
    resumed = int(second.resumed_from.split("-")[1])
    assert resumed >= 2
    # The replacement node had nothing of the job: its rank resumed from the restored copy.
    assert status.nodes[1].node_id != lost and status.nodes[1].prepared_for == 1
    # Every rank resumes from the newest checkpoint both stored (rank 0's newer one, which
    # rank 1 never stored, is set aside).
    rank1 = [line for line in lines_of(job, 1) if line.startswith("attempt 1 ")]
    rank0 = [line for line in lines_of(job, 0) if line.startswith("attempt 1 ")]
    assert rank1[0].endswith(f"resumes at {resumed}"), rank1
    assert rank0[0].endswith(f"resumes at {resumed}"), rank0
    # The survivor kept its unpacked code, and got its weights once.
    assert "unpacked for 0" in rank0[0] and status.nodes[0].prepared_for == 0
    # Rank 1's restored copy was not uploaded again: its version is still the first.
    restored = next(
        m for m in job.checkpoints() if m.node_rank == 1 and m.name == second.resumed_from
    )
    assert restored.version == 1
    deliveries = sorted(d.rank for d in status.weights[0].nodes)
    assert deliveries == [0, 1, 1], deliveries  # rank 1's first node, then its replacement
    assert any("==== attempt 1 (BT_RETRY_COUNT=1) ====" in line for line in job.logs())
    assert {f"checkpoint-{i}" for i in range(1, 8)} <= stored(job, 1)
    assert_nothing_left(job, faults)


def test_a_crashed_node_costs_one_retry_and_its_rank_runs_on_another_node(
    tmp_path, storage_root, faults
):
    """A node that crashes (its processes killed, no goodbye to the GCS) looks alive to Ray
    until its health checks fail: the job waits for that verdict, never blames the agent and
    never places the replacement on the dead node, so one lost node costs one retry."""
    faults.ensure_workers(3)
    config = gang(tmp_path / "job", steps=6, step_s=1.0)
    job = push(config, address=faults.dashboard_url, storage_root=storage_root, retries=1)
    eventually(lambda: {"checkpoint-2"} <= stored(job, 0), "rank 0's second checkpoint", 90)
    crashed = job.details().nodes[0].node_id  # the leader's node
    faults.cluster.remove_node(faults.node(crashed), allow_graceful=False)

    assert job.wait(timeout=150) == JobState.COMPLETED, "\n".join(job.logs()[-40:])
    status = job.details()
    first, second = status.attempts
    assert (first.cause, first.rank, first.node_id) == ("node_lost", 0, crashed), first
    assert "was lost" in first.reason and "lives" not in first.reason, first.reason
    assert first.decision == "retried: retry 1 of 1"
    assert second.decision == "completed" and second.resumed_from is not None
    assert status.nodes[0].node_id != crashed and status.nodes[0].prepared_for == 1
    resumed = second.resumed_from.split("-")[1]
    rank0 = [line for line in lines_of(job, 0) if line.startswith("attempt 1 ")]
    assert rank0[0].endswith(f"resumes at {resumed}"), rank0
    assert {f"checkpoint-{i}" for i in range(1, 7)} <= stored(job, 1)
    assert_nothing_left(job, faults)


def test_a_preempted_node_saves_on_sigterm_and_the_job_resumes_on_another(
    tmp_path, storage_root, faults
):
    faults.ensure_workers(3)
    config = gang(tmp_path / "job", steps=6, step_s=1.5)
    job = push(config, address=faults.dashboard_url, storage_root=storage_root)  # retries 0
    eventually(lambda: {"checkpoint-2"} <= stored(job, 1), "rank 1's second checkpoint", 90)
    preempted = job.details().nodes[1].node_id
    ray = Path(sys.executable).parent / "ray"
    subprocess.run(
        [str(ray), "drain-node", "--address", faults.cluster.address, "--node-id", preempted,
         "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot capacity reclaimed",
         "--deadline-remaining-seconds", "30"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip

    def waiting_for_the_node() -> bool:
        history = get_job(job.id, storage_root=storage_root).refresh().history
        return any("waiting for preempted node" in (e.reason or "") for e in history)

    eventually(waiting_for_the_node, "the job to wait for the preempted node to go", 60)
    saved = [line for line in lines_of(job, 1) if line.startswith("SIGTERM: saved")]
    assert saved, lines_of(job, 1)
    name = saved[0].rsplit(" ", 1)[1]
    assert name in stored(job, 1)  # uploaded within the notice
    faults.cluster.remove_node(faults.node(preempted))  # the deadline: the cloud takes it

    assert job.wait(timeout=150) == JobState.COMPLETED, "\n".join(job.logs()[-40:])
    first, second = job.details().attempts
    assert (first.cause, first.rank, first.node_id) == ("preempted", 1, preempted)
    assert second.resumed_from == name  # the checkpoint saved on SIGTERM
    rank1 = [line for line in lines_of(job, 1) if line.startswith("attempt 1 ")]
    assert rank1[0].endswith(f"resumes at {name.split('-')[1]}"), rank1
    assert job.details().nodes[1].node_id != preempted
    assert_nothing_left(job, faults)


def test_a_killed_node_agent_is_started_again_on_its_own_node(tmp_path, storage_root, faults):
    faults.ensure_workers(2)
    config = gang(tmp_path / "job", steps=5, step_s=1.0)
    job = push(config, address=faults.dashboard_url, storage_root=storage_root, retries=1)
    eventually(lambda: {"checkpoint-2"} <= stored(job, 0), "rank 0's second checkpoint", 90)
    node = job.details().nodes[0].node_id
    agent = next(
        a for a in list_actors(address=faults.dashboard_url, filters=[("state", "=", "ALIVE")])
        if a.name == f"orchestrator-{job.id}-rank-0"
    )  # fmt: skip
    os.kill(agent.pid, signal.SIGKILL)

    assert job.wait(timeout=120) == JobState.COMPLETED, "\n".join(job.logs()[-40:])
    first, second = job.details().attempts
    assert (first.cause, first.rank, first.node_id) == ("agent_lost", 0, node)
    assert job.details().nodes[0].node_id == node  # the same node, prepared again
    assert job.details().nodes[0].prepared_for == 1
    resumed = second.resumed_from
    rank0 = [line for line in lines_of(job, 0) if line.startswith("attempt 1 ")]
    assert resumed and rank0[0].endswith(f"resumes at {resumed.split('-')[1]}"), rank0
    # Its checkpoints, there before the retry, are still this job's: stored, not "earlier".
    summary = job.details().checkpoints
    assert summary.all_uploaded and not [e for e in summary.entries if e.state == "earlier_job"]
    assert {f"checkpoint-{i}" for i in range(1, 6)} <= stored(job, 0)
    assert_nothing_left(job, faults)


FAILING = """
from truss_train import definitions
project = definitions.TrainingProject(
    name="faults",
    job=definitions.TrainingJob(
        image=definitions.Image(base_image="python:3.11"),
        compute=definitions.Compute(cpu_count=1, memory="256Mi", accelerator="H100:1"),
        runtime=definitions.Runtime(start_commands=["echo attempt $BT_RETRY_COUNT && exit 3"]),
    ),
)
"""


def push_cli(config: Path, storage_root: str, faults: FaultCluster, *flags: str,
             delay_s: str = "0.2") -> JobHandle:  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator", "push", str(config), *flags,
         "--address", faults.dashboard_url, "--storage-root", storage_root, "-o", "json"],
        check=True, capture_output=True, text=True, timeout=120,
        env={**os.environ, "ORCHESTRATOR_RETRY_DELAY_S": delay_s},
    )  # fmt: skip
    return get_job(json.loads(out.stdout)["training_job"]["id"], storage_root=storage_root)


def test_a_failing_command_with_retries_runs_three_attempts_then_fails(tmp_path, faults):
    """Through the CLI: --retries alone does not retry a failed command; with
    --retry-on-failure it runs three attempts."""
    config = make_job(tmp_path / "job", FAILING)
    storage_root = str(tmp_path / "storage")
    once = push_cli(config, storage_root, faults, "--retries", "2")
    assert once.wait(timeout=120) == JobState.FAILED
    assert lines_of(once, 0) == ["attempt 0"] and len(once.details().attempts) == 1
    assert "not retried without retry_on_failure" in once.details().failure.cause

    job = push_cli(config, storage_root, faults, "--retries", "2", "--retry-on-failure")
    assert job.wait(timeout=120) == JobState.FAILED, "\n".join(job.logs()[-30:])
    assert lines_of(job, 0) == ["attempt 0", "attempt 1", "attempt 2"]
    failure = job.details().failure
    assert [c.split(":")[0] for c in failure.attempts] == ["attempt 0", "attempt 1", "attempt 2"]
    assert all("command exited with code 3" in c for c in failure.attempts)
    assert "retries spent (2 of 2)" in failure.cause
    assert job.record.retry.retries == 2 and job.record.retry.retry_on_failure
    assert_nothing_left(job, faults)


def test_a_stop_while_waiting_to_retry_ends_the_job_stopped(tmp_path, faults):
    config = make_job(tmp_path / "job", FAILING)
    storage_root = str(tmp_path / "storage")
    job = push_cli(config, storage_root, faults, "--retries", "1", "--retry-on-failure",
                   delay_s="120")  # fmt: skip

    def waiting() -> bool:
        return any("retrying in 120 s" in line for line in job.logs())

    eventually(waiting, "the wait before the retry", 60)
    assert job.refresh().state == JobState.PENDING
    assert job.stop() == JobState.STOPPED
    assert lines_of(job, 0) == ["attempt 0"]
    assert [e.state for e in job.details().history][-2:] == [JobState.PENDING, JobState.STOPPED]
    assert_nothing_left(job, faults)


def test_the_ddp_recipe_loses_a_node_and_ends_with_the_uninterrupted_accuracy(storage_root, faults):
    """The multinode DDP recipe trains on two nodes to the single-node recipe's accuracy; with
    a node removed mid-training it resumes on another node from rank 0's checkpoint and
    reaches exactly the accuracy of the uninterrupted run."""
    faults.ensure_workers(3)
    config = REPO / "recipes" / "multinode-ddp" / "config.py"
    run = Overrides(entrypoint="bash ./run.sh --epochs 40 --checkpoint-every 5")

    def final_accuracy(job: JobHandle) -> str:
        final = [line for line in lines_of(job, 0) if "final test accuracy" in line]
        assert len(final) == 1, "\n".join(job.logs()[-30:])
        return final[0].rsplit(" ", 1)[1]

    whole = push(config, address=faults.dashboard_url, storage_root=storage_root, overrides=run)
    assert whole.wait(timeout=300) == JobState.COMPLETED, "\n".join(whole.logs()[-30:])
    assert float(final_accuracy(whole)) >= 0.9  # the single-node recipe's accuracy
    assert len({n.node_id for n in whole.details().nodes}) == 2

    job = push(config, address=faults.dashboard_url, storage_root=storage_root, overrides=run,
               retries=1)  # fmt: skip
    eventually(lambda: any(m.name == "checkpoint-10" for m in job.checkpoints()),
               "rank 0's checkpoint at epoch 10", 240)  # fmt: skip
    workers = {n.node_id for n in faults.cluster.worker_nodes}
    lost = next(n for n in job.details().nodes if n.node_id in workers)  # not the head's
    # It crashes (no goodbye to the GCS): its peer's collective breaks at once, while the GCS
    # still calls the node alive; the peer's failure is the lost node's fault all the same.
    faults.cluster.remove_node(faults.node(lost.node_id), allow_graceful=False)

    assert job.wait(timeout=300) == JobState.COMPLETED, "\n".join(job.logs()[-40:])
    first, second = job.details().attempts
    assert (first.cause, first.rank) == ("node_lost", lost.rank), first
    assert second.resumed_from is not None
    assert any(line.startswith("resumed from") for line in lines_of(job, 0)), lines_of(job, 0)
    assert final_accuracy(job) == final_accuracy(whole)
    # Only rank 0 saves: the copy of its checkpoint restored on rank 1 is not stored as rank 1's.
    assert {m.node_rank for m in job.checkpoints()} == {0}
    assert any(e.state == "restored" for e in job.details().checkpoints.entries)
    assert_nothing_left(job, faults)

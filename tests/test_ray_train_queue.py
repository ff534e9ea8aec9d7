"""Ray Train jobs in the queue (issue 54), on a simulated GPU cluster as tests/test_faults.py's
(three worker nodes of 2 H100 each, every node with a disk of its own), two teams with quotas,
one storage root (one queue) for the module.

A Train job's workers run in the job's own placement group, so what the queue admitted (its
nodes, its team's quota) is what they use: another team's job never lands on them, and a second
Train job of the team waits at the quota. A Train job borrowing idle capacity gives way to
another team's job within its quota, and resumes from the newest checkpoint Train committed.
A Train-reported checkpoint is loaded by a later job through `load_checkpoint_config`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import test_faults
from conftest import SIMULATED_SYSTEM_CONFIG, eventually, make_job
from ray._private.utils import write_ray_address
from ray.cluster_utils import Cluster

from orchestrator.agents.weight_cache import NODE_CACHE_DIR_ENV
from orchestrator.client.api import push
from orchestrator.client.jobs import JobHandle
from orchestrator.client.queue import capacity, queue, set_capacity
from orchestrator.cluster.local import CLUSTER_ENV, use_embedded_env
from orchestrator.cluster.ray_start import free_ports
from orchestrator.lifecycle import JobState

pytestmark = pytest.mark.cluster  # starts Ray itself (a simulated cluster)


class PrivateFaultCluster(test_faults.FaultCluster):
    """tests/test_faults.py's simulated cluster (workers of 2 CPUs, 2 H100, a disk each) whose
    Ray keeps its files in a directory of its own, where it also writes its address. A Ray
    job's supervisor hands the job (a storage root's first controller) the address it finds
    in the head's temp dir, else any Ray instance running on the machine: with the default
    /tmp/ray, that of whichever Ray cluster another process of this machine started last."""

    def __init__(self, cluster, dashboard_url: str, disks: Path, temp_dir: str) -> None:
        super().__init__(cluster, dashboard_url, disks)
        self.temp_dir = temp_dir

    def add_worker(self) -> None:
        disk = self.disks / f"node-{self.added}"
        self.added += 1
        env = {"ORCHESTRATOR_NODE_ROOT": str(disk / "root"), NODE_CACHE_DIR_ENV: str(disk / "w")}
        self.cluster.add_node(num_cpus=2, num_gpus=2, resources={"accelerator_type:H100": 1},
                              env_vars=env, temp_dir=self.temp_dir)  # fmt: skip
        self.cluster.wait_for_nodes()


@pytest.fixture(scope="module")
def faults(orchestrator_home, s3_server, tmp_path_factory) -> Iterator[PrivateFaultCluster]:
    """Three 2-GPU workers and a 1-CPU head (conftest's `simulated_cluster`, its own temp dir)."""
    use_embedded_env()
    os.environ.update({**CLUSTER_ENV, "ORCHESTRATOR_PYTHON": sys.executable})
    temp_dir = tempfile.mkdtemp(prefix="rtq-", dir="/tmp")  # short: Ray's sockets live there
    port, gcs, agent, metrics = free_ports(4)
    head = {"num_cpus": 1, "include_dashboard": True, "dashboard_host": "127.0.0.1",
            "dashboard_port": port, "gcs_server_port": gcs, "dashboard_agent_listen_port": agent,
            "metrics_export_port": metrics, "temp_dir": temp_dir,
            "_system_config": SIMULATED_SYSTEM_CONFIG}  # fmt: skip
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        write_ray_address(cluster.gcs_address, temp_dir)
        fc = PrivateFaultCluster(cluster, f"http://127.0.0.1:{port}",
                                 tmp_path_factory.mktemp("disks"), temp_dir)  # fmt: skip
        fc.ensure_workers(3)
        yield fc
    finally:
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def storage_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One storage root (one queue) for the module: its first push starts a controller of its
    own, as a Ray job, which starts the queue service; the later jobs' controllers are threads
    of the controller host."""
    return str(tmp_path_factory.mktemp("storage"))


# Every worker writes where it runs (its placement group, node, resources, GPUs) for the attempt,
# then trains: it resumes from `ray.train.get_checkpoint()` (rank 0's step beside its own
# shard), reports a checkpoint per step, and, given a gate, waits for it before it returns.
# Attempt 0 runs `steps` steps; a later attempt two more steps from where it resumed.
TRAIN = """
import json, os, pathlib, sys, tempfile, time
import ray, ray.train
from ray.train import Checkpoint, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

def loop(config):
    rank = ray.train.get_context().get_world_rank()
    runtime = ray.get_runtime_context()
    record = {"group": runtime.get_placement_group_id(), "node": runtime.get_node_id(),
              "resources": runtime.get_assigned_resources(),
              "gpus": [str(g) for g in ray.get_gpu_ids()]}
    out = pathlib.Path(config["out"])
    (out / f"attempt-{config['attempt']}-rank-{rank}.json").write_text(json.dumps(record))
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            start = json.loads(pathlib.Path(d, "model.json").read_text())["step"] + 1
            shard = pathlib.Path(d, f"shard-{rank}.txt").read_text()
        print(f"worker {rank} resumes at {start} with shard {shard}", flush=True)
    else:
        print(f"worker {rank} starts at 0", flush=True)
    end = config["steps"] if config["attempt"] == 0 else start + 2
    for step in range(start, end):
        time.sleep(config["step_s"])
        with tempfile.TemporaryDirectory() as tmp:
            if rank == 0:
                pathlib.Path(tmp, "model.json").write_text(json.dumps({"step": step}))
            pathlib.Path(tmp, f"shard-{rank}.txt").write_text(f"{rank}@{step}")
            ray.train.report({"step": step}, checkpoint=Checkpoint.from_directory(tmp))
        print(f"worker {rank} step {step}", flush=True)
    while config["gate"] and not os.path.exists(config["gate"]):
        time.sleep(0.2)

steps, step_s, out, gate = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
ray.init()
result = TorchTrainer(
    loop, torch_config=TorchConfig(backend="gloo"),
    train_loop_config={"steps": steps, "step_s": step_s, "out": out,
                       "gate": gate if gate != "-" else None,
                       "attempt": int(os.environ["BT_RETRY_COUNT"])},
    scaling_config=ScalingConfig(num_workers=2, use_gpu=True),
    run_config=RunConfig(name="queued"),
).fit()
# One write: Ray's forwarded worker lines share the pipe, and split a print of two parts.
print(f"trained: {result.error}", flush=True)
"""

WAIT_FOR_GATE = (
    "python -c \"import pathlib,time\nwhile not pathlib.Path('{gate}').exists(): time.sleep(0.2)\""
)


def job_config(directory: Path, command: str, *, team: str, nodes: int = 2, train: bool = False,
               checkpoints: bool = False, load: str | None = None) -> Path:  # fmt: skip
    """A job of `team` on `nodes` nodes of 2 H100; `train`: a Ray Train job, one worker a node,
    whose start command is `command` (`python train.py ...`); `load`: a checkpoint reference."""
    loading = (
        f"load_checkpoint_config=d.LoadCheckpointConfig(enabled=True, checkpoints=[{load}]),"
        if load
        else ""
    )
    return make_job(
        directory,
        f"""
        from truss_train import definitions as d
        project = d.TrainingProject(
            name="train-queue", team_name={team!r},
            job=d.TrainingJob(
                image=d.Image(base_image="pytorch/pytorch:2.7.1"),
                compute=d.Compute(node_count={nodes}, cpu_count=1, memory="512Mi",
                                  accelerator="H100:2"),
                runtime=d.Runtime(
                    start_commands=[{command!r}],
                    checkpointing_config=d.CheckpointingConfig(enabled={checkpoints}),
                    environment_variables={{"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}},
                    {loading}
                ),
                ray_train={"d.RayTrain(workers_per_node=1)" if train else None},
            ),
        )
        """,
        {"train.py": TRAIN} if train else None,
    )


def train_command(out: Path, steps: int, step_s: float, gate: Path | None = None) -> str:
    out.mkdir(parents=True, exist_ok=True)
    return f"python train.py {steps} {step_s} {out} {gate or '-'}"


@contextlib.contextmanager
def driver(fc: PrivateFaultCluster) -> Iterator[None]:
    """This process as a driver of the simulated cluster, to read its placement groups."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
        ray.init(address=fc.cluster.address, namespace="train-queue-test", log_to_driver=False)
        try:
            yield
        finally:
            ray.shutdown()


def group_of(job: JobHandle) -> dict:
    """The job's placement group as `ray.util.placement_group_table` has it."""
    (group,) = [g for g in ray.util.placement_group_table().values()
                if g["name"] == f"orchestrator-{job.id}"]  # fmt: skip
    return group


def whole(job: JobHandle) -> list[str]:
    """The checkpoints both nodes stored complete, oldest first."""
    return sorted(test_faults.stored(job, 0) & test_faults.stored(job, 1))


def said(job: JobHandle, tail: int = 80) -> str:
    return f"({job.status()}):\n" + "\n".join(job.logs()[-tail:])


def test_a_train_jobs_workers_use_what_the_queue_admitted_and_count_in_its_teams_quota(
    tmp_path, storage_root, faults
):
    faults.ensure_workers(3)
    set_capacity("vision", gpus={"H100": 4}, storage_root=storage_root)  # 2 nodes
    set_capacity("nlp", gpus={"H100": 2}, storage_root=storage_root)  # 1 node
    gate, out = tmp_path / "gate", tmp_path / "out"
    train = push(job_config(tmp_path / "train", train_command(out, 0, 0, gate), team="vision",
                            train=True),
                 address=faults.dashboard_url, storage_root=storage_root)  # fmt: skip
    others: list[JobHandle] = []
    try:
        records = [out / f"attempt-0-rank-{r}.json" for r in (0, 1)]
        try:
            eventually(lambda: all(p.exists() for p in records), "both Train workers", 150)
        except AssertionError as e:
            raise AssertionError(f"{e} {said(train)}") from None
        nlp = push(job_config(tmp_path / "nlp", WAIT_FOR_GATE.format(gate=gate), team="nlp",
                              nodes=1),
                   address=faults.dashboard_url, storage_root=storage_root)  # fmt: skip
        others.append(nlp)
        eventually(lambda: nlp.status() == JobState.RUNNING, "nlp's job to run", 90)
        second = push(job_config(tmp_path / "second", train_command(tmp_path / "out2", 0, 0),
                                 team="vision", train=True),
                      address=faults.dashboard_url, storage_root=storage_root)  # fmt: skip
        others.append(second)

        # The second Train job of vision waits at the quota the first one's workers fill, and
        # no node is idle to lend (nlp's job holds the third).
        at_quota = (
            "team vision is at its quota of 4 H100 (4 in use) and the cluster has no idle "
            "capacity to lend: needs 2 nodes with 2 H100, 1 CPU, 512.0 MiB memory free: 0 such "
            "nodes free"
        )

        def waiting_row() -> dict | None:
            return next((r for r in queue(storage_root=storage_root)
                         if r["job_id"] == second.id), None)  # fmt: skip

        eventually(lambda: (waiting_row() or {}).get("position") == 1, "the second to queue", 60)
        row = waiting_row()
        assert (row["state"], row["team"]) == ("queued", "vision"), row
        assert at_quota in row["reason"], row
        eventually(lambda: second.status() == JobState.PENDING, "the second's record PENDING", 30)
        assert at_quota in (second.details().history[-1].reason or "")
        use = capacity(storage_root=storage_root)["teams"]
        assert use["vision"]["in_use"]["GPU:H100"] == 4 and use["vision"]["jobs_running"] == 1
        assert use["vision"]["jobs_queued"] == 1 and use["nlp"]["in_use"]["GPU:H100"] == 2

        nodes = {n.rank: n.node_id for n in train.details().nodes}
        runs = [json.loads(p.read_text()) for p in records]
        with driver(faults):
            group, theirs = group_of(train), group_of(nlp)
            assert not [g for g in ray.util.placement_group_table().values()
                        if g["name"] == f"orchestrator-{second.id}"]  # fmt: skip
        # Worker i in bundle i of the job's group, on node rank i (one worker a node).
        assert group["state"] == "CREATED"
        assert group["bundles_to_node_id"] == {0: nodes[0], 1: nodes[1]}, (group, nodes)
        assert [run["group"] for run in runs] == [group["placement_group_id"]] * 2, runs
        assert [run["node"] for run in runs] == [nodes[0], nodes[1]], (runs, nodes)
        for run in runs:  # one GPU of its node's share each
            assert run["resources"] == {"GPU": 1.0} and len(run["gpus"]) == 1, run
        # nlp's job on the third node, in a group of its own: no node or bundle of vision's.
        (theirs_node,) = theirs["bundles_to_node_id"].values()
        assert theirs_node not in nodes.values() and nlp.details().nodes[0].node_id == theirs_node
        assert theirs["placement_group_id"] != group["placement_group_id"]

        assert second.stop(timeout=60) == JobState.STOPPED  # it reserved nothing
    finally:
        gate.touch()
        for handle in others:
            if handle.status() in (JobState.PENDING, JobState.DEPLOYING):
                handle.stop(timeout=60)
    assert train.wait(timeout=120) == JobState.COMPLETED, said(train)
    assert nlp.wait(timeout=60) == JobState.COMPLETED, said(nlp)
    assert "trained: None" in "\n".join(train.logs())


def test_a_borrowing_train_job_gives_way_to_another_teams_job_and_resumes_from_its_checkpoint(
    tmp_path, storage_root, faults
):
    faults.ensure_workers(3)
    set_capacity("vision", gpus={"H100": 2}, storage_root=storage_root)  # 1 node: it borrows
    set_capacity("nlp", gpus={"H100": 4}, storage_root=storage_root)  # 2 nodes
    out = tmp_path / "out"
    train = push(job_config(tmp_path / "train", train_command(out, 1000, 0.7), team="vision",
                            train=True, checkpoints=True),
                 address=faults.dashboard_url, storage_root=storage_root)  # fmt: skip
    try:
        eventually(lambda: len(whole(train)) >= 2, "two checkpoints stored whole", 150)
    except AssertionError as e:
        raise AssertionError(f"{e} {said(train)}") from None
    assert any("borrowed" in line for line in train.logs()), said(train)
    before = whole(train)
    owner = push(job_config(tmp_path / "owner", "sleep 1", team="nlp"),
                 address=faults.dashboard_url, storage_root=storage_root)  # fmt: skip
    assert owner.wait(timeout=150) == JobState.COMPLETED, said(owner)
    assert train.wait(timeout=180) == JobState.COMPLETED, said(train)

    details = train.details()
    first, second = details.attempts
    assert first.cause == "preempted_by_job", first
    assert first.reason.startswith(f"preempted by {owner.id}: borrowed capacity"), first.reason
    assert second.cause is None and second.resumed_from is not None, second
    assert second.resumed_from.startswith("checkpoint_"), second
    assert second.resumed_from in whole(train)  # every node's part of it stored
    assert set(before) <= set(whole(train)), (before, whole(train))  # kept through the preemption
    text = "\n".join(train.logs())
    resumed = {int(r): (int(s), shard) for r, s, shard
               in re.findall(r"worker (\d) resumes at (\d+) with shard (\S+)", text)}  # fmt: skip
    assert sorted(resumed) == [0, 1], text
    (start,) = {s for s, _ in resumed.values()}
    assert start > 0, resumed
    assert resumed == {r: (start, f"{r}@{start - 1}") for r in (0, 1)}, resumed
    assert f"worker 0 step {start + 1}" in text and "trained: None" in text, text
    # The resumed attempt ran in the job's group again, on the nodes admitted for it.
    nodes = {n.rank: n.node_id for n in details.nodes}
    again = [json.loads((out / f"attempt-1-rank-{r}.json").read_text()) for r in (0, 1)]
    assert [run["node"] for run in again] == [nodes[0], nodes[1]], (again, nodes)
    assert any("[checkpoints] attempt 1 resumes from checkpoint_" in line for line in
               train.logs()), text  # fmt: skip
    # It came back only after the job it gave way to had started.
    running = [e.at for e in details.history if e.state == JobState.RUNNING]
    owner_ran = next(e.at for e in owner.details().history if e.state == JobState.RUNNING)
    assert len(running) == 2 and running[1] >= owner_ran, details.history


def test_a_later_job_loads_a_train_checkpoint_with_rank_0s_files(tmp_path, storage_root, faults):
    faults.ensure_workers(3)
    train = push(job_config(tmp_path / "train", train_command(tmp_path / "out", 2, 0.6),
                            team="vision", train=True, checkpoints=True),
                 address=faults.dashboard_url, storage_root=storage_root)  # fmt: skip
    assert train.wait(timeout=180) == JobState.COMPLETED, said(train)
    committed = [r.checkpoint for run in train.metrics().train_reports for r in run.reports
                 if r.checkpoint]  # fmt: skip
    assert len(committed) == 2, committed
    latest = committed[-1]
    assert latest in whole(train), (latest, whole(train))

    show = ('sh -c \'cd "$BT_LOAD_CHECKPOINT_DIR" && find . -type f | sort '
            '&& cat rank-0/*/model.json && echo\'')  # fmt: skip
    loader = push(
        job_config(tmp_path / "loader", show, team="vision", nodes=1,
                   load=f"d.BasetenCheckpoint.from_latest_checkpoint(job_id={train.id!r})"),
        address=faults.dashboard_url, storage_root=storage_root,
    )  # fmt: skip
    assert loader.wait(timeout=120) == JobState.COMPLETED, said(loader)
    lines = [line.split("] ", 1)[1] for line in loader.logs() if line.startswith("[rank 0 ")]
    assert f"./rank-0/{latest}/model.json" in lines, lines
    assert f"./rank-0/{latest}/shard-0.txt" in lines, lines
    assert f"./rank-1/{latest}/shard-1.txt" in lines, lines  # every rank's part, on every node
    assert '{"step": 1}' in lines, lines  # rank 0's model at the last step

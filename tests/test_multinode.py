"""Gang jobs on a simulated GPU cluster: a head and three worker raylets on this machine.

Each worker declares 2 GPUs and `accelerator_type:H100`, as a real H100 node does; Ray sets
CUDA_VISIBLE_DEVICES from the declared GPUs though none exist.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import psutil
import pytest
import ray
from conftest import make_job, simulated_cluster
from ray.cluster_utils import Cluster
from test_cli_checkpoints import cli

from orchestrator.agents.messages import Group
from orchestrator.agents.rendezvous import Rendezvous
from orchestrator.agents.training_cache_seeder import NODE_TRAINING_CACHE_DIR_ENV
from orchestrator.agents.weight_cache import CLUSTER_CACHE_DIR_ENV, NODE_CACHE_DIR_ENV
from orchestrator.client.api import push
from orchestrator.client.jobs import JobHandle
from orchestrator.lifecycle import JobState
from orchestrator.storage.metrics import RankMetrics, read_job_metrics
from orchestrator.storage.root import StorageRoot

pytestmark = pytest.mark.cluster  # starts Ray itself (a simulated or local cluster)

MiB = 2**20

WORKERS = 3


class GpuCluster:
    """Workers with a weights cache each (their "local disk") and one shared cluster cache."""

    def __init__(self, cluster: Cluster, dashboard_url: str, disks: Path) -> None:
        self.cluster, self.dashboard_url, self.disks = cluster, dashboard_url, disks
        self.cluster_cache = disks / "shared-cluster-cache"

    def add_worker(self):
        disk = self.disks / f"node-{len(self.cluster.worker_nodes)}"
        env = {
            NODE_CACHE_DIR_ENV: str(disk / "weights"),
            CLUSTER_CACHE_DIR_ENV: str(self.cluster_cache),
            NODE_TRAINING_CACHE_DIR_ENV: str(disk / "training-cache"),
        }
        node = self.cluster.add_node(num_cpus=2, num_gpus=2, resources={"accelerator_type:H100": 1},
                                     env_vars=env)  # fmt: skip
        self.cluster.wait_for_nodes()
        return node

    def node(self, node_id: str):
        return next(n for n in self.cluster.worker_nodes if n.node_id == node_id)


@pytest.fixture(scope="module")
def gpu_cluster(orchestrator_home, s3_server, tmp_path_factory) -> Iterator[GpuCluster]:
    cluster, dashboard_url = simulated_cluster()
    try:
        disks = tmp_path_factory.mktemp("node-disks")
        gpus = GpuCluster(cluster, dashboard_url, disks)
        for _ in range(WORKERS):
            gpus.add_worker()
        yield gpus
    finally:
        cluster.shutdown()


def gang_job(directory: Path, command: str, files: dict[str, str] | None = None,
             nodes: int = 2, accelerator: str = "H100:2", weights: str = "[]",
             project: str = "gang", cache: str = "None") -> Path:  # fmt: skip
    return make_job(
        directory,
        f"""
        from truss_train import definitions
        project = definitions.TrainingProject(
            name={project!r},
            job=definitions.TrainingJob(
                image=definitions.Image(base_image="nvcr.io/nvidia/pytorch:25.01-py3"),
                compute=definitions.Compute(
                    node_count={nodes}, cpu_count=1, memory="512Mi", accelerator="{accelerator}"
                ),
                runtime=definitions.Runtime(start_commands=[{command!r}], cache_config={cache}),
                weights={weights},
            ),
        )
        """,
        files,
    )


def lines_of(job: JobHandle, rank: int) -> list[str]:
    prefix = f"[rank {rank} "
    return [line.split("] ", 1)[1] for line in job.logs() if line.startswith(prefix)]


def wait_for_lines(job: JobHandle, count_per_rank: dict[int, int], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while any(len(lines_of(job, r)) < n for r, n in count_per_rank.items()):
        assert time.monotonic() < deadline, job.logs()
        assert not job.status().is_terminal, job.logs()
        time.sleep(0.2)


SHOW_ENV = """
import json, os
keys = ["BT_GROUP_SIZE", "BT_NODE_RANK", "BT_LEADER_ADDR", "BT_NUM_GPUS", "MASTER_ADDR",
        "MASTER_PORT", "NNODES", "NODE_RANK", "NPROC_PER_NODE", "CUDA_VISIBLE_DEVICES",
        "BT_TRAINING_JOB_ID"]
print(json.dumps({k: os.environ.get(k) for k in keys}))
"""


def test_ranks_on_distinct_nodes_with_the_env_contract(tmp_path, storage_root, gpu_cluster):
    config = gang_job(tmp_path / "job", "python show_env.py", {"show_env.py": SHOW_ENV})
    job = push(config, address=gpu_cluster.dashboard_url, storage_root=storage_root)
    assert job.wait(timeout=120) == JobState.COMPLETED, job.logs()
    nodes = job.details().nodes
    assert [n.rank for n in nodes] == [0, 1]
    assert len({n.node_id for n in nodes}) == 2, "each rank must have its own node"
    envs = {r: json.loads(lines_of(job, r)[0]) for r in (0, 1)}
    for rank, env in envs.items():
        assert env["BT_NODE_RANK"] == env["NODE_RANK"] == str(rank)
        assert env["BT_GROUP_SIZE"] == env["NNODES"] == "2"
        assert env["BT_NUM_GPUS"] == env["NPROC_PER_NODE"] == "2"
        assert env["BT_LEADER_ADDR"] == env["MASTER_ADDR"] == nodes[0].ip
        assert len(env["CUDA_VISIBLE_DEVICES"].split(",")) == 2
        assert env["BT_TRAINING_JOB_ID"] == job.id
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"] and int(envs[0]["MASTER_PORT"]) > 0


def test_every_rank_gets_the_weights_through_the_cluster_cache(tmp_path, storage_root, gpu_cluster):
    bucket = f"gang-{uuid.uuid4().hex[:8]}"
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir(bucket)
    fs.pipe(f"{bucket}/model/w.bin", b"gang weights")
    mount = tmp_path / "mnt" / "model"
    weights = f"[definitions.WeightsSource(source='s3://{bucket}/model', mount_location='{mount}')]"
    read = f"cat {mount}/w.bin"

    def tiers(name: str) -> list[str]:
        config = gang_job(tmp_path / name, read, weights=weights)
        job = push(config, address=gpu_cluster.dashboard_url, storage_root=storage_root)
        assert job.wait(timeout=120) == JobState.COMPLETED, job.logs()
        assert lines_of(job, 0) == lines_of(job, 1) == ["gang weights"]
        return sorted(n.tier for n in job.details().weights[0].nodes)

    # The first to ask fills the shared tier from the mirror; the other finds it there, unless
    # both asked at once (then both copied, and one copy was kept).
    assert tiers("first") in (["cluster", "mirror"], ["mirror", "mirror"])
    assert len(list(gpu_cluster.cluster_cache.glob("*/files/w.bin"))) == 1
    assert tiers("second") == ["node", "node"]
    for disk in gpu_cluster.disks.glob("node-*"):  # the nodes lose their disks' sets
        for files in disk.glob("weights/*/files"):
            os.chmod(files, 0o755)
            shutil.rmtree(files)
    assert tiers("third") == ["cluster", "cluster"]


CACHE_RW = """
import os, pathlib, sys
cache = pathlib.Path(os.environ["BT_PROJECT_CACHE_DIR"])
print("SEES", sorted(p.name for p in cache.iterdir()))
(cache / f"from-rank-{os.environ['BT_NODE_RANK']}-{sys.argv[1]}").write_text("x")
"""


def test_the_cache_is_seeded_on_every_node_and_the_leader_writes_back(
    tmp_path, storage_root, gpu_cluster
):
    """Nodes without a shared filesystem: each has its own copy, brought up to date."""
    project = f"seeded-{uuid.uuid4().hex[:6]}"
    cache = "definitions.CacheConfig(enabled=True, require_cache_affinity=False)"

    def run(name: str, nodes: int) -> JobHandle:
        config = gang_job(tmp_path / name, f"python rw.py {name}", {"rw.py": CACHE_RW},
                          nodes=nodes, project=project, cache=cache)  # fmt: skip
        job = push(config, address=gpu_cluster.dashboard_url, storage_root=storage_root)
        assert job.wait(timeout=120) == JobState.COMPLETED, job.logs()
        return job

    first = run("first", 1)
    holder = first.details().nodes[0].node_id
    assert first.details().cache.written_back["files"] == 1
    assert first.details().cache.affinity == "require_cache_affinity is off: placed anywhere"
    gang = run("gang", WORKERS)  # every worker node: the holder and two without a copy
    for rank in range(WORKERS):
        assert lines_of(gang, rank)[0] == "SEES ['from-rank-0-first']"
    seeded = {n.node_id: n for n in gang.details().cache.nodes}
    assert seeded[holder].had_copy and seeded[holder].files_seeded == 0
    others = [n for node_id, n in seeded.items() if node_id != holder]
    assert [(n.had_copy, n.files_seeded) for n in others] == [(False, 1), (False, 1)]
    # Only the leader's changes go back: the other ranks' files stayed on their nodes.
    assert gang.details().cache.written_back["files"] == 1
    last = run("last", 1)
    assert lines_of(last, 0)[0] == "SEES ['from-rank-0-first', 'from-rank-0-gang']"


def test_cache_affinity_places_the_job_on_the_node_holding_the_cache(
    tmp_path, storage_root, gpu_cluster
):
    project = f"affine-{uuid.uuid4().hex[:6]}"
    cache = "definitions.CacheConfig(enabled=True)"

    def run(name: str) -> JobHandle:
        config = gang_job(tmp_path / name, f"python rw.py {name}", {"rw.py": CACHE_RW},
                          nodes=1, project=project, cache=cache)  # fmt: skip
        job = push(config, address=gpu_cluster.dashboard_url, storage_root=storage_root)
        assert job.wait(timeout=120) == JobState.COMPLETED, job.logs()
        return job

    first = run("first")
    assert first.details().cache.affinity == (
        "no live node holds the project's cache yet: placed anywhere"
    )
    holder = first.details().nodes[0].node_id
    for name in ("second", "third"):
        again = run(name)
        assert again.details().nodes[0].node_id == holder
        assert again.details().cache.affinity == "placed on node(s) holding the project's cache"
        assert again.details().cache.nodes[0].files_seeded == 0


def test_rendezvous_is_a_barrier(gpu_cluster):
    ray.init(address=gpu_cluster.cluster.address, namespace="rendezvous-test")
    try:
        rendezvous = ray.remote(Rendezvous).remote(2)
        leader = rendezvous.join.remote(0, "10.0.0.1", 29555)
        ready, _ = ray.wait([leader], timeout=1.0)
        assert not ready, "rank 0 must wait until every rank has joined"
        follower = rendezvous.join.remote(1, "10.0.0.2", None)
        groups = ray.get([leader, follower], timeout=30)
        addresses = ("10.0.0.1", "10.0.0.2")
        expected = Group(leader_addr="10.0.0.1", master_port=29555, addresses=addresses)
        assert groups[0] == groups[1] == expected
    finally:
        ray.shutdown()


GANG_FAIL = """
import os, sys, time
rank = os.environ["BT_NODE_RANK"]
print(f"pid {os.getpid()}", flush=True)
if rank == "1":
    time.sleep(1)
    print("rank 1 gives up", flush=True)
    sys.exit(4)
time.sleep(300)
"""


def test_one_rank_failing_stops_the_others(tmp_path, storage_root, gpu_cluster):
    config = gang_job(tmp_path / "job", "python gang.py", {"gang.py": GANG_FAIL})
    job = push(config, address=gpu_cluster.dashboard_url, storage_root=storage_root)
    assert job.wait(timeout=120) == JobState.FAILED, job.logs()
    failure = job.details().failure
    assert failure.node_rank == 1 and failure.exit_code == 4
    assert failure.last_lines[-1] == "rank 1 gives up"
    assert "rank 1" in failure.cause
    survivor = int(lines_of(job, 0)[0].split("pid ")[1])
    assert not psutil.pid_exists(survivor) or psutil.Process(survivor).status() == "zombie"


@pytest.mark.parametrize(
    ("nodes", "accelerator", "reason"),
    [
        (4, "H100:2", "needs 4 nodes with 2 H100, 1 CPU, 512.0 MiB memory each"),
        (1, "A100:1", "no node has A100 GPUs; the cluster has H100"),
    ],
)
def test_gang_that_cannot_be_placed(tmp_path, storage_root, gpu_cluster, monkeypatch,
                                    nodes, accelerator, reason):  # fmt: skip
    config = gang_job(tmp_path / "job", "echo never", nodes=nodes, accelerator=accelerator)
    job = push(config, address=gpu_cluster.dashboard_url, storage_root=storage_root)
    assert job.wait(timeout=60) == JobState.DEPLOY_FAILED  # at once: it can never fit
    failure = job.details().failure
    assert failure is not None and reason in failure.cause, failure
    assert not [e for e in job.details().history if e.state == JobState.PENDING]
    assert not any("never" in line for line in job.logs())


SLEEPER = """
import os, time
print(f"pid {os.getpid()}", flush=True)
time.sleep(300)
"""


def test_losing_a_node_fails_the_job_with_that_cause(tmp_path, storage_root, gpu_cluster):
    config = gang_job(tmp_path / "job", "python sleeper.py", {"sleeper.py": SLEEPER})
    job = push(config, address=gpu_cluster.dashboard_url, storage_root=storage_root)
    wait_for_lines(job, {0: 1, 1: 1})
    rank1 = job.details().nodes[1]
    pid = int(lines_of(job, 1)[0].split("pid ")[1])
    gpu_cluster.cluster.remove_node(gpu_cluster.node(rank1.node_id))
    try:
        assert job.wait(timeout=90) == JobState.FAILED, job.logs()
        failure = job.details().failure
        assert failure.node_rank == 1 and "rank 1 was lost" in failure.cause
        deadline = time.monotonic() + 15
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie":
            assert time.monotonic() < deadline, "rank 1's process outlived its node"
            time.sleep(0.2)
    finally:
        gpu_cluster.add_worker()


# Burns a core and holds 300 MiB (every page touched) until the flag file appears.
BURN_AND_HOLD = """
import os, sys, time
held = bytearray(300 * 2**20)
held[::4096] = b"x" * len(range(0, len(held), 4096))
print("burning", flush=True)
deadline = time.time() + 150
while not os.path.exists(sys.argv[1]) and time.time() < deadline:
    end = time.time() + 0.05
    while time.time() < end:
        pass
"""


def prometheus_lines(node, series: str, job_id: str) -> list[str]:
    """The lines of `series` for `job_id` in the Prometheus text the node's Ray metrics agent
    serves (what a Prometheus scraping the cluster reads)."""
    url = f"http://{node.node_ip_address}:{node.metrics_export_port}/metrics"
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return []
    return [
        line for line in text.splitlines()
        if line.startswith(f"ray_{series}{{") and f'job_id="{job_id}"' in line
    ]  # fmt: skip


def test_each_rank_reports_cpu_and_memory_while_it_runs_and_to_prometheus(
    tmp_path, storage_root, gpu_cluster, monkeypatch
):
    monkeypatch.setenv("ORCHESTRATOR_METRICS_INTERVAL_S", "1")
    flag = tmp_path / "stop-burning"
    files = {"burn.py": BURN_AND_HOLD}
    config = gang_job(tmp_path / "job", f"python burn.py {flag}", files, project="metrics")
    job = push(config, address=gpu_cluster.dashboard_url, storage_root=storage_root)
    try:
        wait_for_lines(job, {0: 1, 1: 1})
        nodes = {n.rank: n for n in job.details().nodes}

        def busy_ranks() -> dict[int, RankMetrics]:
            ranks = {m.rank: m for m in read_job_metrics(StorageRoot(storage_root), job.id)}
            return {
                r: m for r, m in ranks.items()
                if len(m.samples) >= 3 and m.samples[-1].memory_bytes >= 300 * MiB
                and max(s.cpu_cores for s in m.samples) >= 0.3
            }  # fmt: skip

        deadline = time.monotonic() + 60
        while set(busy := busy_ranks()) != {0, 1}:
            assert time.monotonic() < deadline, read_job_metrics(StorageRoot(storage_root), job.id)
            assert not job.status().is_terminal, job.logs()
            time.sleep(0.5)
        for rank, metrics in busy.items():
            assert metrics.node_id == nodes[rank].node_id
            assert metrics.memory_request_bytes == 512 * MiB and metrics.interval_s == 1.0
        shown = json.loads(cli("metrics", "--job-id", job.id, "--storage-root", storage_root,
                               "-o", "json").stdout)  # fmt: skip
        assert {r["rank"] for r in shown["ranks"]} == {0, 1}
        # Ray's metrics agent on each rank's node serves our series, tagged with the job.
        deadline = time.monotonic() + 60
        for rank, node in nodes.items():
            raylet = gpu_cluster.node(node.node_id)
            while not [
                line for line in prometheus_lines(raylet, "orchestrator_job_memory_bytes", job.id)
                if f'rank="{rank}"' in line and 'project="metrics"' in line
                and float(line.rsplit(" ", 1)[1]) >= 300 * MiB
            ]:  # fmt: skip
                assert time.monotonic() < deadline, f"rank {rank}'s memory never reached Prometheus"
                time.sleep(1)
            assert prometheus_lines(raylet, "orchestrator_job_cpu_cores", job.id)
    finally:
        flag.touch()
    ended_at = time.time()
    assert job.wait(timeout=60) == JobState.COMPLETED, job.logs()
    # Stored beside the logs: read back with nothing but the storage root, the last moments in.
    csv_rows = list(csv.DictReader(io.StringIO(
        cli("metrics", "--job-id", job.id, "--storage-root", storage_root, "-o", "csv").stdout
    )))  # fmt: skip
    assert {row["rank"] for row in csv_rows} == {"0", "1"}
    for metrics in read_job_metrics(StorageRoot(storage_root), job.id):
        assert metrics.samples[-1].at >= ended_at - 1.5

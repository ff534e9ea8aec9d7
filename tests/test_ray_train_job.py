"""A `ray_train` job (orchestrator's extension): its spec's validation and dry-run line, what
push refuses until Ray Train checkpoints are built, the rank program chosen for it and what its
ranks run (without Ray); and a TorchTrainer job pushed to a simulated cluster of two 2-GPU
nodes, whose workers run inside the job's own placement group while its agents hold nothing."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest
from controller_fakes import in_process_controller
from pydantic import ValidationError
from test_cli_checkpoints import cli

from orchestrator import definitions as d
from orchestrator.agents.rank_program import (
    CommandsProgram,
    RayTrainProgram,
    program_for,
    worker_rank,
)
from orchestrator.agents.ray_train_seams import CALLBACK_PATH
from orchestrator.client.job_summary import describe_job
from orchestrator.client.prepare import prepare_job
from orchestrator.client.support import check_support
from orchestrator.controller.plan import RankPlan
from orchestrator.lifecycle import JobState
from orchestrator.spec.validation import describe_validation_error


def train_job(nodes: int = 2, accelerator: str | None = "H100:2", cpus: int = 2,
              ray_train: d.RayTrain | None = None, **runtime) -> d.TrainingJob:  # fmt: skip
    return d.TrainingJob(
        image=d.Image(base_image="python:3.11"),
        compute=d.Compute(
            node_count=nodes, cpu_count=cpus, memory="512Mi", accelerator=accelerator
        ),
        runtime=d.Runtime(start_commands=["python train.py"], **runtime),
        ray_train=ray_train or d.RayTrain(),
    )


# --- the spec, the dry run and push's refusals (no Ray) ------------------------------------------


def test_workers_per_node_defaults_to_the_gpus_else_one_and_the_dry_run_says_so():
    assert train_job().ray_train.workers(train_job().compute) == 4
    cpu = train_job(nodes=3, accelerator=None)
    assert cpu.ray_train.workers(cpu.compute) == 3
    summary = describe_job(d.TrainingProject(name="t", job=train_job()))
    assert summary["ray_train"] == "4 Ray Train workers: 2 nodes \u00d7 2, 1 GPU each"
    one = train_job(nodes=1, accelerator=None, cpus=4, ray_train=d.RayTrain(workers_per_node=3))
    assert describe_job(d.TrainingProject(name="t", job=one))["ray_train"] == (
        "3 Ray Train workers: 1 node \u00d7 3"
    )
    plain = train_job().model_copy(update={"ray_train": None})
    assert describe_job(d.TrainingProject(name="t", job=plain))["ray_train"] is None


@pytest.mark.parametrize(
    ("compute", "workers", "reason"),
    [
        ({"cpu_count": 4, "accelerator": "H100:2"}, 4, "4 workers per node do not fit a node's "
         "2 GPUs (compute), each taking one: set it to at most 2, or ask for more GPUs per node"),
        ({"cpu_count": 1}, 2, "2 workers per node do not fit a node's 1 CPU (compute), each "
         "taking one: set it to at most 1, or ask for more CPUs per node"),
        ({"cpu_count": 1, "accelerator": "H100:4"}, None, "4 workers per node do not fit a "
         "node's 1 CPU (compute)"),
        ({}, 0, "Input should be greater than or equal to 1 (got 0)"),
    ],
)  # fmt: skip
def test_a_share_that_cannot_hold_its_workers_is_refused_with_the_field(compute, workers, reason):
    config = {"image": {"base_image": "python:3.11"}, "compute": compute,
              "ray_train": {"workers_per_node": workers}}  # fmt: skip
    with pytest.raises(ValidationError) as caught:
        d.TrainingJob.model_validate(config)
    (line,) = describe_validation_error(caught.value, d.TrainingJob)
    assert line.startswith(f"TrainingJob.ray_train.workers_per_node: {reason}"), line


def test_checkpoints_and_retries_of_a_ray_train_job_are_taken(tmp_path):
    checkpointed = train_job(checkpointing_config=d.CheckpointingConfig(enabled=True))
    assert check_support(checkpointed).errors == ()
    prepare_job(d.TrainingProject(name="t", job=checkpointed), tmp_path)  # nothing refused


# --- the rank program (no Ray: the ranks run in this process) ------------------------------------


def test_a_ray_train_job_gets_the_train_program_whose_agents_hold_none_of_the_bundle():
    program = program_for(train_job())
    assert program == RayTrainProgram(("python train.py",), workers=4)
    assert isinstance(program_for(train_job().model_copy(update={"ray_train": None})),
                      CommandsProgram)  # fmt: skip
    bundle = {"CPU": 2, "GPU": 2, "memory": 2**29, "accelerator_type:H100": 0.001}
    assert RankPlan(0, bundle, program).agent_share == {"CPU": 0, "memory": 0}
    assert RankPlan(0, bundle, CommandsProgram(("x",))).agent_share == bundle


SHOW = ("echo RAY_ADDRESS=${RAY_ADDRESS-unset} CALLBACKS=$RAY_TRAIN_CALLBACKS "
        "PG=$ORCHESTRATOR_TRAIN_PG WORKERS=$ORCHESTRATOR_TRAIN_WORKERS "
        "STATE=$RAY_TRAIN_ENABLE_STATE_TRACKING "
        "REPORTS=$ORCHESTRATOR_TRAIN_REPORTS_ROOT")  # fmt: skip


def test_rank_0_runs_the_driver_with_trains_variables_the_others_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ORCHESTRATOR_NODE_ROOT", str(tmp_path / "nodes"))
    job = train_job(accelerator=None).model_copy(
        update={"runtime": d.Runtime(start_commands=[SHOW])}
    )
    controller, _, handle = in_process_controller(tmp_path, d.TrainingProject(name="t", job=job),
                                                  "jtrain0001")  # fmt: skip
    assert controller.run() == JobState.COMPLETED
    logs = handle.logs()
    assert "RUNNING: running Ray Train (2 workers) from rank 0's 1 command(s)" in "\n".join(logs)
    rank0 = [line.split("] ", 1)[1] for line in logs if line.startswith("[rank 0 ")]
    # No Ray here, so no cluster address to hand on; on a cluster it is its GCS (below).
    assert rank0 == [f"RAY_ADDRESS=unset CALLBACKS={CALLBACK_PATH} PG=orchestrator-jtrain0001 "
                     f"WORKERS=2 STATE=1 REPORTS={(tmp_path / 'storage').resolve()}"]  # fmt: skip
    rank1 = [line.split("] ", 1)[1] for line in logs if line.startswith("[rank 1 ")]
    assert rank1 == ["Ray Train runs from rank 0: this rank runs nothing, its node's share "
                     "stays reserved in the job's placement group for Train's workers"]  # fmt: skip


def test_each_train_workers_lines_carry_its_rank_once_the_callback_said_the_pids():
    pids: dict[str, str] = {}
    said = (
        "[rank 0 08:00:00] \x1b[36m(TrainController pid=9)\x1b[0m orchestrator: Ray Train "
        "workers: rank 0 is pid 123 on node rank 0; rank 1 is pid 456 on node rank 1"
    )
    assert worker_rank(said, pids) == said and pids == {"123": "0", "456": "1"}
    line = "[rank 0 08:00:01] \x1b[36m(RayTrainWorker pid=456, ip=10.0.0.2)\x1b[0m step 3"
    assert worker_rank(line, pids) == (
        "[rank 0 08:00:01] \x1b[36m(RayTrainWorker rank 1 pid=456, ip=10.0.0.2)\x1b[0m step 3"
    )
    unknown = "[rank 0 08:00:01] (RayTrainWorker pid=999, ip=10.0.0.2) a worker of another run"
    assert worker_rank(unknown, pids) == unknown


# --- on a simulated cluster ----------------------------------------------------------------------

TRAIN = """
import json, os, pathlib
import ray, ray.train, torch, torch.distributed as dist
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

OUT = os.environ["TRAIN_OUT"]

def loop(config):
    total = torch.ones(1)
    dist.all_reduce(total)  # every worker of both nodes
    rank, runtime = ray.train.get_context().get_world_rank(), ray.get_runtime_context()
    print(f"worker rank {rank} of {int(total.item())}", flush=True)
    record = {"group": runtime.get_placement_group_id(), "node": runtime.get_node_id(),
              "gpus": [int(g) for g in ray.get_gpu_ids()]}
    pathlib.Path(config["out"], f"rank-{rank}.json").write_text(json.dumps(record))
    for step in range(3):  # each round is stored with the job: `orchestrator metrics` shows it
        ray.train.report({"loss": 1.0 / (step + 1), "step": step, "rank": rank})

ray.init()
result = TorchTrainer(
    loop, train_loop_config={"out": OUT}, torch_config=TorchConfig(backend="gloo"),
    scaling_config=ScalingConfig(num_workers=4, use_gpu=True),
    run_config=RunConfig(name="job", storage_path=os.path.join(OUT, "store")),
).fit()
# One write: Ray's forwarded worker lines share the pipe, and split a print of two parts.
print(f"trained: {result.error}", flush=True)
"""


@pytest.fixture(scope="module")
def two_gpu_nodes(orchestrator_home) -> Iterator[tuple[str, str]]:
    """A 1-CPU head and two nodes of 2 CPUs and 2 fake H100s; yields (dashboard, GCS address),
    this process connected as a driver (to read the job's group and its agents afterwards)."""
    import ray
    from conftest import simulated_cluster

    cluster, dashboard = simulated_cluster()
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=2, num_gpus=2, resources={"accelerator_type:H100": 1})
        cluster.wait_for_nodes()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
            ray.init(address=cluster.address, namespace="train-job-test", log_to_driver=False)
            try:
                yield dashboard, cluster.address
            finally:
                ray.shutdown()
    finally:
        cluster.shutdown()


@pytest.mark.cluster
def test_a_torch_trainer_job_runs_in_the_jobs_group_with_agents_holding_nothing(
    two_gpu_nodes, tmp_path, storage_root
):
    from ray.util import placement_group_table
    from ray.util.state import list_actors

    from orchestrator.actor_names import node_agent
    from orchestrator.client.api import push

    dashboard, _ = two_gpu_nodes
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "train.py").write_text(TRAIN)
    job = train_job().model_copy(
        update={
            "runtime": d.Runtime(
                start_commands=["python train.py"],
                # Train's controller collects a round at each health check: 2 s by default.
                environment_variables={
                    "TRAIN_OUT": str(out),
                    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
                },
            )
        }
    )
    handle = push(d.TrainingProject(name="train-job", job=job), tmp_path / "code",
                  address=dashboard, storage_root=storage_root, retries=0)  # fmt: skip
    assert handle.wait(timeout=240) == JobState.COMPLETED, "\n".join(handle.logs())
    logs = "\n".join(handle.logs())
    for rank in range(4):
        assert f"worker rank {rank} of 4" in logs, logs
    assert "trained: None" in logs, logs  # fit's Result: no error

    (group,) = [g for g in placement_group_table().values()
                if g["name"] == f"orchestrator-{handle.id}"]  # fmt: skip
    runs = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(4)]
    assert [run["group"] for run in runs] == [group["placement_group_id"]] * 4
    nodes = {n.rank: n.node_id for n in handle.details().nodes}
    assert [run["node"] for run in runs] == [nodes[0], nodes[0], nodes[1], nodes[1]]
    assert sorted(runs[0]["gpus"] + runs[1]["gpus"]) == [0, 1]  # the share's GPUs, each once
    assert sorted(runs[2]["gpus"] + runs[3]["gpus"]) == [0, 1]
    for rank in (0, 1):
        (agent,) = list_actors(address=dashboard, detail=True, raise_on_missing_output=False,
                               filters=[("name", "=", node_agent(handle.id, rank))])  # fmt: skip
        held = {k: v for k, v in agent.required_resources.items() if v}
        # Only the token that puts an actor in its bundle: no CPU, GPU or memory of it.
        assert held and all(k.startswith("bundle_group_") for k in held), held

    # Every round Train collected, rank 0's metrics and those of the workers that differ, kept
    # with the job; `orchestrator metrics` lists them in a section of their own.
    (run,) = handle.metrics().train_reports
    assert [(r.index, r.metrics, r.checkpoint) for r in run.reports] == [
        (step, {"loss": 1.0 / (step + 1), "step": step, "rank": 0}, None) for step in range(3)
    ]
    assert [r.workers for r in run.reports] == [
        {w: {"loss": 1.0 / (step + 1), "step": step, "rank": w} for w in (1, 2, 3)}
        for step in range(3)
    ]
    shown = cli("metrics", "--job-id", handle.id, "--storage-root", storage_root, "--once")
    assert shown.returncode == 0, shown.stderr
    section = shown.stdout[shown.stdout.index("Ray Train reports") :]
    assert re.search(r"report\s+loss\s+rank\s+step", section), section
    for step in range(3):
        assert re.search(rf"\b{step}\s+{1.0 / (step + 1):.4g}\s+0\s+{step}\b", section), section
    as_json = json.loads(cli("metrics", "--job-id", handle.id, "--storage-root", storage_root,
                             "-o", "json").stdout)  # fmt: skip
    losses = [r["metrics"]["loss"] for r in as_json["train_reports"][0]["reports"]]
    assert losses == [1.0, 0.5, 1.0 / 3]

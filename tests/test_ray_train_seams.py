"""A Ray Train job's workers inside the job's own placement group (agents/ray_train_callback.py),
on a simulated cluster of two 2-GPU nodes; and the detection of Ray Train's private seams
(agents/ray_train_seams.py) against a faked Ray, without Ray."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from orchestrator.agents import ray_train_seams
from orchestrator.agents.ray_train_seams import (
    CALLBACK_PATH,
    RAY_TRAIN_CALLBACKS_ENV,
    TRAIN_PG_ENV,
    TRAIN_WORKERS_ENV,
    RayTrainSeamsMissing,
    find_seams,
)

# --- the detection, against a faked Ray ---------------------------------------------------------


def fake_ray(drop: set[str] = frozenset(), lose_parameter: str | None = None,
             lose_module: str | None = None):  # fmt: skip
    """An import_module over modules holding every seam, less the `drop`ped names ("Class" or
    "Class.attr"); `lose_parameter`: a parameter _create_workers no longer takes; `lose_module`:
    a module this Ray does not have."""
    modules: dict[str, SimpleNamespace] = {}
    for module, name, members in ray_train_seams._SEAMS:
        holder = modules.setdefault(module, SimpleNamespace())
        if name in drop:
            continue
        params = {m: ("self", *ray_train_seams._PARAMETERS.get((name, m), ())) for m in members}
        if lose_parameter and name == "WorkerGroup":
            params["_create_workers"] = ("self",)
        kept = {m: _function(params[m]) for m in members if f"{name}.{m}" not in drop}
        setattr(holder, name, type(name, (), kept))
    for module, name, value in ray_train_seams._VALUES:
        setattr(modules.setdefault(module, SimpleNamespace()), name, value)

    def import_module(module: str):
        if module not in modules or module == lose_module:
            raise ImportError(module)
        return modules[module]

    return import_module


def _function(parameters: tuple[str, ...]):
    namespace: dict = {}
    exec(f"def f({', '.join(parameters)}): pass", namespace)
    return namespace["f"]


def test_a_ray_with_every_seam_passes_the_detection():
    seams = find_seams(fake_ray(), version="2.99.0")
    assert seams.WorkerGroup.__name__ == "WorkerGroup"


def test_each_missing_seam_is_named_with_the_ray_version_found():
    broken = fake_ray(drop={"WorkerGroup._create_placement_group", "FailureDecision"},
                      lose_parameter="placement_group_bundle_indices")  # fmt: skip
    with pytest.raises(RayTrainSeamsMissing) as caught:
        find_seams(broken, version="2.99.0")
    message = str(caught.value)
    assert "this Ray (2.99.0)" in message
    assert "WorkerGroup._create_placement_group" in message
    assert "ray.train.v2._internal.execution.failure_handling.FailureDecision" in message
    assert (
        "the parameter 'placement_group_bundle_indices' of WorkerGroup._create_workers" in message
    )
    assert "Ray Train jobs run on Ray 2.60" in message


def test_a_missing_module_is_named_once():
    module = "ray.train.v2._internal.execution.callback"  # two seams live there
    with pytest.raises(RayTrainSeamsMissing) as caught:
        find_seams(fake_ray(lose_module=module), version="2.99.0")
    assert caught.value.missing.count(f"the module {module}") == 1, caught.value.missing


def test_the_installed_ray_has_every_seam():
    assert ray_train_seams.seams_missing() is None


# --- on a simulated cluster ----------------------------------------------------------------------

GROUP = "orchestrator-seams"


@pytest.fixture(scope="module")
def two_gpu_nodes(orchestrator_home) -> Iterator[str]:
    """A head with no GPU (the driver and Train's controller run there) and two nodes of two
    fake GPUs; this process connected as the job's driver. Yields the dashboard's address
    (Train's placement-group cleaner watches its controller through the state API)."""
    import ray
    from ray import cloudpickle
    from ray.cluster_utils import Cluster

    from orchestrator.cluster.local import CLUSTER_ENV, use_embedded_env
    from orchestrator.cluster.ray_start import free_ports

    use_embedded_env()
    dashboard, gcs, agent, metrics = free_ports(4)
    with pytest.MonkeyPatch.context() as patch:
        for key, value in {**CLUSTER_ENV, "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}.items():
            patch.setenv(key, value)
        patch.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "num_gpus": 0, "include_dashboard": True, "dashboard_port": dashboard,
            "dashboard_host": "127.0.0.1", "gcs_server_port": gcs,
            "dashboard_agent_listen_port": agent, "metrics_export_port": metrics})  # fmt: skip
        try:
            for _ in range(2):
                cluster.add_node(num_cpus=2, num_gpus=2)
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, log_to_driver=False)
            # Train's workers cannot import this test module: its functions travel by value.
            cloudpickle.register_pickle_by_value(sys.modules[__name__])
            yield f"http://127.0.0.1:{dashboard}"
        finally:
            ray.shutdown()
            cluster.shutdown()


@contextlib.contextmanager
def admitted(monkeypatch: pytest.MonkeyPatch, nodes: int, workers: int) -> Iterator:
    """The job's group as the queue admits it (one {CPU 2, GPU 2} bundle per node, spread),
    and the driver's environment as the rank program sets it."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group([{"CPU": 2, "GPU": 2}] * nodes, strategy="STRICT_SPREAD", name=GROUP)
    ray.get(group.ready(), timeout=30)
    monkeypatch.setenv(RAY_TRAIN_CALLBACKS_ENV, CALLBACK_PATH)
    monkeypatch.setenv(TRAIN_PG_ENV, GROUP)
    monkeypatch.setenv(TRAIN_WORKERS_ENV, str(workers))
    try:
        yield group
    finally:
        remove_placement_group(group)


def trainer(loop, config: dict, workers: int, store: Path, max_failures: int = 0):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    return TorchTrainer(
        loop, train_loop_config=config, torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=True,
                                     resources_per_worker={"CPU": 1, "GPU": 1}),
        run_config=RunConfig(name="seams", storage_path=str(store),
                             failure_config=FailureConfig(max_failures=max_failures)),
    )  # fmt: skip


def where_i_run(config: dict) -> None:
    """Each worker writes where it runs: node, placement group, GPU ids."""
    import ray
    import ray.train

    context, runtime = ray.train.get_context(), ray.get_runtime_context()
    record = {"node": runtime.get_node_id(), "group": runtime.get_placement_group_id(),
              "gpus": [int(g) for g in ray.get_gpu_ids()]}  # fmt: skip
    Path(config["out"], f"rank-{context.get_world_rank()}.json").write_text(json.dumps(record))
    ray.train.report({"step": 1})


@pytest.mark.cluster
def test_workers_run_inside_the_jobs_group_and_nothing_else_gets_its_gpus(
    two_gpu_nodes, tmp_path, monkeypatch
):
    import ray
    from ray.util import placement_group_table

    @ray.remote(num_gpus=1, num_cpus=0)
    def foreign() -> str:
        return ray.get_runtime_context().get_node_id()

    with admitted(monkeypatch, nodes=2, workers=4) as group:
        waiting = foreign.remote()  # queued before Train starts: it must not win a GPU
        trainer(where_i_run, {"out": str(tmp_path)}, workers=4, store=tmp_path / "store").fit()

        table = placement_group_table(group)
        runs = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(4)]
        assert [run["group"] for run in runs] == [group.id.hex()] * 4
        assert [run["node"] for run in runs] == [
            table["bundles_to_node_id"][r // 2] for r in range(4)
        ]
        assert sorted(runs[0]["gpus"] + runs[1]["gpus"]) == [0, 1]  # real, distinct GPU ids
        assert sorted(runs[2]["gpus"] + runs[3]["gpus"]) == [0, 1]
        assert table["state"] == "CREATED", "Train removed the job's group"
        assert ray.wait([waiting], timeout=0)[0] == [], "a foreign task got a GPU of the job's"
    # Once the job gives its group back, the GPUs are free: no Train actor (controller, driver
    # side) held one outside the group.
    assert ray.get(waiting, timeout=30)
    deadline = time.monotonic() + 30
    while ray.available_resources().get("GPU", 0) < 4:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.2)


def dies_after_its_first_report(config: dict) -> None:
    import ray.train

    with open(Path(config["out"], "starts"), "a") as starts:
        starts.write(f"{ray.train.get_context().get_world_rank()}\n")
    ray.train.report({"step": 1})
    if ray.train.get_context().get_world_rank() == 1:
        time.sleep(1)
        os._exit(1)
    time.sleep(60)


@pytest.mark.cluster
def test_train_own_retries_are_refused_at_the_first_failure(two_gpu_nodes, tmp_path, monkeypatch):
    from ray.train import ControllerError
    from ray.util import placement_group_table

    with admitted(monkeypatch, nodes=1, workers=2) as group:
        started = time.monotonic()
        fit = trainer(dies_after_its_first_report, {"out": str(tmp_path)}, workers=2,
                      store=tmp_path / "store", max_failures=3)  # fmt: skip
        with pytest.raises(ControllerError) as caught:
            fit.fit()
        assert time.monotonic() - started < 50  # not the healthy ranks' 60 s sleep
        message = str(caught.value)
        assert "rank 1: " in message
        assert "Ray Train's own retries (FailureConfig) are not used" in message
        assert "push --retries" in message
        starts = (tmp_path / "starts").read_text().split()
        assert sorted(starts) == ["0", "1"], f"Train retried: workers started {starts}"
        assert placement_group_table(group)["state"] == "CREATED"


@pytest.mark.cluster
def test_a_script_asking_other_workers_than_admitted_fails_with_the_fix(
    two_gpu_nodes, tmp_path, monkeypatch
):
    from ray.train import ControllerError

    with admitted(monkeypatch, nodes=2, workers=4):
        with pytest.raises(ControllerError, match=r"set ScalingConfig\(num_workers=4\)") as caught:
            trainer(where_i_run, {"out": str(tmp_path)}, workers=3, store=tmp_path / "s").fit()
        assert "the script asks for 3 Ray Train workers, the job was admitted with 4" in str(
            caught.value
        )
        assert not list(tmp_path.glob("rank-*.json")), "a worker ran"


def kills_its_controller(config: dict) -> None:
    """Rank 0 kills Train's controller, as a stop that SIGKILLs the driver's side would."""
    import ray
    import ray.train
    from ray.train.v2._internal.execution.context import get_train_context

    ray.train.report({"step": 1})
    Path(config["out"], "reported").write_text("1")
    ray.kill(get_train_context().controller_actor, no_restart=True)
    time.sleep(60)


@pytest.mark.cluster
def test_train_cleaner_leaves_the_jobs_group_when_its_controller_dies(
    two_gpu_nodes, tmp_path, monkeypatch
):
    from ray.exceptions import RayActorError
    from ray.util import placement_group_table
    from ray.util.state import list_actors

    def cleaners(state: str) -> list:
        where = [("class_name", "=", "PlacementGroupCleaner"), ("state", "=", state)]
        return list_actors(address=two_gpu_nodes, filters=where, raise_on_missing_output=False)

    with admitted(monkeypatch, nodes=1, workers=1) as group:
        dead_before = len(cleaners("DEAD"))
        with pytest.raises(RayActorError):  # fit waits on the controller, which died
            trainer(kills_its_controller, {"out": str(tmp_path)}, workers=1,
                    store=tmp_path / "store").fit()  # fmt: skip
        assert (tmp_path / "reported").exists(), "the worker never ran"
        # The cleaner saw its controller dead, cleaned what it was given, and exited.
        deadline = time.monotonic() + 60
        while len(cleaners("DEAD")) <= dead_before:
            assert time.monotonic() < deadline, "Train's cleaner never noticed the death"
            time.sleep(0.5)
        assert placement_group_table(group)["state"] == "CREATED", "Train removed the job's group"

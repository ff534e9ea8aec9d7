"""`orchestrator doctor`: against the embedded cluster (all good), with the storage root
unwritable, with a client of another Ray (simulated), and the cluster's answers it judges
(podman missing where jobs run in containers, GPUs, disk, a node of another Ray)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from orchestrator import ray_private
from orchestrator.agents.runtimes import RuntimeKind
from orchestrator.cli.app import app
from orchestrator.client import doctor as doctor_mod
from orchestrator.client.doctor import FAIL, OK, WARN, Check, DoctorReport, doctor, probe_checks

GIB = 1 << 30


def node(**facts):
    base = {"node_id": "a1b2c3d4e5f6", "address": "10.0.0.5", "head": False, "ray": "2.60.0",
            "python": "3.11.7", "orchestrator": True, "podman": "/usr/bin/podman",
            "runc": "/usr/sbin/runc", "cgroup_v2": False, "ray_gpus": 0.0,
            "nvidia_smi_gpus": None, "node_root": "/tmp/orchestrator",
            "free_bytes": 50 * GIB}  # fmt: skip
    return {**base, **facts}


def by_item(checks: list[Check]) -> dict[str, Check]:
    return {c.item: c for c in checks}


# -- the cluster's answers, judged (no Ray) -------------------------------------------------------


def runtime(kind: RuntimeKind) -> dict:
    """What the probe says of the head's job runtime (client/doctor_probe.py)."""
    return {"runtime": kind.value, "node_tools": list(kind.node_tools)}


def test_podman_missing_on_a_container_cluster_is_a_failure_naming_the_node_and_the_fix():
    probe = {
        **runtime(RuntimeKind.CONTAINER),
        "nodes": [node(head=True), node(node_id="ffee0011", podman=None)],
    }
    checks = by_item(probe_checks(probe, "2.60.0"))
    assert checks["container runtime node a1b2c3d4 (head)"].status == OK
    missing = checks["container runtime node ffee0011"]
    assert missing.status == FAIL and "podman not found" in missing.detail
    assert missing.fix == "apt-get install podman on 10.0.0.5"
    assert not DoctorReport(None, None, list(checks.values())).ok


def test_runc_is_needed_only_where_cgroups_v1_make_podman_use_it():
    probe = {
        **runtime(RuntimeKind.CONTAINER),
        "nodes": [node(runc=None), node(node_id="bbbb0000", runc=None, cgroup_v2=True)],
    }
    checks = by_item(probe_checks(probe, "2.60.0"))  # fmt: skip
    assert checks["container runtime node a1b2c3d4"].status == FAIL
    assert checks["container runtime node a1b2c3d4"].fix == "apt-get install runc on 10.0.0.5"
    assert checks["container runtime node bbbb0000"].status == OK


def test_an_image_uri_cluster_needs_podman_only_and_a_host_cluster_neither():
    uri = {**runtime(RuntimeKind.IMAGE_URI), "nodes": [node(runc=None)]}
    assert by_item(probe_checks(uri, "2.60.0"))["image_uri runtime node a1b2c3d4"].status == OK
    host = {**runtime(RuntimeKind.HOST), "nodes": [node(podman=None, runc=None)]}
    checks = probe_checks(host, "2.60.0")
    assert not any("runtime" in c.item for c in checks)
    assert all(c.status == OK for c in checks)


def test_a_node_of_another_ray_or_without_orchestrator_fails_with_what_to_install():
    probe = {
        "runtime": "host",
        "nodes": [node(ray="2.58.0"), node(node_id="bbbb0000", orchestrator=False)],
    }
    checks = by_item(probe_checks(probe, "2.60.0"))
    other = checks["ray node a1b2c3d4"]
    assert other.status == FAIL and "2.58.0" in other.detail and "2.60.0" in other.detail
    assert "ray[default,train,serve]==2.60.0" in other.fix
    assert checks["ray node bbbb0000"].status == FAIL
    assert "install orchestrator" in checks["ray node bbbb0000"].fix


def test_a_node_that_runs_no_task_fails():
    checks = probe_checks({"nodes": [node(error="timed out")]}, "2.60.0")
    assert checks[0].status == FAIL and "timed out" in checks[0].detail


@pytest.mark.parametrize(
    ("ray_gpus", "seen", "status"),
    [(0.0, None, OK), (8.0, 8, OK), (2.0, None, FAIL), (8.0, 4, FAIL), (4.0, 8, WARN)],
)
def test_gpus_as_ray_declares_them_against_nvidia_smi(ray_gpus, seen, status):
    check = by_item(probe_checks({"nodes": [node(ray_gpus=ray_gpus, nvidia_smi_gpus=seen)]},
                                 "2.60.0"))["gpus node a1b2c3d4"]  # fmt: skip
    assert check.status == status
    if status != OK:
        assert "--num-gpus" in check.fix or "driver" in check.fix


@pytest.mark.parametrize(("free", "status"), [(50 * GIB, OK), (5 * GIB, WARN), (GIB // 2, FAIL)])
def test_free_disk_under_the_node_root(free, status):
    check = by_item(probe_checks({"nodes": [node(free_bytes=free)]}, "2.60.0"))[
        "disk node a1b2c3d4"
    ]
    assert check.status == status and "/tmp/orchestrator" in check.detail


def test_the_head_not_reading_the_clients_probe_object_fails():
    probe = {"nodes": [], "storage": {"error": "No such file"}}
    check = probe_checks(probe, "2.60.0", key="doctor/probe-1")[0]
    assert check.item == "storage root (head)" and check.status == FAIL
    assert "No such file" in check.detail
    good = probe_checks(
        {"nodes": [], "storage": {"read": "doctor/probe-1"}}, "2.60.0", "doctor/probe-1"
    )
    assert good[0].status == OK


def test_an_unwritable_storage_root_fails_with_the_fix(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    report = DoctorReport(address=None, storage_root=None)
    assert doctor_mod._check_storage(report, str(blocker / "storage")) is None
    check = report.checks[0]
    assert check.item == "storage root" and check.status == FAIL
    assert "probe object" in check.detail and "write" in check.fix
    assert not report.ok


def test_the_cli_prints_one_line_per_item_with_its_fix_and_exits_1_on_a_failure(monkeypatch):
    report = DoctorReport(address="http://h:8265", storage_root="/s")
    report.add("ray client", OK, "2.60.0")
    report.add("storage root", FAIL, "/s: cannot write", "give this client write rights")
    monkeypatch.setattr("orchestrator.cli.cmd_doctor.run_doctor", lambda a, s: report)
    result = CliRunner().invoke(app, ["doctor"])
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert len(lines) == 2 and lines[0].startswith("ok") and "ray client" in lines[0]
    assert lines[1].startswith("FAIL") and "-- fix: give this client write rights" in lines[1]
    result = CliRunner().invoke(app, ["doctor", "-o", "json"])
    answer = json.loads(result.output)
    assert answer["ok"] is False and answer["checks"][1]["fix"] == "give this client write rights"


# -- against the embedded cluster ----------------------------------------------------------------


@pytest.mark.cluster
def test_doctor_finds_the_embedded_cluster_all_good(ray_cluster, storage_root):
    report = doctor(storage_root=storage_root)
    checks = by_item(report.checks)
    assert report.ok, [c for c in report.checks if c.status != OK]
    assert checks["ray client"].detail.startswith(ray_private.ray_version())
    assert (
        checks["ray head"].status == OK and checks["ray head"].detail == ray_private.ray_version()
    )
    assert checks["token auth"].status == OK and checks["token auth"].detail.startswith("on")
    assert checks["storage root"].status == OK and checks["storage root (head)"].status == OK
    nodes = [c for c in report.checks if c.item.startswith("ray node")]
    assert len(nodes) == 1 and "(head)" in nodes[0].item
    assert any(c.item.startswith("gpus node") for c in report.checks)
    assert any(c.item.startswith("disk node") for c in report.checks)
    assert "queue service" in checks
    # the probe object is gone, and so is the probe job from Ray's table
    from pathlib import Path

    assert not list((Path(storage_root) / "doctor").glob("probe-*"))


@pytest.mark.cluster
def test_doctor_with_an_unwritable_storage_root_exits_1(ray_cluster, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    result = CliRunner().invoke(
        app, ["doctor", "--storage-root", str(blocker / "root"), "-o", "json"]
    )
    assert result.exit_code == 1, result.output
    checks = {c["item"]: c for c in json.loads(result.output)["checks"]}
    assert checks["storage root"]["status"] == FAIL
    assert checks["ray head"]["status"] == OK  # the rest is still checked


@pytest.mark.cluster
def test_doctor_with_a_client_of_another_ray_says_both_and_what_to_install(
    ray_cluster, storage_root, monkeypatch
):
    import ray

    monkeypatch.setattr(ray_private, "ray_version", lambda: "2.58.0")
    result = CliRunner().invoke(app, ["doctor", "--storage-root", storage_root])
    assert result.exit_code == 1, result.output
    head = next(line for line in result.output.splitlines() if "ray head" in line)
    assert head.startswith("FAIL") and "runs Ray 2.58.0" in head and ray.__version__ in head
    assert f"pip install 'ray[default,train,serve]=={ray.__version__}'" in head


@pytest.mark.cluster
def test_doctor_asks_every_node_of_a_multinode_cluster(orchestrator_home, tmp_path):
    """A head and two workers (ray.cluster_utils): one line per node each, and GPUs Ray declares
    on machines without nvidia-smi are a failure naming the fix."""
    from conftest import simulated_cluster

    cluster, address = simulated_cluster()
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1, num_gpus=2)
        cluster.wait_for_nodes()
        report = doctor(address=address, storage_root=str(tmp_path / "storage"))
    finally:
        cluster.shutdown()
    nodes = [c for c in report.checks if c.item.startswith("ray node")]
    assert len(nodes) == 3 and all(c.status == OK for c in nodes), report.checks
    assert sum("(head)" in c.item for c in nodes) == 1
    gpus = [c for c in report.checks if c.item.startswith("gpus node")]
    assert sorted(c.status for c in gpus) == [FAIL, FAIL, OK]
    assert all("--num-gpus=0" in c.fix for c in gpus if c.status == FAIL)
    assert len([c for c in report.checks if c.item.startswith("disk node")]) == 3
    assert not report.ok

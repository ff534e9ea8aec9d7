"""`orchestrator doctor`: what a cluster needs for orchestrator's jobs, checked item by item,
each with the fix when it is missing.

From here: this client's Ray against the supported range and the cluster's, the Job API and its
token, the storage root (a probe object written, read and deleted). From the cluster, through a
short Ray job (client/doctor_probe.py): the head's Ray and job runtime, every node's Ray,
podman and runc where jobs run in containers, GPUs as Ray and nvidia-smi see them, free disk
under the node root, the queue service.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shlex
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from orchestrator import ray_private
from orchestrator.client.connection import Connection, connect, storage
from orchestrator.client.doctor_probe import MARK
from orchestrator.cluster.auth import refusal
from orchestrator.storage.queue_store import QueueStore
from orchestrator.storage.retry import StorageRetry
from orchestrator.storage.root import StorageRoot

OK, WARN, FAIL = "ok", "warn", "fail"
PROBE_DIR = "doctor"  # the probe object's folder under the storage root (storage/layout.py)
PROBE_TIMEOUT_S = 90.0  # the cluster's probe job: submitted, run on every node, answered
DISK_FAIL_BYTES = 1 << 30  # less free under a node root than this: a job cannot unpack there
DISK_WARN_BYTES = 10 << 30


@dataclass(frozen=True)
class Check:
    """One item: `status` ok, warn (a job runs, with less) or fail (a job needs it)."""

    item: str
    status: str
    detail: str
    fix: str = ""


@dataclass
class DoctorReport:
    address: str | None
    storage_root: str | None
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.status != FAIL for c in self.checks)

    def add(self, item: str, status: str, detail: str, fix: str = "") -> None:
        self.checks.append(Check(item, status, detail, fix))

    def to_json(self) -> dict[str, Any]:
        return {"address": self.address, "storage_root": self.storage_root, "ok": self.ok,
                "checks": [asdict(c) for c in self.checks]}  # fmt: skip


def doctor(address: str | None = None, storage_root: str | None = None) -> DoctorReport:
    """Every check, in order; a failure that hides what follows (no cluster) ends the list."""
    report = DoctorReport(address=address, storage_root=None)
    client_ray = ray_private.ray_version()
    said = ray_private.unsupported(client_ray)
    report.add("ray client", FAIL if said else OK,
               said or f"{client_ray} (orchestrator supports Ray {ray_private.SUPPORTED_RAY})",
               f"pip install '{ray_private.RAY_PACKAGE}{ray_private.SUPPORTED_RAY}'"
               if said else "")  # fmt: skip
    root = _check_storage(report, storage_root)
    try:
        connection = connect(address)
    except Exception as e:
        report.add("cluster", FAIL, f"no cluster: {_one_line(e)}",
                   "start it (`ray start --head`, or `orchestrator cluster start`) or give "
                   "--address")  # fmt: skip
        return report
    report.address = connection.address
    version = _check_job_api(report, connection)
    if version is None:
        return report
    cluster_ray = str(version.get("ray_version"))
    said = ray_private.mismatch(client_ray, cluster_ray, connection.address)
    said = said or ray_private.unsupported(cluster_ray, "the head's Ray")
    report.add("ray head", FAIL if said else OK, said or cluster_ray,
               "" if not said else "a client must run the cluster's Ray release, and the "
               f"cluster one of {ray_private.SUPPORTED_RAY}")  # fmt: skip
    probe_key = _write_probe(root) if root is not None else None
    try:
        probe = run_probe(connection, root, probe_key)
    except Exception as e:
        report.add("cluster probe", FAIL, f"the cluster could not run doctor's probe job: "
                   f"{_one_line(e)}", "install orchestrator (this version) in the Python the "
                   "cluster runs jobs with (or name it in ORCHESTRATOR_PYTHON)")  # fmt: skip
        probe = None
    finally:
        if root is not None and probe_key is not None:
            _delete_probe(report, root, probe_key)
    if probe is not None:
        for check in probe_checks(probe, cluster_ray, probe_key):
            report.checks.append(check)
    if root is not None:
        _check_queue(report, root, str(version.get("session_name")), probe)
    return report


# -- from here --------------------------------------------------------------------------------


def _check_storage(report: DoctorReport, storage_root: str | None) -> StorageRoot | None:
    try:
        root = storage(storage_root)
        root.retry = StorageRetry(root.url, budget_s=5)  # said now, not after an outage's wait
    except Exception as e:
        report.add("storage root", FAIL, f"{storage_root or 'the default storage root'}: "
                   f"{_one_line(e)}", "give a reachable --storage-root (or "
                   "ORCHESTRATOR_STORAGE_ROOT)")  # fmt: skip
        return None
    report.storage_root = root.url
    key = f"{PROBE_DIR}/probe-{secrets.token_hex(6)}"
    try:
        data = secrets.token_hex(8).encode()
        root.write_bytes(key, data)
        if root.read_bytes(key) != data:
            raise RuntimeError("what was read back is not what was written")
        root.discard(key)
        if root.exists(key):
            raise RuntimeError("the probe object is still there after its delete")
    except Exception as e:
        report.add(
            "storage root",
            FAIL,
            f"{root.url}: writing, reading and deleting a probe object failed: {_one_line(e)}",
            "give this client (and the cluster) "
            "write, read and delete rights there, or choose another --storage-root",
        )
        return None  # fmt: skip
    report.add("storage root", OK, f"{root.url}: a probe object written, read and deleted")
    return root


def _write_probe(root: StorageRoot) -> str | None:
    key = f"{PROBE_DIR}/probe-{secrets.token_hex(6)}"
    try:
        root.write_bytes(key, key.encode())
    except Exception:
        return None  # _check_storage said why
    return key


def _delete_probe(report: DoctorReport, root: StorageRoot, key: str) -> None:
    try:
        root.discard(key)
    except Exception as e:
        report.add("storage root", WARN, f"the cluster's probe object {key} was not deleted: "
                   f"{_one_line(e)}", f"delete {root.url}/{key}")  # fmt: skip


def _check_job_api(report: DoctorReport, connection: Connection) -> dict[str, Any] | None:
    """The cluster's /api/version through this client (its token included), and whether the
    Job API lets in a client without one."""
    try:
        version = ray_private.cluster_version(connection.client())
    except Exception as e:
        refused = refusal(e, connection.address)
        if refused:
            report.add("token auth", FAIL, refused)
        else:
            report.add(
                "job api",
                FAIL,
                f"{connection.address} did not answer: {_one_line(e)}",
                "start the head with its dashboard (`ray start --head "
                "--include-dashboard=true`) and give its address with --address",
            )
        return None  # fmt: skip
    session = version.get("session_name")
    report.add("job api", OK, f"{connection.address} answers (session {session})")
    report.checks.append(token_check(connection.address))
    return version


def token_check(address: str) -> Check:
    """Whether the Job API refuses a client that sends no token."""
    import requests

    try:
        bare = requests.get(address.rstrip("/") + "/api/jobs/", timeout=10)
    except Exception as e:
        return Check("token auth", WARN, f"could not ask without a token: {_one_line(e)}")
    if bare.status_code in (401, 403):
        return Check("token auth", OK, "on: the Job API refuses a client without the cluster's "
                     "token, and this client has it")  # fmt: skip
    return Check("token auth", WARN, "off: anyone who reaches the Job API can run code on the "
                 "cluster", "start Ray with RAY_AUTH_MODE=token and a token in "
                 "~/.ray/auth_token (or RAY_AUTH_TOKEN_PATH) on every node and client")  # fmt: skip


def _check_queue(
    report: DoctorReport, root: StorageRoot, session: str, probe: dict[str, Any] | None
) -> None:
    try:
        watched = QueueStore(root).watched_by(session)
    except Exception as e:
        report.add("queue service", WARN, f"its beat could not be read: {_one_line(e)}")
        return
    if watched:
        report.add("queue service", OK, f"alive, watching {root.url}")
        return
    if probe is not None and probe.get("queue_service"):
        report.add("queue service", OK, f"alive; not watching {root.url} yet (a push there "
                   "makes it)")  # fmt: skip
        return
    try:
        waiting = len(QueueStore(root).incoming()) + len(QueueStore(root).entries())
    except Exception:
        waiting = 0
    if waiting:
        report.add("queue service", WARN, f"not running, and {waiting} job(s) of {root.url} "
                   "are in the queue with no service to admit them", "push a job (its "
                   "controller starts the service), or stop the waiting ones")  # fmt: skip
    else:
        report.add("queue service", OK, "not running yet: the next push starts it")


# -- from the cluster -------------------------------------------------------------------------


def run_probe(connection: Connection, root: StorageRoot | None, key: str | None) -> dict[str, Any]:
    """The probe job's answer (client/doctor_probe.py), submitted through the Job API as any
    controller is, and deleted from Ray's job table after."""
    from orchestrator.client.submit import remote_python, submit_ray_job

    job_id = f"orchestrator-doctor-{secrets.token_hex(4)}"
    parts = [remote_python(connection.embedded), "-m", "orchestrator.client.doctor_probe"]
    if root is not None and key is not None:
        parts += ["--storage-root", root.url, "--probe", key]
    submit_ray_job(
        connection.client,
        connection.address,
        job_id,
        entrypoint=" ".join(shlex.quote(p) for p in parts),
        metadata={"job_name": "orchestrator doctor"},
        entrypoint_num_cpus=0,
    )
    client = connection.client()  # fmt: skip
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    try:
        while True:
            status = str(client.get_job_status(job_id))
            if status.split(".")[-1] in ("SUCCEEDED", "FAILED", "STOPPED"):
                break
            if time.monotonic() > deadline:
                client.stop_job(job_id)
                raise RuntimeError(f"the probe job {job_id} did not end in {PROBE_TIMEOUT_S:g} s")
            time.sleep(0.3)
        logs = client.get_job_logs(job_id)
    finally:
        with contextlib.suppress(Exception):  # a job still stopping: Ray's table keeps its row
            client.delete_job(job_id)
    for line in reversed(logs.splitlines()):
        if line.startswith(MARK):
            return dict(json.loads(line[len(MARK) :]))
    tail = " | ".join(line for line in logs.splitlines()[-3:] if line.strip())
    ended = status.split(".")[-1]
    raise RuntimeError(f"the probe job {job_id} ended {ended}: {tail or 'no output'}")


def probe_checks(probe: dict[str, Any], head_ray: str, key: str | None = None) -> list[Check]:
    """The probe's answer as checks: the storage root from the head, then each node's Ray,
    container tools (where jobs run in containers), GPUs and disk."""
    checks: list[Check] = []
    storage = probe.get("storage")
    if key is not None and storage is not None:
        if storage.get("read") == key:
            checks.append(Check("storage root (head)", OK, "the head reads what this client wrote"))
        else:
            checks.append(
                Check(
                    "storage root (head)",
                    FAIL,
                    "the head could not read the probe "
                    f"object this client wrote: {storage.get('error', 'other bytes')}",
                    "give the cluster's nodes the same storage root, with read "
                    "and write rights (credentials in `ray start`'s environment)",
                )
            )
    tools, runtime = list(probe.get("node_tools", [])), str(probe.get("runtime"))
    for node in probe.get("nodes", []):
        name = f"node {node['node_id'][:8]}" + (" (head)" if node.get("head") else "")
        if "error" in node:
            checks.append(
                Check(
                    f"ray {name}",
                    FAIL,
                    f"runs no task: {node['error']}",
                    "look at the node's raylet.out; restart Ray there",
                )
            )
            continue  # fmt: skip
        ray_there = str(node.get("ray"))
        if ray_there != head_ray:
            checks.append(
                Check(
                    f"ray {name}",
                    FAIL,
                    f"Ray {ray_there}, the head runs {head_ray}",
                    f"pip install '{ray_private.RAY_PACKAGE}=={head_ray}' on "
                    f"{node.get('address')} and restart Ray there",
                )
            )
        elif not node.get("orchestrator"):
            checks.append(
                Check(
                    f"ray {name}",
                    FAIL,
                    f"Ray {ray_there}; its Python has no "
                    "orchestrator, which every node runs jobs' agents with",
                    f"install orchestrator on {node.get('address')}",
                )
            )
        else:
            checks.append(Check(f"ray {name}", OK, f"Ray {ray_there}, Python "
                                f"{node.get('python')}"))  # fmt: skip
        if tools:
            checks.append(_tools_check(name, node, tools, runtime))
        checks.append(_gpu_check(name, node))
        checks.append(_disk_check(name, node))
    return checks


def _tools_check(name: str, node: dict[str, Any], tools: list[str], runtime: str) -> Check:
    """The programs the cluster's job runtime needs on every node (RuntimeKind.node_tools);
    runc only where the node's cgroups make podman use it (v1, node/podman.py)."""
    needed = [t for t in tools if not (t == "runc" and node.get("cgroup_v2"))]
    missing = [t for t in needed if not node.get(t)]
    item = f"{runtime} runtime {name}"
    if missing:
        return Check(item, FAIL, f"{' and '.join(missing)} not found, and this cluster runs "
                     f"jobs' commands with them (its job runtime is {runtime})",
                     f"apt-get install {' '.join(missing)} on {node.get('address')}")  # fmt: skip
    return Check(item, OK, ", ".join(f"{t} {node[t]}" for t in needed))


def _gpu_check(name: str, node: dict[str, Any]) -> Check:
    declared, seen = node.get("ray_gpus", 0.0), node.get("nvidia_smi_gpus")
    item = f"gpus {name}"
    if seen is None and not declared:
        return Check(item, OK, "none (no nvidia-smi, and Ray declares none)")
    if seen is None:
        return Check(item, FAIL, f"Ray declares {declared:g} GPU(s) but the node has no "
                     "nvidia-smi: a job given them finds no GPU",
                     "install NVIDIA's driver there, or start Ray with --num-gpus=0")  # fmt: skip
    if "nvidia_smi_error" in node:
        return Check(item, FAIL, f"nvidia-smi fails: {node['nvidia_smi_error']}",
                     "fix the NVIDIA driver on the node")  # fmt: skip
    if declared > seen:
        return Check(item, FAIL, f"Ray declares {declared:g} GPU(s), nvidia-smi sees {seen}",
                     f"start Ray there with --num-gpus={seen}")  # fmt: skip
    if declared < seen:
        return Check(
            item,
            WARN,
            f"nvidia-smi sees {seen} GPU(s), Ray declares {declared:g}: the others are never used",
            f"start Ray there with --num-gpus={seen}",
        )
    return Check(item, OK, f"{seen} (Ray and nvidia-smi agree)")  # fmt: skip


def _disk_check(name: str, node: dict[str, Any]) -> Check:
    free, where = int(node.get("free_bytes", 0)), node.get("node_root")
    text = f"{free / (1 << 30):.1f} GiB free under {where}"
    fix = "free space there, or point ORCHESTRATOR_NODE_ROOT at a larger disk"
    if free < DISK_FAIL_BYTES:
        return Check(f"disk {name}", FAIL, text, fix)
    if free < DISK_WARN_BYTES:
        return Check(f"disk {name}", WARN, text + ": little for weights and checkpoints", fix)
    return Check(f"disk {name}", OK, text)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:400] or type(error).__name__

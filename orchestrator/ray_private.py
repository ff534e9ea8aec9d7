"""Every call into Ray's private API, in one place.

Ray moves `ray._private` between releases without notice, and there is no public way to ask
these questions (free resources per node, every driver the GCS knows, the nodes being drained,
the dashboard address of the connected cluster). Each call is made here so that an upgrade
breaks one module, with an error that names the missing API and the Ray version
pyproject.toml pins, rather than deep inside the queue service.
"""

from __future__ import annotations

from typing import Any


class RayPrivateApiMissing(RuntimeError):
    pass


def available_resources_per_node() -> dict[str, dict[str, float]]:
    """Each live node's free resources, by node id (the GCS's view)."""
    return _private("ray._private.state", "available_resources_per_node")()


def driver_jobs() -> list[dict[str, Any]]:
    """Every Ray job (driver) the GCS knows, live or dead: its JobID and IsDead at least."""
    return _private("ray._private.state", "jobs")()


def draining_nodes() -> dict[str, float]:
    """The nodes being drained (preemption notice, autoscaler scale-down): node id -> the
    deadline, in ms since the epoch (0: none)."""
    return _private("ray._private.state", "state").get_draining_nodes()


def dashboard_address() -> str | None:
    """The dashboard (Job API) address of the cluster this process is connected to, as the
    dashboard itself published it in the GCS (a worker's own node info may say the default
    port, not the one the head was started with)."""
    published = _private("ray._private.services", "get_webui_url_from_internal_kv")()
    if published:
        return published
    worker = _private("ray._private.worker", "global_worker")
    return worker.node.address_info.get("webui_url")


def kv_get(key: bytes) -> bytes | None:
    """A value in the GCS's internal key-value store (it outlives any actor)."""
    return _private("ray.experimental.internal_kv", "_internal_kv_get")(key, namespace=_KV_NS)


def kv_put(key: bytes, value: bytes) -> None:
    _private("ray.experimental.internal_kv", "_internal_kv_put")(
        key, value, overwrite=True, namespace=_KV_NS
    )


_KV_NS = "orchestrator"


def put_job_row(job_id: str, fields: dict[str, Any]) -> None:
    """A job in the table Ray's Job API keeps (what the dashboard's Jobs page, `ray job list`
    and `ray job status` read), for a controller that is not a Ray job of its own. `fields` are
    Ray's JobInfo's: status (a JobStatus name), entrypoint, message, start_time, end_time,
    metadata, driver_node_id, driver_agent_http_address (where `ray job logs` is served)."""
    import importlib
    import json

    common = importlib.import_module("ray.dashboard.modules.job.common")
    try:
        info = common.JobInfo(**{**fields, "status": common.JobStatus(fields["status"])})
        key = common.JobInfoStorageClient.JOB_DATA_KEY.format(job_id=job_id)
        namespace = _private("ray._private.ray_constants", "KV_NAMESPACE_JOB")
    except (AttributeError, TypeError) as e:
        raise RayPrivateApiMissing(f"Ray's JobInfo is not what orchestrator knows: {e}") from e
    _private("ray.experimental.internal_kv", "_internal_kv_put")(
        key.encode(), json.dumps(info.to_json()).encode(), overwrite=True, namespace=namespace
    )


def end_job_row(job_id: str, status: str, message: str) -> None:
    """The job's row in Ray's Job API table (put_job_row) moved to its end, if it has one."""
    import importlib
    import json
    import time

    common = importlib.import_module("ray.dashboard.modules.job.common")
    key = common.JobInfoStorageClient.JOB_DATA_KEY.format(job_id=job_id).encode()
    namespace = _private("ray._private.ray_constants", "KV_NAMESPACE_JOB")
    raw = _private("ray.experimental.internal_kv", "_internal_kv_get")(key, namespace=namespace)
    if not raw:
        return
    fields = json.loads(raw)
    fields.update(status=status, message=message, end_time=int(time.time() * 1000))
    if fields.get("runtime_env_json") is not None:
        fields["runtime_env"] = json.loads(fields["runtime_env_json"])
    fields.pop("runtime_env_json", None)
    put_job_row(job_id, fields)


def job_driver_place() -> tuple[str, str, str]:
    """Where a Ray job's driver on this node would be: the node's dashboard agent (which
    serves `ray job logs`), the node id, and the log file's folder (the session's logs)."""
    import ray

    node = _private("ray._private.worker", "global_worker").node
    agent = f"http://{node.node_ip_address}:{node.dashboard_agent_listen_port}"
    return agent, ray.get_runtime_context().get_node_id(), node.get_logs_dir_path()


def prestart_workers(raylet: str, job_id: str, runtime_env: str, count: int, keep_s: int) -> None:
    """Have the raylet at `raylet` (host:port) start `count` idle workers of Ray job `job_id`
    (hex), with `runtime_env` (serialized, as the job's actors have it), kept `keep_s` seconds:
    the raylet's `PrestartWorkers` gRPC call, which Ray's Python API does not offer."""
    import ray

    try:
        from ray._private.grpc_utils import init_grpc_channel
        from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc
        from ray.core.generated.runtime_environment_pb2 import RuntimeEnvInfo
    except ImportError:
        raise RayPrivateApiMissing(
            f"this Ray ({ray.__version__}) has no raylet PrestartWorkers call, which "
            "orchestrator uses; install the Ray version orchestrator's pyproject.toml pins"
        ) from None
    if raylet not in _raylets:
        _raylets[raylet] = node_manager_pb2_grpc.NodeManagerServiceStub(init_grpc_channel(raylet))
    _raylets[raylet].PrestartWorkers(
        node_manager_pb2.PrestartWorkersRequest(
            language=common_pb2.Language.PYTHON, job_id=bytes.fromhex(job_id),
            runtime_env_info=RuntimeEnvInfo(serialized_runtime_env=runtime_env),
            keep_alive_duration_secs=keep_s, num_workers=count,
        ),
        timeout=10,
    )  # fmt: skip


_raylets: dict[str, Any] = {}  # raylet address: its gRPC stub, made once a process


def _private(module: str, name: str) -> Any:
    import importlib

    import ray

    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise RayPrivateApiMissing(
            f"this Ray ({ray.__version__}) has no {module}.{name}, which orchestrator needs; "
            "install the Ray version orchestrator's pyproject.toml pins"
        ) from None

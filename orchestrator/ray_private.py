"""Every call into Ray's private API, and the Ray versions orchestrator supports, in one place.

Ray moves `ray._private` between releases without notice, and there is no public way to ask
these questions (free resources per node, every driver the GCS knows, the nodes being drained,
the dashboard address of the connected cluster). Each call is made here, feature-detected, so
that a Ray without it costs a fallback or one error of ours, never a traceback from Ray:
- where a public way keeps the job correct (slower, or with less shown), the call takes it and
  says once, in the log, what is lost (`_lost`);
- where none does, it raises RayPrivateApiMissing, naming the Ray found and SUPPORTED_RAY.
tests/test_ray_versions.py runs each call with its API absent; tests/ray-floor-lane.sh runs a
smoke on the oldest Ray of the range, the main suite on the newest.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from orchestrator.errors import RayPrivateApiMissing, RayVersionError

__all__ = ["RayPrivateApiMissing", "RayVersionError"]

# pyproject.toml's Ray requirement (tests/test_ray_versions.py keeps the two one).
SUPPORTED_RAY = ">=2.52.1,<2.61"
RAY_PACKAGE = "ray[default,train,serve]"

_log = logging.getLogger(__name__)


# -- the versions ----------------------------------------------------------------------------


def ray_version() -> str:
    """The Ray this process imports."""
    import ray

    return str(ray.__version__)


def is_supported(version: str) -> bool:
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version) in SpecifierSet(SUPPORTED_RAY)
    except InvalidVersion:
        return False


def unsupported(version: str, whose: str = "this client's Ray") -> str | None:
    """One line when `version` is outside the range; None inside it."""
    if is_supported(version):
        return None
    return (f"{whose} is {version}, which orchestrator does not support (it supports "
            f"Ray {SUPPORTED_RAY}): install a Ray in that range, e.g. "
            f"pip install '{RAY_PACKAGE}{SUPPORTED_RAY}'")  # fmt: skip


def mismatch(client: str, cluster: str, address: str) -> str | None:
    """One line when this client's Ray is not the cluster's (a Ray client must match its
    cluster); None when they are the same release."""
    if client == cluster:
        return None
    fix = f"pip install '{RAY_PACKAGE}=={cluster}'"
    if not is_supported(cluster):
        fix = (f"upgrade the cluster to a Ray orchestrator supports ({SUPPORTED_RAY}) and "
               "install the same Ray here")  # fmt: skip
    return (f"this client runs Ray {client} and the cluster at {address} runs Ray {cluster}: "
            f"a client must match its cluster; {fix}")  # fmt: skip


def check_cluster_ray(cluster: str, address: str) -> None:
    """RayVersionError, before anything is submitted, when this client cannot talk to a
    cluster of Ray `cluster` (a different release, or one outside the range)."""
    said = mismatch(ray_version(), cluster, address)
    if said:
        raise RayVersionError(said)
    said = unsupported(cluster, f"the Ray of the cluster at {address}")
    if said:
        raise RayVersionError(said)


def init_mismatch(error: BaseException) -> RayVersionError | None:
    """Ray's own "Version mismatch" from `ray.init` (a paragraph), as one line of ours."""
    import re

    text = str(error)
    if "Version mismatch" not in text:
        return None
    cluster, here = [*re.findall(r"Ray: (\S+)", text), "?", "?"][:2]
    said = mismatch(here, cluster, os.environ.get("RAY_ADDRESS") or "RAY_ADDRESS")
    if said is None:  # the same Ray, another Python
        cluster, here = [*re.findall(r"Python: (\S+)", text), "?", "?"][:2]
        said = (f"this process runs Python {here} and the cluster Python {cluster}: Ray needs "
                f"the same Python on both; run this with Python {cluster}")  # fmt: skip
    return RayVersionError(said)


# -- the Job API ------------------------------------------------------------------------------


def cluster_version(client: Any) -> dict[str, Any]:
    """The cluster's `/api/version` (ray_version, session_name, ...), through a Ray
    JobSubmissionClient. Its `_do_request` sends the client's token and headers; without it,
    a plain HTTP GET with the token the client would send."""
    request = getattr(client, "_do_request", None)
    if request is not None:
        response = request("GET", "/api/version")
    else:
        import requests

        _lost("JobSubmissionClient._do_request",
              "the cluster's version is asked with a plain HTTP request (the client's own "
              "cookies and headers are not sent)")  # fmt: skip
        response = requests.get(
            client.get_address().rstrip("/") + "/api/version", headers=_token_header(),
            timeout=30,
        )  # fmt: skip
    if response.status_code != 200:
        raise RuntimeError(f"Request failed with status code {response.status_code}: "
                           f"{response.text}")  # fmt: skip
    return dict(response.json())


def _token_header() -> dict[str, str]:
    """What Ray's clients send when token auth is on: its token as a bearer token."""
    if os.environ.get("RAY_AUTH_MODE") != "token":
        return {}
    token = os.environ.get("RAY_AUTH_TOKEN", "").strip()
    if not token:
        path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or "~/.ray/auth_token").expanduser()
        try:
            token = path.read_text().strip()
        except OSError:
            return {}
    return {"Authorization": f"Bearer {token}"} if token else {}


def reset_token_cache() -> None:
    """Have Ray re-read RAY_AUTH_MODE and the token in this process (it reads them once, at
    import, and caches both): Ray's config and its token loader, in `ray._raylet`."""
    import sys

    if "ray._raylet" not in sys.modules:
        return  # Ray not imported yet: it reads the environment as it is when it is
    raylet = sys.modules["ray._raylet"]
    config = getattr(raylet, "Config", None)
    loader = getattr(raylet, "AuthenticationTokenLoader", None)
    if config is None or loader is None:
        raise RayPrivateApiMissing(
            f"this Ray ({ray_version()}) has no token authentication loader "
            "(ray._raylet.AuthenticationTokenLoader), which the embedded cluster's token "
            f"needs; orchestrator supports Ray {SUPPORTED_RAY}: "
            f"pip install '{RAY_PACKAGE}{SUPPORTED_RAY}'"
        )
    config.initialize("")  # the mode is cached with Ray's config
    loader.instance().reset_cache()


def serve_submission_client(address: str) -> Any:
    """Ray Serve's REST client (what `serve deploy` uses) for the dashboard at `address`."""
    return _private("ray.dashboard.modules.serve.sdk", "ServeSubmissionClient")(address)


# -- the GCS ----------------------------------------------------------------------------------


def available_resources_per_node() -> dict[str, dict[str, float]]:
    """Each live node's free resources, by node id (the GCS's view)."""
    return _private("ray._private.state", "available_resources_per_node")()


def driver_jobs() -> list[dict[str, Any]]:
    """Every Ray job (driver) the GCS knows, live or dead: its JobID and IsDead at least."""
    return _private("ray._private.state", "jobs")()


def draining_nodes() -> dict[str, float]:
    """The nodes being drained (preemption notice, autoscaler scale-down): node id -> the
    deadline, in ms since the epoch (0: none). Without Ray's call: none (a drained node's
    loss is still handled when it goes, only not before)."""
    try:
        state = _private("ray._private.state", "state")
        get = state.get_draining_nodes
    except (RayPrivateApiMissing, AttributeError):
        _lost("ray._private.state.state.get_draining_nodes",
              "a node's drain or preemption notice is not seen: its jobs recover when the "
              "node goes, not before")  # fmt: skip
        return {}
    return get()


def dashboard_address() -> str | None:
    """The dashboard (Job API) address of the cluster this process is connected to, as the
    dashboard itself published it in the GCS (a worker's own node info may say the default
    port, not the one the head was started with). None where this Ray tells neither."""
    try:
        published = _private("ray._private.services", "get_webui_url_from_internal_kv")()
    except RayPrivateApiMissing:
        published = None
    if published:
        return published
    try:
        worker = _private("ray._private.worker", "global_worker")
        return worker.node.address_info.get("webui_url")
    except (RayPrivateApiMissing, AttributeError):
        _lost("ray._private.services.get_webui_url_from_internal_kv",
              "the cluster's dashboard address is not known here: a job started here "
              "records none, and `orchestrator stop` must be given --address")  # fmt: skip
        return None


def session_name() -> str:
    """The connected cluster's session name (`session_2026-...`): RuntimeContext's, else (Ray
    2.52 has no get_session_name) the worker's node's."""
    import ray

    get = getattr(ray.get_runtime_context(), "get_session_name", None)
    if get is not None:
        return str(get())
    try:
        return str(_private("ray._private.worker", "global_worker").node.session_name)
    except AttributeError:
        raise _missing("RuntimeContext.get_session_name") from None


def kv_get(key: bytes) -> bytes | None:
    """A value in the GCS's internal key-value store (it outlives any actor)."""
    return _private("ray.experimental.internal_kv", "_internal_kv_get")(key, namespace=_KV_NS)


def kv_put(key: bytes, value: bytes) -> None:
    _private("ray.experimental.internal_kv", "_internal_kv_put")(
        key, value, overwrite=True, namespace=_KV_NS
    )


_KV_NS = "orchestrator"


# -- the dashboard's job table ----------------------------------------------------------------


def put_job_row(job_id: str, fields: dict[str, Any]) -> None:
    """A job in the table Ray's Job API keeps (what the dashboard's Jobs page, `ray job list`
    and `ray job status` read), for a controller that is not a Ray job of its own. `fields` are
    Ray's JobInfo's: status (a JobStatus name), entrypoint, message, start_time, end_time,
    metadata, driver_node_id, driver_agent_http_address (where `ray job logs` is served).
    Without Ray's table: no row (the job runs the same)."""
    import json

    try:
        common = _module("ray.dashboard.modules.job.common")
        put = _private("ray.experimental.internal_kv", "_internal_kv_put")
        namespace = _private("ray._private.ray_constants", "KV_NAMESPACE_JOB")
        info = common.JobInfo(**{**fields, "status": common.JobStatus(fields["status"])})
        key = common.JobInfoStorageClient.JOB_DATA_KEY.format(job_id=job_id)
        value = json.dumps(info.to_json())
    except (RayPrivateApiMissing, AttributeError, TypeError, ValueError) as e:
        _lost("ray.dashboard.modules.job.common.JobInfo",
              f"jobs whose controller is hosted have no row in the dashboard's Jobs page "
              f"nor in `ray job list` ({e})")  # fmt: skip
        return
    put(key.encode(), value.encode(), overwrite=True, namespace=namespace)


def end_job_row(job_id: str, status: str, message: str) -> None:
    """The job's row in Ray's Job API table (put_job_row) moved to its end, if it has one."""
    import json
    import time

    try:
        common = _module("ray.dashboard.modules.job.common")
        get = _private("ray.experimental.internal_kv", "_internal_kv_get")
        namespace = _private("ray._private.ray_constants", "KV_NAMESPACE_JOB")
        key = common.JobInfoStorageClient.JOB_DATA_KEY.format(job_id=job_id).encode()
    except (RayPrivateApiMissing, AttributeError):
        return  # put_job_row said what is lost
    raw = get(key, namespace=namespace)
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

    worker = _private("ray._private.worker", "global_worker")
    try:
        node = worker.node
        agent = f"http://{node.node_ip_address}:{node.dashboard_agent_listen_port}"
        logs = node.get_logs_dir_path()
    except AttributeError as e:
        raise _missing(f"ray._private.worker.global_worker.node's {e.name}") from None
    return agent, ray.get_runtime_context().get_node_id(), logs


# -- the raylet -------------------------------------------------------------------------------


def prestart_workers(raylet: str, job_id: str, runtime_env: str, count: int, keep_s: int) -> None:
    """Have the raylet at `raylet` (host:port) start `count` idle workers of Ray job `job_id`
    (hex), with `runtime_env` (serialized, as the job's actors have it), kept `keep_s` seconds:
    the raylet's `PrestartWorkers` gRPC call, which Ray's Python API does not offer. Without
    it: nothing (a job's actors start their workers themselves, a second or two later)."""
    try:
        from ray._private.grpc_utils import init_grpc_channel
        from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc
        from ray.core.generated.runtime_environment_pb2 import RuntimeEnvInfo

        node_manager_pb2.PrestartWorkersRequest  # noqa: B018 (older Rays lack the call)
    except (ImportError, AttributeError):
        _lost("the raylet's PrestartWorkers call",
              "no worker is started ahead of a job's actors: each job starts a second or two "
              "slower")  # fmt: skip
        return
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


# -- feature detection ------------------------------------------------------------------------


def _private(module: str, name: str) -> Any:
    try:
        return getattr(_module(module), name)
    except AttributeError:
        raise _missing(f"{module}.{name}") from None


def _module(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise _missing(module) from None


def _missing(api: str) -> RayPrivateApiMissing:
    return RayPrivateApiMissing(
        f"this Ray ({ray_version()}) has no {api}, which orchestrator needs; orchestrator "
        f"supports Ray {SUPPORTED_RAY}: pip install '{RAY_PACKAGE}{SUPPORTED_RAY}' (the "
        "cluster's release)"
    )


_told: set[str] = set()  # the APIs whose loss this process has said


def _lost(api: str, what: str) -> None:
    """Say once per process that this Ray lacks `api` and what doing without it costs."""
    if api in _told:
        return
    _told.add(api)
    _log.warning("this Ray (%s) has no %s: %s", ray_version(), api, what)

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

"""The secret store actor on the session's local cluster: what a node agent's `resolve_secret`
gets, team scoping, the environment after the store, and a missing secret named."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from conftest import NODE_SECRET_NAME, NODE_SECRET_VALUE, ray_driver

from orchestrator.actor_names import NAMESPACE
from orchestrator.agents.secret_service import SECRET_SERVICE_NAME, start_secret_service
from orchestrator.cluster.local import LocalClusterInfo
from orchestrator.storage.secret_store import FileSecretStore

CLUSTER_VALUE = "cluster-wide-3e9f0a1b"
ALPHA_VALUE = "alpha-team-7c2d5e8f"
ALPHA_ONLY = "alpha-only-b4a6c0d2"
LATER = "set-later-91e3f5a7"


@pytest.fixture
def driver(ray_cluster: LocalClusterInfo, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with ray_driver(ray_cluster, monkeypatch, "secret-service-test"):
        yield


def service_running() -> bool:
    try:
        ray.get_actor(SECRET_SERVICE_NAME, namespace=NAMESPACE)
    except ValueError:
        return False
    return True


@ray.remote(num_cpus=0)
def _lookup(name: str, team: str | None) -> tuple[str, str]:
    """On a node, as the node agent does it."""
    from orchestrator.node.secrets import SecretNotFound, SecretStoreError, resolve_secret

    try:
        return "value", resolve_secret(name, team)
    except SecretNotFound as e:
        return "missing", str(e)
    except SecretStoreError as e:
        return "unusable", str(e)


def lookup(name: str, team: str | None = None) -> tuple[str, str]:
    return ray.get(_lookup.remote(name, team), timeout=60)


@pytest.mark.timeout(180)
def test_nodes_read_the_head_nodes_store_through_the_actor(driver, orchestrator_home: Path):
    started_here = not service_running()
    actor = start_secret_service()
    assert start_secret_service()._actor_id == actor._actor_id  # one per cluster
    store = FileSecretStore(orchestrator_home / "secrets")
    assert ray.get(actor.directory.remote(), timeout=60) == str(store.directory)
    written = [("svc_shared", None), ("svc_shared", "alpha"), ("svc_alpha_only", "alpha"),
               ("svc_later", None), (NODE_SECRET_NAME, "alpha")]  # fmt: skip
    try:
        store.set("svc_shared", CLUSTER_VALUE)
        store.set("svc_shared", ALPHA_VALUE, team="alpha")
        store.set("svc_alpha_only", ALPHA_ONLY, team="alpha")

        assert lookup("svc_shared", "alpha") == ("value", ALPHA_VALUE)
        assert lookup("svc_shared", "beta") == ("value", CLUSTER_VALUE)
        assert lookup("svc_shared") == ("value", CLUSTER_VALUE)
        assert lookup("svc_alpha_only", "alpha") == ("value", ALPHA_ONLY)

        # Never another team's, and a job without a team reads only cluster-wide secrets.
        assert lookup("svc_alpha_only", "beta") == (
            "missing",
            "secret 'svc_alpha_only' is not set for team 'beta' in the secret store "
            "(orchestrator secrets set svc_alpha_only --team beta) "
            "nor as ORCHESTRATOR_SECRET_SVC_ALPHA_ONLY on this node",
        )
        assert lookup("svc_alpha_only") == (
            "missing",
            "secret 'svc_alpha_only' is not set in the secret store "
            "(orchestrator secrets set svc_alpha_only) "
            "nor as ORCHESTRATOR_SECRET_SVC_ALPHA_ONLY on this node",
        )

        # The nodes' environment answers after the store; the store wins where both have it.
        assert lookup(NODE_SECRET_NAME, "alpha") == ("value", NODE_SECRET_VALUE)
        store.set(NODE_SECRET_NAME, ALPHA_VALUE, team="alpha")
        assert lookup(NODE_SECRET_NAME, "alpha") == ("value", ALPHA_VALUE)

        # `secrets set` and `delete` apply to the next lookup, without restarting anything.
        assert lookup("svc_later")[0] == "missing"
        store.set("svc_later", LATER)
        assert lookup("svc_later") == ("value", LATER)
        store.delete("svc_shared", team="alpha")
        assert lookup("svc_shared", "alpha") == ("value", CLUSTER_VALUE)

        # A store other users could read is refused, not read, and not taken for "not set".
        os.chmod(store.directory / "default", 0o755)
        kind, message = lookup("svc_shared")
        assert kind == "unusable" and f"chmod 700 {store.directory / 'default'}" in message
        assert CLUSTER_VALUE not in message
    finally:
        os.chmod(store.directory / "default", 0o700)
        for name, team in written:
            store.delete(name, team)
        if started_here:
            ray.kill(actor)

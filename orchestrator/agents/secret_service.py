"""The secret store's one reader on the cluster: an actor on the head node, where the store is.

`orchestrator secrets set` writes the store on the head node's disk; node agents on other nodes
cannot read that disk, so they ask this actor. Values travel only as the return values of its
calls, never in names, options, runtime environments, logs or exceptions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from orchestrator.agents.services import NAMESPACE, shared_actor
from orchestrator.errors import OrchestratorError
from orchestrator.storage.secret_store import FileSecretStore, SecretStoreError, store_description

SECRET_SERVICE_NAME = "orchestrator-secret-store"
_LOOKUP_TIMEOUT_S = 60  # a file read; anything near this means the head node is in trouble


class SecretStoreActor:
    """Reads the `FileSecretStore` of its node on every call: `secrets set` and `delete` apply to
    the next job without restarting anything."""

    def __init__(self, directory: str | None = None) -> None:
        self._directory = directory

    def get(self, name: str, team: str | None = None) -> str | None:
        # The directory is worked out per call so that a misplaced store (SecretStoreError) is
        # reported to each caller rather than killing the actor.
        return FileSecretStore(Path(self._directory) if self._directory else None).get(name, team)

    def directory(self) -> str:
        return str(FileSecretStore(Path(self._directory) if self._directory else None).directory)


def start_secret_service(directory: str | None = None) -> Any:
    """The cluster's secret store actor, started on this node (the head) if it is not running.

    Call it from a process connected to Ray on the node that holds the store. `directory`
    (default: this node's `default_secrets_dir()`, evaluated in the actor) only counts for the
    call that starts it.
    """
    return shared_actor(
        SecretStoreActor,
        SECRET_SERVICE_NAME,
        pinned_here=True,
        max_concurrency=8,
        args=(directory,),
    )


class ClusterSecretStore:
    """The `SecretSource` that asks the head node's store through `SecretStoreActor`.

    Without Ray, or with no actor running, it has nothing (`available` says which).
    """

    def __init__(self) -> None:
        self._actor = _find_actor()

    @property
    def available(self) -> bool:
        return self._actor is not None

    def get(self, name: str, team: str | None = None) -> str | None:
        if self._actor is None:
            return None
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        try:
            return ray.get(self._actor.get.remote(name, team), timeout=_LOOKUP_TIMEOUT_S)
        except RayTaskError as e:
            if isinstance(e.cause, OrchestratorError):
                raise SecretStoreError(f"the secret store on the head node: {e.cause}") from None
            raise
        except (RayActorError, GetTimeoutError) as e:
            raise SecretStoreError(
                f"the secret store on the head node did not answer when asked for {name!r} "
                f"({type(e).__name__}); retry the job, and check the head node if it persists"
            ) from None

    def describe(self, name: str, team: str | None = None) -> str:
        return store_description(name, team)


def _find_actor() -> Any:
    import ray

    if not ray.is_initialized():
        return None
    try:
        return ray.get_actor(SECRET_SERVICE_NAME, namespace=NAMESPACE)
    except ValueError:
        return None

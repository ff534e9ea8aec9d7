"""The secret store's one reader on the cluster: an actor on the head node, where the store is.

`orchestrator secrets set` writes the store on the head node's disk; node agents on other nodes
cannot read that disk, so they ask this actor. Values travel only as the return values of its
calls, never in names, options, runtime environments, logs or exceptions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from orchestrator import actor_names
from orchestrator.agents.services import shared_actor
from orchestrator.storage.secret_store import FileSecretStore

SECRET_SERVICE_NAME = actor_names.SECRET_STORE


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

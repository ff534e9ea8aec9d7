"""Which Ray cluster and storage root a client talks to."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from orchestrator.storage.root import StorageRoot, default_storage_root

if TYPE_CHECKING:
    from ray.job_submission import JobSubmissionClient


@dataclass(frozen=True)
class Connection:
    """A Ray dashboard (Job API) address, and whether it is our embedded local cluster."""

    address: str
    embedded: bool
    token_file: str | None = None  # the embedded cluster's token (cluster/auth.py)
    roots_inbox: str | None = None  # the embedded cluster's (scheduler/roots_inbox.py)

    @property
    def on_this_machine(self) -> bool:
        host = urlsplit(self.address).hostname or ""
        return host in ("127.0.0.1", "localhost", "::1")

    def client(self) -> JobSubmissionClient:
        from ray.job_submission import JobSubmissionClient

        token = self.token_file or (self._embedded_token() if self.on_this_machine else None)
        named = (
            os.environ.get("RAY_AUTH_TOKEN_PATH")
            if os.environ.get("RAY_AUTH_MODE") == "token"
            else None
        )
        if self.embedded or token:
            from orchestrator.cluster.local import use_embedded_env

            use_embedded_env(token)
        elif self.on_this_machine and named:  # a cluster of this machine started with a token
            from orchestrator.cluster.auth import use_token

            use_token(Path(named))  # the file named now, for Ray's per-process loader
        elif self.on_this_machine:
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        return JobSubmissionClient(self.address)

    def _embedded_token(self) -> str | None:
        """The embedded cluster's token file where `address` is that cluster's (given as an
        address, from `orchestrator cluster status`)."""
        from orchestrator.cluster.local import LocalCluster

        info = LocalCluster().recorded()
        if info is not None and info.dashboard_url == self.address.rstrip("/"):
            return info.token_file
        return None


def connect(address: str | None = None) -> Connection:
    """`address`, else $RAY_ADDRESS, else the embedded local cluster (started if needed)."""
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        if "://" not in address:
            address = f"http://{address}"
        return Connection(address=address, embedded=False)
    from orchestrator.cluster.local import LocalCluster

    cluster = LocalCluster()
    info = cluster.ensure_running()
    return Connection(address=info.dashboard_url, embedded=True, token_file=info.token_file,
                      roots_inbox=str(cluster.roots_inbox))  # fmt: skip


def storage(storage_root: str | None = None) -> StorageRoot:
    return StorageRoot(storage_root or default_storage_root())

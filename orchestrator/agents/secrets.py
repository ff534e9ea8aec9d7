"""Resolving `SecretReference`s where the commands run, and keeping their values out of logs.

A secret is looked up in each of `secret_sources()` in turn: the cluster's secret store (on the
head node, scoped by team), then the node's environment (ORCHESTRATOR_SECRET_<NAME>).
"""

from __future__ import annotations

import re

from orchestrator.agents.secret_service import ClusterSecretStore
from orchestrator.errors import OrchestratorError
from orchestrator.storage.secret_store import (
    SECRET_ENV_PREFIX,
    EnvSecrets,
    SecretSource,
    SecretStoreError,
    secret_env_name,
)

__all__ = [
    "SECRET_ENV_PREFIX",
    "SecretMasker",
    "SecretNotFound",
    "SecretStoreError",
    "resolve_secret",
    "secret_env_name",
    "secret_sources",
]


class SecretNotFound(OrchestratorError):
    """No source has the secret; the message names it and every place that was asked."""


def secret_sources() -> list[SecretSource]:
    """Where secrets come from, first match wins. A cloud secret manager would be added here."""
    store = ClusterSecretStore()
    return [store, EnvSecrets()] if store.available else [EnvSecrets()]


def resolve_secret(name: str, team: str | None = None) -> str:
    """The value a job of `team` gets for `name`; SecretNotFound (naming where it looked) if none.

    SecretStoreError if the store cannot be read (unsafe permissions, head node gone).
    """
    sources = secret_sources()
    for source in sources:
        value = source.get(name, team)
        if value is not None:
            return value
    looked = " nor ".join(source.describe(name, team) for source in sources)
    if not any(isinstance(source, ClusterSecretStore) for source in sources):
        looked += " (and no secret store is running on this cluster to ask)"
    raise SecretNotFound(f"secret {name!r} is not set {looked}")


class SecretMasker:
    """Replaces every known secret value in a line with `*****`.

    Output is masked line by line, so a value of several lines (a PEM key, a JSON credential) is
    also masked line by line. Pieces shorter than 4 characters are left: masking them would
    garble ordinary output and hide nothing.
    """

    def __init__(self, values: list[str]) -> None:
        pieces = {v for v in values} | {ln.strip() for v in values for ln in v.splitlines()}
        longest_first = sorted({p for p in pieces if len(p) >= 4}, key=len, reverse=True)
        self._pattern = (
            re.compile("|".join(map(re.escape, longest_first))) if longest_first else None
        )

    def __call__(self, line: str) -> str:
        return self._pattern.sub("*****", line) if self._pattern else line

"""Resolving `SecretReference`s where the commands run, and keeping their values out of logs.

A secret is looked up in each of `secret_sources()` in turn: the cluster's secret store (on the
head node, scoped by team), then the node's environment (ORCHESTRATOR_SECRET_<NAME>).
"""

from __future__ import annotations

import codecs
import re
from typing import Any

from orchestrator import actor_names
from orchestrator.errors import OrchestratorError, SecretNotFound, SecretStoreError
from orchestrator.storage.secret_store import (
    SECRET_ENV_PREFIX,
    EnvSecrets,
    SecretSource,
    secret_env_name,
    store_description,
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
        self.pieces = sorted({p for p in pieces if len(p) >= 4}, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, self.pieces))) if self.pieces else None

    def __call__(self, line: str) -> str:
        return self._pattern.sub("*****", line) if self._pattern else line

    @property
    def pattern(self) -> re.Pattern[str] | None:
        """What matches any secret piece (None with no secrets)."""
        return self._pattern

    def open_end(self, text: str) -> int:
        """Length of the longest end of `text` that begins some secret (0 if none): output cut
        there could show the start of a secret whose rest comes later."""
        return max((_overlap(text, piece) for piece in self.pieces), default=0)


class StreamMasker:
    """Masks secrets in a byte stream cut anywhere (a terminal's output, read as it comes).

    A chunk may end inside a secret, so the tail that could be the start of one is held back
    until the next chunk says whether it is; `final=True` lets the rest out.
    """

    def __init__(self, masker: SecretMasker) -> None:
        self._masker = masker
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""

    def feed(self, data: bytes, final: bool = False) -> bytes:
        text = self._masker(self._held + self._decoder.decode(data, final))
        hold = 0 if final else self._masker.open_end(text)
        self._held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold].encode()


def _overlap(text: str, piece: str) -> int:
    """The longest k < len(piece) with text ending in piece[:k]."""
    for k in range(min(len(piece) - 1, len(text)), 0, -1):
        if text.endswith(piece[:k]):
            return k
    return 0


_LOOKUP_TIMEOUT_S = 60  # a file read; anything near this means the head node is in trouble


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
        return ray.get_actor(actor_names.SECRET_STORE, namespace=actor_names.NAMESPACE)
    except ValueError:
        return None

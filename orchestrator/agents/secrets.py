"""Resolving `SecretReference`s where the commands run, and keeping their values out of logs."""

from __future__ import annotations

import os
import re

from orchestrator.errors import OrchestratorError

SECRET_ENV_PREFIX = "ORCHESTRATOR_SECRET_"


class SecretNotFound(OrchestratorError):
    pass


def secret_env_name(name: str) -> str:
    """`hf_access_token` -> `ORCHESTRATOR_SECRET_HF_ACCESS_TOKEN`."""
    return SECRET_ENV_PREFIX + re.sub(r"[^A-Za-z0-9]", "_", name).upper()


def resolve_secret(name: str) -> str:
    value = os.environ.get(secret_env_name(name))
    if value is None:
        raise SecretNotFound(
            f"secret {name!r} is not set on this node: export {secret_env_name(name)} "
            "in the environment the Ray node was started with"
        )
    return value


class SecretMasker:
    """Replaces every known secret value in a line with `*****`."""

    def __init__(self, values: list[str]) -> None:
        longest_first = sorted({v for v in values if len(v) >= 4}, key=len, reverse=True)
        self._pattern = (
            re.compile("|".join(map(re.escape, longest_first))) if longest_first else None
        )

    def __call__(self, line: str) -> str:
        return self._pattern.sub("*****", line) if self._pattern else line

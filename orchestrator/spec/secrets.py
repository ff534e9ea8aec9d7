"""A reference to a secret, resolved on the node at process start and never stored as a value."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator

from orchestrator.spec.base import StrictModel

_SECRET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_secret_name(value: str) -> str:
    if not _SECRET_NAME.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a secret name: use letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    return value


SecretName = Annotated[str, AfterValidator(check_secret_name)]


class SecretReference(StrictModel):
    """Names a secret; the value is looked up where the job runs (see docs/configuration.md)."""

    name: SecretName

    def __str__(self) -> str:
        return f"secret:{self.name}"

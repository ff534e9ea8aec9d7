"""Read-only inputs (model weights, datasets) placed on every node: truss's `WeightsSource`."""

from __future__ import annotations

import enum
import posixpath
import re
from typing import Any
from urllib.parse import urlsplit

from pydantic import Field, StrictStr, field_validator, model_validator

from orchestrator.spec.base import ConfigModel, FieldProblem, StrictModel, check_job_directory
from orchestrator.spec.secrets import SecretName

SUPPORTED_SCHEMES = ("hf", "s3", "gs", "r2", "cw", "azure", "https")

_HF_SOURCE = re.compile(
    r"^hf://(?:(?:datasets|spaces|models)/)?[\w.-]+(?:/[\w.-]+)?(?:@(?P<revision>[^@\s/][^@\s]*))?$"
)


class WeightsAuthMethod(str, enum.Enum):
    CUSTOM_SECRET = "CUSTOM_SECRET"
    AWS_OIDC = "AWS_OIDC"
    GCP_OIDC = "GCP_OIDC"
    AWS_ASSUME_ROLE = "AWS_ASSUME_ROLE"


_AUTH_FIELDS: dict[WeightsAuthMethod, tuple[str, ...]] = {
    WeightsAuthMethod.CUSTOM_SECRET: ("auth_secret_name",),
    WeightsAuthMethod.AWS_OIDC: ("aws_oidc_role_arn", "aws_oidc_region"),
    WeightsAuthMethod.GCP_OIDC: ("gcp_oidc_service_account", "gcp_oidc_workload_id_provider"),
    WeightsAuthMethod.AWS_ASSUME_ROLE: ("aws_assume_role_arn", "aws_assume_role_region"),
}


class WeightsAuth(StrictModel):
    """How to authenticate to a weights source: exactly the fields of one method."""

    auth_method: WeightsAuthMethod
    auth_secret_name: SecretName | None = None
    aws_oidc_role_arn: StrictStr | None = None
    aws_oidc_region: StrictStr | None = None
    gcp_oidc_service_account: StrictStr | None = None
    gcp_oidc_workload_id_provider: StrictStr | None = None
    aws_assume_role_arn: StrictStr | None = None
    aws_assume_role_region: StrictStr | None = None

    @field_validator("auth_method", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        if isinstance(value, str) and not isinstance(value, WeightsAuthMethod):
            try:
                return WeightsAuthMethod(value.upper())
            except ValueError:
                allowed = ", ".join(m.value for m in WeightsAuthMethod)
                raise ValueError(f"{value!r} is not one of {allowed}") from None
        return value

    @model_validator(mode="after")
    def _fields_match_method(self) -> WeightsAuth:
        needed = _AUTH_FIELDS[self.auth_method]
        missing = [f for f in needed if not getattr(self, f)]
        if missing:
            also = f" (so are {', '.join(missing[1:])})" if missing[1:] else ""
            raise FieldProblem(
                (missing[0],), f"is required with auth_method {self.auth_method.value}{also}"
            )
        foreign = [
            f
            for fields in _AUTH_FIELDS.values()
            for f in fields
            if f not in needed and getattr(self, f) is not None
        ]
        if foreign:
            raise FieldProblem(
                (foreign[0],), f"does not belong to auth_method {self.auth_method.value}"
            )
        return self


class WeightsSource(ConfigModel):
    """A source mirrored once and placed read-only at `mount_location` on every node."""

    source: StrictStr = Field(min_length=1)
    mount_location: StrictStr = Field(min_length=1)
    auth: WeightsAuth | None = None
    auth_secret_name: SecretName | None = None
    allow_patterns: list[StrictStr] | None = None
    ignore_patterns: list[StrictStr] | None = None

    @field_validator("source")
    @classmethod
    def _check_source(cls, value: str) -> str:
        scheme, sep, rest = value.partition("://")
        if not sep:
            raise ValueError(f"{value!r} has no scheme: write for example 's3://bucket/path'")
        if scheme not in SUPPORTED_SCHEMES:
            allowed = ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES)
            raise ValueError(f"scheme {scheme}:// is not supported; use one of {allowed}")
        if scheme == "hf":
            if not _HF_SOURCE.fullmatch(value):
                raise ValueError(
                    f"{value!r} is not a Hugging Face source: write hf://owner/repo[@revision]"
                )
            return value
        if "@" in value:
            raise ValueError("a revision (@...) is only allowed on hf:// sources")
        if scheme == "https":
            if not urlsplit(value).netloc or not urlsplit(value).path.strip("/"):
                raise ValueError(f"{value!r} needs a host and a file path: https://host/file")
            return value
        bucket, _, path = rest.partition("/")
        if not bucket or not path or path.startswith("/"):
            shape = {
                "r2": "r2://account_id.bucket/path",
                "azure": "azure://account/container/path",
            }.get(scheme, f"{scheme}://bucket/path")
            raise ValueError(f"{value!r} needs a bucket and a path: {shape}")
        if scheme == "r2" and "." not in bucket:
            raise ValueError(f"{value!r} must name the account: r2://account_id.bucket/path")
        if scheme == "azure" and "/" not in path.strip("/"):
            raise ValueError(
                f"{value!r} needs a container and a path: azure://account/container/path"
            )
        return value

    @field_validator("mount_location")
    @classmethod
    def _check_mount(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"{value!r} must be an absolute path such as /app/models/llama")
        if ".." in value.split("/") or not value.strip("/"):
            raise ValueError(f"{value!r} must be a directory below / without '..'")
        return check_job_directory(value)

    @model_validator(mode="after")
    def _one_secret_name(self) -> WeightsSource:
        if self.auth_secret_name and self.auth and self.auth.auth_secret_name:
            raise FieldProblem(("auth_secret_name",), "set this or auth.auth_secret_name, not both")
        return self

    @property
    def scheme(self) -> str:
        return self.source.partition("://")[0]

    @property
    def is_huggingface(self) -> bool:
        return self.scheme == "hf"

    @property
    def secret_name(self) -> str | None:
        """The secret holding this source's credentials, from either place it can be named."""
        return self.auth_secret_name or (self.auth.auth_secret_name if self.auth else None)

    @property
    def normalized_mount(self) -> str:
        return "/" + posixpath.normpath(self.mount_location).lstrip("/")

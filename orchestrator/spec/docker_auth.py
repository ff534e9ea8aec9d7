"""Credentials for pulling a private base image: truss's `DockerAuth` and its variants."""

from __future__ import annotations

import enum

from pydantic import Field, StrictStr, model_validator

from orchestrator.spec.base import FieldProblem, StrictModel, lenient_enum
from orchestrator.spec.secrets import SecretReference

NonEmpty = Field(min_length=1)


class DockerAuthType(str, enum.Enum):
    GCP_SERVICE_ACCOUNT_JSON = "GCP_SERVICE_ACCOUNT_JSON"
    AWS_IAM = "AWS_IAM"
    AWS_OIDC = "AWS_OIDC"
    GCP_OIDC = "GCP_OIDC"
    REGISTRY_SECRET = "REGISTRY_SECRET"
    AWS_ASSUME_ROLE = "AWS_ASSUME_ROLE"


class AWSIAMDockerAuth(StrictModel):
    access_key_secret_ref: SecretReference
    secret_access_key_secret_ref: SecretReference


class AWSOIDCDockerAuth(StrictModel):
    role_arn: StrictStr = NonEmpty
    region: StrictStr = NonEmpty


class AWSAssumeRoleDockerAuth(StrictModel):
    role_arn: StrictStr = NonEmpty
    region: StrictStr = NonEmpty


class GCPOIDCDockerAuth(StrictModel):
    service_account: StrictStr = NonEmpty
    workload_identity_provider: StrictStr = NonEmpty


class GCPServiceAccountJSONDockerAuth(StrictModel):
    service_account_json_secret_ref: SecretReference


class RegistrySecretDockerAuth(StrictModel):
    """A secret holding `username:password` (Docker Hub, GHCR, NGC)."""

    secret_ref: SecretReference


_SUB_CONFIG = {
    DockerAuthType.AWS_IAM: "aws_iam_docker_auth",
    DockerAuthType.AWS_OIDC: "aws_oidc_docker_auth",
    DockerAuthType.AWS_ASSUME_ROLE: "aws_assume_role_docker_auth",
    DockerAuthType.GCP_OIDC: "gcp_oidc_docker_auth",
    DockerAuthType.GCP_SERVICE_ACCOUNT_JSON: "gcp_service_account_json_docker_auth",
    DockerAuthType.REGISTRY_SECRET: "registry_secret_docker_auth",
}


class DockerAuth(StrictModel):
    """Exactly the one sub-config matching `auth_method` must be set."""

    auth_method: lenient_enum(DockerAuthType)  # type: ignore[valid-type]
    registry: StrictStr
    aws_iam_docker_auth: AWSIAMDockerAuth | None = None
    aws_oidc_docker_auth: AWSOIDCDockerAuth | None = None
    aws_assume_role_docker_auth: AWSAssumeRoleDockerAuth | None = None
    gcp_oidc_docker_auth: GCPOIDCDockerAuth | None = None
    gcp_service_account_json_docker_auth: GCPServiceAccountJSONDockerAuth | None = None
    registry_secret_docker_auth: RegistrySecretDockerAuth | None = None

    @model_validator(mode="after")
    def _one_sub_config(self) -> DockerAuth:
        wanted = _SUB_CONFIG[self.auth_method]
        if getattr(self, wanted) is None:
            raise FieldProblem((wanted,), f"is required with auth_method {self.auth_method.value}")
        others = [f for f in _SUB_CONFIG.values() if f != wanted and getattr(self, f) is not None]
        if others:
            raise FieldProblem(
                (others[0],), f"must not be set with auth_method {self.auth_method.value}"
            )
        return self

    def secret_references(self) -> list[SecretReference]:
        sub = getattr(self, _SUB_CONFIG[self.auth_method])
        return [v for v in vars(sub).values() if isinstance(v, SecretReference)]

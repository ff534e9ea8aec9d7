"""Writing checkpoints and loading checkpoints of earlier jobs into a new one."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, StrictBool, StrictInt, StrictStr, model_validator

from orchestrator.spec.base import (
    DisplayName,
    FieldProblem,
    JobDirectory,
    SafeName,
    StrictModel,
)

# Baseten's default. On a shared node it would mix jobs, so orchestrator makes it job-private.
DEFAULT_DOWNLOAD_FOLDER = "/tmp/loaded_checkpoints"


class CheckpointingConfig(StrictModel):
    """`enabled` gives every node `$BT_CHECKPOINT_DIR`, uploaded in the background."""

    enabled: StrictBool = False
    checkpoint_path: JobDirectory | None = None
    volume_size_gib: StrictInt | None = Field(default=None, gt=0)


class _BasetenLatestCheckpoint(StrictModel):
    """The newest checkpoint of a job, or of a project's most recent job that has one.

    With neither set it means the newest checkpoint of the pushing project.
    """

    typ: Literal["baseten_latest_checkpoint"] = "baseten_latest_checkpoint"
    job_id: SafeName | None = None
    project_name: DisplayName | None = None  # the project's name or its id


class _BasetenNamedCheckpoint(StrictModel):
    typ: Literal["baseten_named_checkpoint"] = "baseten_named_checkpoint"
    checkpoint_name: SafeName
    job_id: SafeName


class _LoopsCheckpoint(StrictModel):
    """A Baseten Loops run's checkpoint. Accepted so configs load; orchestrator cannot fetch it."""

    typ: Literal["loops_checkpoint"] = "loops_checkpoint"
    run_id: StrictStr
    checkpoint_name: StrictStr
    target: Literal["trainer", "sampler"] = "trainer"


CheckpointReference = Annotated[
    Union[_BasetenLatestCheckpoint, _BasetenNamedCheckpoint, _LoopsCheckpoint],  # noqa: UP007
    Field(discriminator="typ"),
]


class BasetenCheckpoint:
    """Factories for references to checkpoints of earlier jobs."""

    @classmethod
    def from_latest_checkpoint(
        cls, project_name: str | None = None, job_id: str | None = None
    ) -> _BasetenLatestCheckpoint:
        if project_name is None and job_id is None:
            raise ValueError(
                "BasetenCheckpoint.from_latest_checkpoint needs project_name, job_id or both"
            )
        return _BasetenLatestCheckpoint(project_name=project_name, job_id=job_id)

    @classmethod
    def from_named_checkpoint(cls, checkpoint_name: str, job_id: str) -> _BasetenNamedCheckpoint:
        return _BasetenNamedCheckpoint(checkpoint_name=checkpoint_name, job_id=job_id)


class LoopsCheckpoint:
    @classmethod
    def from_checkpoint(
        cls, run_id: str, checkpoint_name: str, target: Literal["trainer", "sampler"] = "trainer"
    ) -> _LoopsCheckpoint:
        return _LoopsCheckpoint(run_id=run_id, checkpoint_name=checkpoint_name, target=target)


class LoadCheckpointConfig(StrictModel):
    """Checkpoints fetched to `download_folder` ($BT_LOAD_CHECKPOINT_DIR) before the code runs."""

    enabled: StrictBool = False
    checkpoints: list[CheckpointReference] = Field(
        default_factory=lambda: [_BasetenLatestCheckpoint()]
    )
    download_folder: JobDirectory = DEFAULT_DOWNLOAD_FOLDER

    @model_validator(mode="after")
    def _some_checkpoint(self) -> LoadCheckpointConfig:
        if self.enabled and not self.checkpoints:
            raise FieldProblem(("checkpoints",), "is empty but enabled is true: name at least one")
        return self

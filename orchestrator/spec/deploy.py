"""Deploy-side definitions (serving trained checkpoints). Accepted so configs load.

orchestrator has no deploy verb yet: these models validate and round-trip, nothing more.
"""

from __future__ import annotations

import enum
from typing import Literal, Union

from pydantic import Field, StrictStr, model_validator

from orchestrator.spec.base import AbsolutePath, ConfigModel, FieldProblem, SafeName, StrictModel
from orchestrator.spec.training import Compute, EnvValue

LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


class ModelWeightsFormat(str, enum.Enum):
    LORA = "lora"
    FULL = "full"
    WHISPER = "whisper"


class LoRADetails(ConfigModel):
    # Any rank, as truss 0.18.36 (its docs still list LORA_RANKS, which vLLM serves).
    rank: int = Field(default=16, ge=1)


class Checkpoint(ConfigModel):
    training_job_id: SafeName
    checkpoint_name: SafeName
    model_weight_format: ModelWeightsFormat


class FullCheckpoint(Checkpoint):
    model_weight_format: Literal[ModelWeightsFormat.FULL] = ModelWeightsFormat.FULL


class WhisperCheckpoint(Checkpoint):
    model_weight_format: Literal[ModelWeightsFormat.WHISPER] = ModelWeightsFormat.WHISPER


class LoRACheckpoint(Checkpoint):
    model_weight_format: Literal[ModelWeightsFormat.LORA] = ModelWeightsFormat.LORA
    lora_details: LoRADetails = Field(default_factory=LoRADetails)


class CheckpointList(StrictModel):
    download_folder: AbsolutePath = "/tmp/training_checkpoints"
    base_model_id: StrictStr | None = None
    checkpoints: list[Union[FullCheckpoint, LoRACheckpoint, WhisperCheckpoint]] = Field(  # noqa: UP007
        default_factory=list
    )
    loops_checkpoint_ids: list[StrictStr] = Field(default_factory=list)

    @model_validator(mode="after")
    def _one_kind(self) -> CheckpointList:
        if self.checkpoints and self.loops_checkpoint_ids:
            raise FieldProblem(("loops_checkpoint_ids",), "set checkpoints or this, not both")
        return self


class DeployCheckpointsRuntime(StrictModel):
    environment_variables: dict[StrictStr, EnvValue] = Field(default_factory=dict)


class DeployCheckpointsConfig(StrictModel):
    checkpoint_details: CheckpointList | None = None
    model_name: StrictStr | None = None
    runtime: DeployCheckpointsRuntime | None = None
    compute: Compute | None = None

"""What a serving replica is told: which checkpoints to load, from where, with which variables.

It travels as the Serve application's `args`, which the Ray dashboard shows: it names secrets,
never holds their values (they are resolved on the serving node, `staging.py`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Engine = Literal["transformers", "vllm"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StoredCheckpoint(_Model):
    """One checkpoint in the storage root (its committed manifest says which version)."""

    project_id: str
    job_id: str
    rank: int
    name: str
    kind: Literal["full", "lora"] = "full"
    lora_rank: int | None = None

    @property
    def key(self) -> str:
        return f"{self.job_id}/rank-{self.rank}/{self.name}"


class BaseModelSource(_Model):
    """Where the base model of LoRA adapters comes from: exactly one of these is set."""

    checkpoint: StoredCheckpoint | None = None  # a full checkpoint of a job
    weights: dict[str, Any] | None = None  # a `WeightsSource` (as JSON) the job mounted
    path: str | None = None  # a directory present on every serving node
    hf_repo: str | None = None  # a Hugging Face repo id, loaded by the engine itself

    def describe(self) -> str:
        if self.checkpoint is not None:
            return f"checkpoint {self.checkpoint.key}"
        if self.weights is not None:
            return f"weights {self.weights['source']}"
        return f"directory {self.path}" if self.path else f"Hugging Face repo {self.hf_repo}"


class ServedModel(_Model):
    """A Serve application: one model id, plus `<name>:<adapter>` for each LoRA adapter."""

    name: str  # the application, its route prefix and the model id
    engine: Engine
    storage_root: str
    download_folder: str
    team: str | None = None  # whose secrets `secret_env` names
    full: StoredCheckpoint | None = None  # served as `name`; else `base` is
    base: BaseModelSource | None = None
    adapters: dict[str, StoredCheckpoint] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    secret_env: dict[str, str] = Field(default_factory=dict)  # variable -> secret name

    def adapter_id(self, adapter: str) -> str:
        return f"{self.name}:{adapter}"

    def model_ids(self) -> list[str]:
        return [self.name, *(self.adapter_id(a) for a in self.adapters)]

    @property
    def checkpoints(self) -> list[StoredCheckpoint]:
        """The job checkpoints it serves (a base model that is a checkpoint counts)."""
        found = [self.full] if self.full else []
        if self.base is not None and self.base.checkpoint is not None:
            found.append(self.base.checkpoint)
        return [*found, *self.adapters.values()]

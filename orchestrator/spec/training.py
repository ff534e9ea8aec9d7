"""The training job spec: `TrainingProject` holding a `TrainingJob` and its parts.

Class names, field names and defaults follow Baseten's `truss_train.definitions`, so a config
written for Baseten loads unchanged. Where Baseten lets a mistake through to the cluster, we refuse
it here, before anything is submitted.
"""

from __future__ import annotations

import enum
import re
from typing import Annotated, Any, Union

from pydantic import (
    BeforeValidator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from orchestrator.spec.accelerators import AcceleratorSpec
from orchestrator.spec.base import (
    DisplayName,
    FieldProblem,
    JobDirectory,
    MemoryQuantity,
    SafeName,
    StrictModel,
    lenient_enum,
    parse_memory,
)
from orchestrator.spec.checkpoints import CheckpointingConfig, LoadCheckpointConfig
from orchestrator.spec.docker_auth import DockerAuth
from orchestrator.spec.durations import Duration, parse_duration
from orchestrator.spec.secrets import SecretReference
from orchestrator.spec.weights import WeightsSource
from orchestrator.spec.workspace import Workspace

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# What orchestrator gives every job (docs/configuration.md): a job setting one itself would
# mislead its own code about its ids, directories or place in the group.
JOB_VARIABLES = frozenset({
    "BT_TRAINING_JOB_ID", "BT_TRAINING_JOB_NAME", "BT_TRAINING_PROJECT_ID",
    "BT_TRAINING_PROJECT_NAME", "BT_NUM_GPUS", "BT_WORKING_DIR", "BT_SCRATCH_DIR",
    "BT_RETRY_COUNT", "BT_CHECKPOINT_DIR", "BT_LOAD_CHECKPOINT_DIR", "BT_GROUP_SIZE",
    "BT_NODE_RANK", "BT_LEADER_ADDR", "BT_RW_CACHE_DIR", "BT_PROJECT_CACHE_DIR",
    "BT_TEAM_CACHE_DIR",
})  # fmt: skip


class AvailabilityModel(str, enum.Enum):
    DEDICATED = "dedicated"
    SPOT = "spot"


class Image(StrictModel):
    """The base image. Used where the cluster runs containers; otherwise recorded only."""

    base_image: StrictStr = Field(min_length=1)
    docker_auth: DockerAuth | None = None


class Compute(StrictModel):
    """Resources of each node; a job gets `node_count` such nodes."""

    node_count: StrictInt = Field(default=1, ge=1)
    cpu_count: StrictInt = Field(default=1, ge=1)
    memory: MemoryQuantity = "2Gi"
    accelerator: AcceleratorSpec | None = None
    availability_model: lenient_enum(AvailabilityModel) = AvailabilityModel.DEDICATED  # type: ignore[valid-type]

    @property
    def memory_bytes(self) -> int:
        return parse_memory(self.memory)

    @property
    def gpus_per_node(self) -> int:
        if self.accelerator is None or self.accelerator.accelerator is None:
            return 0
        return self.accelerator.count


DEFAULT_MOUNT_BASE_PATH = "/root/.cache"


class CacheConfig(StrictModel):
    """Read-write directories that persist between jobs of a project and of a team."""

    enabled: StrictBool = False
    enable_legacy_hf_mount: StrictBool = False
    require_cache_affinity: StrictBool = True
    mount_base_path: JobDirectory = DEFAULT_MOUNT_BASE_PATH


def _check_env_value(value: Any) -> Any:
    if isinstance(value, (str, SecretReference, dict)):
        return value
    raise ValueError(
        f"must be a string or SecretReference(name=...), not {type(value).__name__} {value!r}"
    )


EnvValue = Annotated[Union[StrictStr, SecretReference], BeforeValidator(_check_env_value)]  # noqa: UP007


def _also(names: list[str]) -> str:
    return f" (so is {', '.join(names[1:])})" if names[1:] else ""


class Runtime(StrictModel):
    """What runs on each node and what it gets to work with."""

    start_commands: list[StrictStr] = Field(default_factory=list)
    environment_variables: dict[StrictStr, EnvValue] = Field(default_factory=dict)
    enable_cache: StrictBool | None = None
    checkpointing_config: CheckpointingConfig = Field(default_factory=CheckpointingConfig)
    cache_config: CacheConfig | None = None
    load_checkpoint_config: LoadCheckpointConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _migrate_enable_cache(cls, data: Any) -> Any:
        """Deprecated `enable_cache=X` means `cache_config=CacheConfig(enabled=X, legacy_hf=X)`."""
        if not isinstance(data, dict) or data.get("enable_cache") is None:
            return data
        if data.get("cache_config") is not None:
            raise FieldProblem(("enable_cache",), "is deprecated: set cache_config only, not both")
        data = dict(data)
        enabled = data.pop("enable_cache")
        if isinstance(enabled, bool):
            data["cache_config"] = CacheConfig(enabled=enabled, enable_legacy_hf_mount=enabled)
        else:
            data["enable_cache"] = enabled  # let the field report the wrong type
        return data

    @field_validator("environment_variables")
    @classmethod
    def _check_env_names(cls, value: dict[str, Any]) -> dict[str, Any]:
        bad = [name for name in value if not _ENV_NAME.fullmatch(name)]
        if bad:
            raise FieldProblem(
                (bad[0],),
                "is not an environment variable name: letters, digits and '_', not starting "
                f"with a digit{_also(bad)}",
            )
        taken = [name for name in value if name in JOB_VARIABLES]
        if taken:
            raise FieldProblem(
                (taken[0],),
                "orchestrator gives every job this variable (docs/configuration.md lists them); "
                f"setting it would mislead the job: use another name{_also(taken)}",
            )
        return value

    @field_validator("start_commands")
    @classmethod
    def _no_blank_commands(cls, value: list[str]) -> list[str]:
        for i, command in enumerate(value):
            if not command.strip():
                raise FieldProblem((i,), "is empty")
        return value

    def secret_references(self) -> dict[str, SecretReference]:
        return {
            k: v for k, v in self.environment_variables.items() if isinstance(v, SecretReference)
        }


class InteractiveSessionTrigger(str, enum.Enum):
    ON_STARTUP = "on_startup"
    ON_FAILURE = "on_failure"
    ON_DEMAND = "on_demand"


class InteractiveSessionProvider(str, enum.Enum):
    VS_CODE = "vs_code"
    CURSOR = "cursor"
    SSH = "ssh"


class InteractiveSessionAuthProvider(str, enum.Enum):
    GITHUB = "github"
    MICROSOFT = "microsoft"


class InteractiveSession(StrictModel):
    """Baseten's remote editor sessions. Accepted so configs load; see docs/configuration.md."""

    trigger: lenient_enum(InteractiveSessionTrigger) = InteractiveSessionTrigger.ON_DEMAND  # type: ignore[valid-type]
    timeout_minutes: StrictInt = 480
    session_provider: lenient_enum(InteractiveSessionProvider) = InteractiveSessionProvider.VS_CODE  # type: ignore[valid-type]
    auth_provider: lenient_enum(InteractiveSessionAuthProvider) = (  # type: ignore[valid-type]
        InteractiveSessionAuthProvider.MICROSOFT
    )


class RayTrain(StrictModel):
    """Orchestrator's extension (Baseten has none): rank 0's start_commands run a Ray Train
    trainer, whose workers orchestrator places in the job's own nodes (docs/user-guide.md)."""

    workers_per_node: StrictInt | None = Field(default=None, ge=1)

    def per_node(self, compute: Compute) -> int:
        """Ray Train workers on each node: as set, else one per GPU, else one."""
        return self.workers_per_node or compute.gpus_per_node or 1

    def workers(self, compute: Compute) -> int:
        """Every Ray Train worker of the job: what its ScalingConfig(num_workers=...) must say."""
        return compute.node_count * self.per_node(compute)


class TrainingJob(StrictModel):
    """One run of training code on `compute.node_count` nodes."""

    image: Image
    compute: Compute = Field(default_factory=Compute)
    runtime: Runtime = Field(default_factory=Runtime)
    interactive_session: InteractiveSession | None = None
    name: DisplayName | None = None
    priority: StrictInt | None = None
    workspace: Workspace | None = None
    weights: list[WeightsSource] = Field(default_factory=list)
    enable_baseten_workdir: StrictBool = True
    ray_train: RayTrain | None = None  # orchestrator's extension
    # Orchestrator's extension: a rank on which nothing moved this long is stuck (its stacks
    # stored, the attempt retried or failed); unset: ORCHESTRATOR_STUCK_AFTER_S on the head.
    stuck_after_s: StrictFloat | StrictInt | None = Field(default=None, gt=0)
    # Orchestrator's extension: how long the job may hold its nodes ("2h", "90m", "1h30m", or
    # seconds); at the limit its commands get SIGTERM, its checkpoints are flushed and it ends
    # FAILED (controller/time_limit.py). Time waiting in the queue does not count.
    max_duration: Duration | None = None

    @property
    def max_duration_s(self) -> float | None:
        """`max_duration` in seconds, or None for no limit."""
        return None if self.max_duration is None else parse_duration(self.max_duration)

    @field_validator("weights")
    @classmethod
    def _distinct_mounts(cls, weights: list[WeightsSource]) -> list[WeightsSource]:
        mounts = [w.normalized_mount for w in weights]
        for i, a in enumerate(mounts):
            for j, b in enumerate(mounts[i + 1 :], start=i + 1):
                if a == b:
                    raise FieldProblem(
                        (j, "mount_location"), f"weights[{i}] mounts at {a} too: mount each "
                        "source at its own directory"
                    )  # fmt: skip
                outer, inner = sorted((a, b), key=len)
                if inner.startswith(outer + "/"):
                    raise FieldProblem(
                        (j, "mount_location"), f"{b} and weights[{i}]'s {a} are nested: "
                        "mount each source at its own directory"
                    )  # fmt: skip
        return weights

    @model_validator(mode="after")
    def _train_workers_fit(self) -> TrainingJob:
        """Each node's share holds its Ray Train workers at Train's default (1 CPU each, and
        1 GPU each on a GPU node): refused here rather than by Train on the cluster."""
        if self.ray_train is None:
            return self
        compute, per_node = self.compute, self.ray_train.per_node(self.compute)
        for have, what in ((compute.cpu_count, "CPU"), (compute.gpus_per_node, "GPU")):
            if have and have < per_node:
                raise FieldProblem(
                    ("ray_train", "workers_per_node"), f"{per_node} workers per node do not "
                    f"fit a node's {have} {what}{'s' if have > 1 else ''} (compute), each "
                    f"taking one: set it to at most {have}, or ask for more {what}s per node"
                )  # fmt: skip
        return self

    def secret_references(self) -> list[SecretReference]:
        """Every secret the job names: env vars, weight sources, image pull credentials."""
        refs = list(self.runtime.secret_references().values())
        refs += [SecretReference(name=w.secret_name) for w in self.weights if w.secret_name]
        if self.image.docker_auth is not None:
            refs += self.image.docker_auth.secret_references()
        return refs


class TrainingProject(StrictModel):
    """A named group of jobs; pushing a project runs its `job`."""

    name: DisplayName
    job: TrainingJob
    team_name: SafeName | None = None

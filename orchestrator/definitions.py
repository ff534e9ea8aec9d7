"""The user-facing spec, one import away: `from orchestrator import definitions`.

Mirrors `truss_train.definitions` (plus `AcceleratorSpec`, `Accelerator` and `WeightsSource` from
`truss.base.truss_config`), so Baseten configs find every name they use.
"""

from orchestrator.spec.accelerators import Accelerator, AcceleratorSpec
from orchestrator.spec.checkpoints import (
    BasetenCheckpoint,
    CheckpointingConfig,
    LoadCheckpointConfig,
    LoopsCheckpoint,
    _BasetenLatestCheckpoint,
    _BasetenNamedCheckpoint,
    _LoopsCheckpoint,
)
from orchestrator.spec.deploy import (
    Checkpoint,
    CheckpointList,
    DeployCheckpointsConfig,
    DeployCheckpointsRuntime,
    FullCheckpoint,
    LoRACheckpoint,
    LoRADetails,
    ModelWeightsFormat,
    WhisperCheckpoint,
)
from orchestrator.spec.docker_auth import (
    AWSAssumeRoleDockerAuth,
    AWSIAMDockerAuth,
    AWSOIDCDockerAuth,
    DockerAuth,
    DockerAuthType,
    GCPOIDCDockerAuth,
    GCPServiceAccountJSONDockerAuth,
    RegistrySecretDockerAuth,
)
from orchestrator.spec.secrets import SecretReference
from orchestrator.spec.training import (
    AvailabilityModel,
    CacheConfig,
    Compute,
    Image,
    InteractiveSession,
    InteractiveSessionAuthProvider,
    InteractiveSessionProvider,
    InteractiveSessionTrigger,
    RayTrain,
    Runtime,
    TrainingJob,
    TrainingProject,
)
from orchestrator.spec.weights import WeightsAuth, WeightsAuthMethod, WeightsSource
from orchestrator.spec.workspace import Workspace

__all__ = [
    "AWSAssumeRoleDockerAuth",
    "AWSIAMDockerAuth",
    "AWSOIDCDockerAuth",
    "Accelerator",
    "AcceleratorSpec",
    "AvailabilityModel",
    "BasetenCheckpoint",
    "CacheConfig",
    "Checkpoint",
    "CheckpointList",
    "CheckpointingConfig",
    "Compute",
    "DeployCheckpointsConfig",
    "DeployCheckpointsRuntime",
    "DockerAuth",
    "DockerAuthType",
    "FullCheckpoint",
    "GCPOIDCDockerAuth",
    "GCPServiceAccountJSONDockerAuth",
    "Image",
    "InteractiveSession",
    "InteractiveSessionAuthProvider",
    "InteractiveSessionProvider",
    "InteractiveSessionTrigger",
    "LoRACheckpoint",
    "LoRADetails",
    "LoadCheckpointConfig",
    "LoopsCheckpoint",
    "ModelWeightsFormat",
    "RayTrain",
    "RegistrySecretDockerAuth",
    "Runtime",
    "SecretReference",
    "TrainingJob",
    "TrainingProject",
    "WeightsAuth",
    "WeightsAuthMethod",
    "WeightsSource",
    "WhisperCheckpoint",
    "Workspace",
    "_BasetenLatestCheckpoint",
    "_BasetenNamedCheckpoint",
    "_LoopsCheckpoint",
]

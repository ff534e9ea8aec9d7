"""Where jobs run: the embedded local Ray cluster (remote clusters are reached by address)."""

from orchestrator.cluster.local import (
    ORCHESTRATOR_HOME_ENV,
    LocalCluster,
    LocalClusterError,
    LocalClusterInfo,
    embedded_env,
    orchestrator_home,
)

__all__ = [
    "ORCHESTRATOR_HOME_ENV",
    "LocalCluster",
    "LocalClusterError",
    "LocalClusterInfo",
    "embedded_env",
    "orchestrator_home",
]

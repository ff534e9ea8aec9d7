"""Where jobs run: the embedded local Ray cluster (remote clusters are reached by address)."""

from orchestrator.cluster.local import LocalCluster, LocalClusterInfo, embedded_env
from orchestrator.errors import LocalClusterError

__all__ = ["LocalCluster", "LocalClusterError", "LocalClusterInfo", "embedded_env"]

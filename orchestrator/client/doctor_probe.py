"""What `orchestrator doctor` asks of the cluster itself: a Ray job whose driver (on the head,
in its environment) runs one task on every live node and prints one JSON line.

Run as `python -m orchestrator.client.doctor_probe [--storage-root URL --probe KEY]`. The node
task is pickled by value (it is `__main__`'s) and needs only the standard library and Ray, so a
node whose Python lacks orchestrator still answers, saying so.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

MARK = "ORCHESTRATOR_DOCTOR_PROBE "  # the line of the driver's output that holds the answer
NODE_TIMEOUT_S = 30.0


def node_facts() -> dict[str, Any]:
    """This node's Ray, Python, container tools, GPUs and free disk under its node root."""
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    import ray

    facts: dict[str, Any] = {
        "node_id": ray.get_runtime_context().get_node_id(),
        "ray": ray.__version__,
        "python": sys.version.split()[0],
        "podman": shutil.which("podman"),
        "runc": shutil.which("runc"),
        "nvidia_smi_gpus": None,
        "cgroup_v2": Path("/sys/fs/cgroup/cgroup.controllers").exists(),
    }
    try:
        from orchestrator.node.node_root import node_root

        facts["orchestrator"], root = True, node_root()
    except ImportError:  # said as a failure; the disk is still looked at, where it would be
        facts["orchestrator"], root = False, Path(tempfile.gettempdir()) / "orchestrator"
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
            facts["nvidia_smi_gpus"] = sum(1 for line in out.stdout.splitlines()
                                           if line.startswith("GPU "))  # fmt: skip
            if out.returncode != 0:
                facts["nvidia_smi_error"] = (out.stderr or out.stdout).strip()[-300:]
        except (OSError, subprocess.TimeoutExpired) as e:
            facts["nvidia_smi_error"] = str(e)
    facts["node_root"] = str(root)
    existing = root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    facts["free_bytes"] = shutil.disk_usage(existing).free
    return facts


def probe(storage_root: str | None, key: str | None) -> dict[str, Any]:
    import ray

    from orchestrator import actor_names
    from orchestrator.agents.runtimes import cluster_runtime_kind

    ray.init(address="auto", namespace=actor_names.NAMESPACE, log_to_driver=False)
    kind = cluster_runtime_kind()  # the head's settings: this driver has `ray start`'s environment
    answer: dict[str, Any] = {"ray": ray.__version__, "runtime": kind.value,
                              "node_tools": list(kind.node_tools)}  # fmt: skip
    try:
        ray.get_actor(actor_names.QUEUE_SERVICE, namespace=actor_names.NAMESPACE)
        answer["queue_service"] = True
    except ValueError:
        answer["queue_service"] = False
    if storage_root and key:
        answer["storage"] = _read_probe(storage_root, key)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    facts = ray.remote(num_cpus=0)(node_facts)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    pending = {
        n["NodeID"]: facts.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        ).remote()
        for n in nodes
    }
    answer["nodes"] = []
    for node in nodes:
        node_id = node["NodeID"]
        entry: dict[str, Any] = {
            "node_id": node_id,
            "address": node.get("NodeManagerAddress"),
            "head": "node:__internal_head__" in node.get("Resources", {}),
            "ray_gpus": float(node.get("Resources", {}).get("GPU", 0)),
        }
        try:
            entry.update(ray.get(pending[node_id], timeout=NODE_TIMEOUT_S))
        except Exception as e:  # a node that cannot run a task: said as such
            entry["error"] = " ".join(str(e).split())[-300:]
        answer["nodes"].append(entry)
    return answer


def _read_probe(storage_root: str, key: str) -> dict[str, Any]:
    """Whether the head reads the probe object the client wrote (the same root, both ways)."""
    from orchestrator.storage.retry import StorageRetry
    from orchestrator.storage.root import StorageRoot

    try:
        root = StorageRoot(storage_root, retry=StorageRetry(storage_root, budget_s=5))
        return {"read": root.read_bytes(key).decode()}
    except Exception as e:
        return {"error": " ".join(str(e).split())[-300:]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="orchestrator.client.doctor_probe")
    parser.add_argument("--storage-root")
    parser.add_argument("--probe")
    args = parser.parse_args(argv)
    print(MARK + json.dumps(probe(args.storage_root, args.probe)), flush=True)


if __name__ == "__main__":
    main()

"""The job's placement group: one bundle per node, and why it cannot be placed when it can't."""

from __future__ import annotations

from typing import Any

from orchestrator.spec.training import Compute

ACCELERATOR_RESOURCE_PREFIX = "accelerator_type:"
# Ray declares `accelerator_type:<TYPE>: 1` on nodes with such GPUs; asking a sliver of it in each
# bundle keeps the job on those nodes without consuming anything.
ACCELERATOR_SHARE = 0.001


def bundle_for(compute: Compute) -> dict[str, float]:
    bundle: dict[str, float] = {"CPU": compute.cpu_count, "memory": compute.memory_bytes}
    if compute.gpus_per_node:
        assert compute.accelerator is not None and compute.accelerator.accelerator is not None
        bundle["GPU"] = compute.gpus_per_node
        bundle[ACCELERATOR_RESOURCE_PREFIX + compute.accelerator.accelerator.value] = (
            ACCELERATOR_SHARE
        )
    return bundle


def bundles_for(compute: Compute) -> list[dict[str, float]]:
    return [bundle_for(compute) for _ in range(compute.node_count)]


def strategy_for(compute: Compute, colocate: bool = False) -> str:
    """One node per rank (STRICT_SPREAD) unless ranks may share a development node."""
    return "PACK" if compute.node_count == 1 or colocate else "STRICT_SPREAD"


def describe_shortfall(bundle: dict[str, float], count: int, nodes: list[dict[str, Any]]) -> str:
    """Why `count` bundles do not fit the alive nodes, e.g. 'needs 2 nodes with 8 GPU ...'."""
    alive = [n for n in nodes if n.get("Alive")]
    fitting = [n for n in alive if _fits(bundle, n.get("Resources", {}))]
    wanted = ", ".join(_show(k, v) for k, v in bundle.items() if k != "memory" or v)
    if not alive:
        return "no Ray node is alive"
    message = (
        f"needs {count} node{'s' if count > 1 else ''} with {wanted} each; "
        f"{len(fitting)} of {len(alive)} alive node{'s' if len(alive) > 1 else ''} "
        f"{'has' if len(fitting) == 1 else 'have'} that much in total"
    )
    if fitting and len(fitting) >= count:
        message += " but their resources are in use by other work"
    elif not fitting:
        wanted_type = next((k for k in bundle if k.startswith(ACCELERATOR_RESOURCE_PREFIX)), None)
        if wanted_type and not any(wanted_type in n.get("Resources", {}) for n in alive):
            prefix = len(ACCELERATOR_RESOURCE_PREFIX)
            types = sorted(
                {
                    k[prefix:]
                    for n in alive
                    for k in n.get("Resources", {})
                    if k[:prefix] == wanted_type[:prefix]
                }
            )
            message += (
                f" (no node has {wanted_type[prefix:]} GPUs; "
                f"the cluster has {', '.join(types) or 'no GPUs'})"
            )
        else:
            best = max(alive, key=lambda n: n.get("Resources", {}).get("CPU", 0))
            have = best.get("Resources", {})
            short = [_show(k, have.get(k, 0)) for k, v in bundle.items() if have.get(k, 0) < v]
            message += f" (the largest has only {', '.join(short)})"
    return message


def never_fits(
    bundle: dict[str, float], count: int, nodes: list[dict[str, Any]], spread: bool
) -> bool:
    """The alive nodes could not hold `count` bundles even with nothing else on them: one node
    per bundle when `spread`, else as many per node as fit."""
    slots = [_slots(bundle, n.get("Resources", {})) for n in nodes if n.get("Alive")]
    if spread:
        return sum(1 for s in slots if s >= 1) < count
    return sum(slots) < count


def _slots(bundle: dict[str, float], resources: dict[str, float]) -> int:
    """How many bundles a node holds when empty."""
    wanted = [(k, v) for k, v in bundle.items() if v > 0]
    return min((int(resources.get(k, 0) / v + 1e-9) for k, v in wanted), default=0)


def _fits(bundle: dict[str, float], resources: dict[str, float]) -> bool:
    return all(resources.get(k, 0) >= v for k, v in bundle.items())


def _show(key: str, value: float) -> str:
    if key == "memory":
        return f"memory {value / 2**30:.1f} GiB"
    if key.startswith(ACCELERATOR_RESOURCE_PREFIX):
        return f"accelerator {key[len(ACCELERATOR_RESOURCE_PREFIX) :]}" + (
            "" if value else " (none)"
        )
    return f"{key} {value:g}"

"""Prices as rates over the queue's resource keys, and what a job's nodes cost an hour."""

from __future__ import annotations

from orchestrator.scheduler.resources import GPU_PREFIX
from orchestrator.storage.prices import Prices

GIB = 2**30


def rates(prices: Prices) -> dict[str, float]:
    """Per hour of one unit, in the queue's keys: GPU:<type>, CPU, memory (per byte)."""
    out = {f"{GPU_PREFIX}{kind}": price for kind, price in prices.gpu.items()}
    if prices.cpu_hour:
        out["CPU"] = prices.cpu_hour
    if prices.memory_gib_hour:
        out["memory"] = prices.memory_gib_hour / GIB
    return out


def per_hour(bundle: dict[str, float], nodes: int, rates: dict[str, float]) -> float:
    """What `nodes` bundles cost an hour at `rates` (a key without a rate costs nothing)."""
    return nodes * sum(amount * rates.get(key, 0.0) for key, amount in bundle.items())


def unpriced(bundle: dict[str, float], rates: dict[str, float]) -> list[str]:
    """The GPU types of `bundle` that `rates` gives no price (their cost is unknown)."""
    return sorted(k[len(GPU_PREFIX):] for k, v in bundle.items()
                  if k.startswith(GPU_PREFIX) and v and k not in rates)  # fmt: skip

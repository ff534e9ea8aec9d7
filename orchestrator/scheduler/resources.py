"""Amounts of cluster resources (CPUs, memory, GPUs of each type) and their arithmetic.

Keys are Ray's: "CPU", "memory" (bytes), and "GPU:<type>" for GPUs of one accelerator type,
so a quota of 16 H100 is `{"GPU:H100": 16}` and never counts A100s.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from orchestrator.sizes import human_bytes

GPU_PREFIX = "GPU:"


@dataclass(frozen=True)
class Resources:
    amounts: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, **amounts: float) -> Resources:
        """`Resources.of(CPU=8, memory=2**30, H100=2)`: a bare accelerator name is its GPUs."""
        keyed = {k if k in ("CPU", "memory") else f"{GPU_PREFIX}{k}": v for k, v in amounts.items()}
        return cls(keyed)

    def get(self, key: str) -> float:
        return self.amounts.get(key, 0.0)

    def __add__(self, other: Resources) -> Resources:
        out = dict(self.amounts)
        for k, v in other.amounts.items():
            out[k] = out.get(k, 0.0) + v
        return _made(out)

    def __sub__(self, other: Resources) -> Resources:
        out = dict(self.amounts)
        for k, v in other.amounts.items():
            out[k] = out.get(k, 0.0) - v
        return _made(out)

    def __mul__(self, count: int) -> Resources:
        return Resources({k: v * count for k, v in self.amounts.items()})

    def fits_in(self, room: Resources) -> bool:
        have = room.amounts  # a plain loop: the policy asks this tens of thousands of times
        for key, amount in self.amounts.items():
            if amount > 0 and amount > have.get(key, 0.0) + 1e-9:
                return False
        return True

    def describe(self) -> str:
        return describe(self.amounts)


def _made(amounts: dict[str, float]) -> Resources:
    """A Resources without the dataclass's __init__: the policy adds and subtracts thousands
    of times a decision."""
    out = object.__new__(Resources)
    object.__setattr__(out, "amounts", amounts)
    return out


def total(items: Iterable[Resources]) -> Resources:
    out = Resources()
    for item in items:
        out = out + item
    return out


def describe(amounts: Mapping[str, float]) -> str:
    """ "2 H100, 16 CPU, 64.0 GiB memory" in a stable order (GPUs first)."""
    parts = []
    for key in sorted(amounts, key=lambda k: (not k.startswith(GPU_PREFIX), k)):
        value = amounts[key]
        if key == "memory":
            parts.append(f"{human_bytes(int(value))} memory")
        else:
            name = key.removeprefix(GPU_PREFIX)
            parts.append(f"{value:g} {name}")
    return ", ".join(parts) or "nothing"

"""The cluster's prices, set by its operator (`orchestrator capacity price`): per GPU-hour of
each accelerator type, per CPU-hour and per GiB-hour of memory.

queue/prices.json   Prices; read by a job's controller when the queue admits it, which keeps
                    their rates on the job (`Hold.prices`): a later change never rewrites the
                    cost of what already ran
"""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.storage.root import StorageRoot

PRICES = "queue/prices.json"


class Prices(BaseModel):
    """What an hour of each resource costs, in the operator's `currency`."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    gpu: dict[str, float] = Field(default_factory=dict)  # accelerator type -> per GPU-hour
    cpu_hour: float = 0.0
    memory_gib_hour: float = 0.0
    currency: str = "USD"
    set_at: float = 0.0

    @property
    def empty(self) -> bool:
        return not (self.gpu or self.cpu_hour or self.memory_gib_hour)


def read_prices(root: StorageRoot) -> Prices:
    """The prices now; none set: all zero."""
    body = root.read_json(PRICES) if root.exists(PRICES) else None
    return Prices.model_validate(body) if body else Prices()


def write_prices(root: StorageRoot, prices: Prices) -> Prices:
    """Store `prices` as the cluster's, stamped with the time they were set."""
    stamped = prices.model_copy(update={"set_at": time.time()})
    root.write_json(PRICES, stamped.model_dump())
    return stamped

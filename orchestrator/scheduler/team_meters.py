"""Per team, what its admitted jobs hold, counted as the queue holds it (from admission to
release) into Ray's Prometheus counters (node/metric_series.py TEAM_COUNTERS): the books'
figures, live, for a dashboard panel per team.

`advance` is called before every change to the queue's entries (the root queue's calls and
its tick), so what is counted between two calls is exactly what was admitted between them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from orchestrator.node import metric_series as series
from orchestrator.scheduler.resources import GPU_PREFIX
from orchestrator.storage.queue_store import QueueEntry

NO_TEAM = "(no team)"
GIB = 2**30
Sink = Callable[[series.Series, float, dict[str, str]], None]  # adds to a counter


class TeamMeters:
    """One root queue's: its own clock, into counters every root adds to."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.last: float | None = None

    def advance(self, entries: Iterable[QueueEntry], now: float) -> None:
        """Count what `entries` (the queue's until now) held since the last call."""
        dt = 0.0 if self.last is None else max(0.0, now - self.last)
        self.last = now
        for e in entries:
            if e.state != "admitted" or dt <= 0:
                continue
            team = e.team or NO_TEAM
            for key, amount in e.bundle.items():
                held = amount * e.nodes * dt
                if not held:
                    continue
                if key.startswith(GPU_PREFIX):
                    self.sink(series.TEAM_GPU_SECONDS, held,
                              {"team": team, "accelerator": key[len(GPU_PREFIX):]})  # fmt: skip
                elif key == "CPU":
                    self.sink(series.TEAM_CPU_SECONDS, held, {"team": team})
                elif key == "memory":
                    self.sink(series.TEAM_MEMORY_GIB_SECONDS, held / GIB, {"team": team})


def ray_sink() -> Sink:
    """Into Ray's counters (the queue service's process exports them through its node's
    agent); made once, shared by every root's meters."""
    from ray.util.metrics import Counter

    counters: dict[str, Any] = {
        s.name: Counter(s.name, description=s.description, tag_keys=s.tag_keys)
        for s in series.TEAM_COUNTERS
    }

    def sink(s: series.Series, value: float, tags: dict[str, str]) -> None:
        counters[s.name].inc(value, tags=tags)

    return sink

"""The controller's side of weights: ask the mirror for every source while the job is CREATED.

The copying itself happens in the WeightMirror actor; this module starts the requests, follows
their progress into the job's logs and status, and turns a source that cannot be read into the
reason the job could not deploy.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from orchestrator.agents.messages import MirrorFailed, MirrorProgress, PreparedNode
from orchestrator.agents.services import shared_actor
from orchestrator.sizes import human_bytes
from orchestrator.spec.weights import WeightsSource
from orchestrator.storage.records import NodeDelivery, WeightsStatus
from orchestrator.storage.weights import WeightSet

REPORT_EVERY_S = 2.0


class WeightsUnavailable(Exception):
    """A source could not be mirrored; the message names it and says why (internal: the
    deploy failure's cause)."""


@dataclass
class _Request:
    index: int
    spec: WeightsSource
    status: WeightsStatus
    started: float = field(default_factory=time.monotonic)
    weight_set: WeightSet | None = None
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)


def weight_mirror() -> Any:
    """The cluster's mirror actor, started by the first job that needs it."""
    from orchestrator.agents.weight_mirror import MIRROR_NAME, WeightMirror  # its jobs only

    return shared_actor(WeightMirror, MIRROR_NAME, pinned_here=False, max_concurrency=64)


def mirror_weights(
    storage_root: str,
    team: str | None,
    sources: list[WeightsSource],
    say: Callable[[str], None],
    publish: Callable[[list[WeightsStatus]], None],
    should_stop: Callable[[], bool],
) -> list[WeightSet]:
    """Mirror every source (in parallel); the committed sets, in the order of `sources`.

    `publish` receives the progress now and then; `should_stop` is polled to abandon the wait.
    Raises WeightsUnavailable for the first source that fails.
    """
    mirror = weight_mirror()
    requests = [
        _Request(i, spec, WeightsStatus(source=spec.source, mount_location=spec.normalized_mount))
        for i, spec in enumerate(sources)
    ]
    for request in requests:
        stream = mirror.mirror.options(num_returns="streaming").remote(
            storage_root, request.spec, team
        )
        threading.Thread(target=_follow, args=(stream, request), daemon=True).start()
    last_report = time.monotonic()
    while not all(r.done.wait(0.2) for r in requests):
        if should_stop():
            return []
        if time.monotonic() - last_report >= REPORT_EVERY_S:
            last_report = time.monotonic()
            for r in requests:
                if not r.done.is_set() and r.status.files_total:
                    say(f"weights[{r.index}] {r.spec.source}: {_progress(r.status)}")
            publish([r.status for r in requests])
    for r in requests:
        if r.error is not None:
            publish([r.status for r in requests])
            raise WeightsUnavailable(f"weights[{r.index}] {r.spec.source}: {r.error}")
        say(f"weights[{r.index}] {r.spec.source}: {_outcome(r)}")
    publish([r.status for r in requests])
    return [r.weight_set for r in requests if r.weight_set is not None]


def record_deliveries(
    statuses: list[WeightsStatus], prepared: list[PreparedNode], say: Callable[[str], None]
) -> None:
    """Add each node's delivery (from the agents' prepare results) to the weights' status."""
    for info in prepared:
        for i, delivered in enumerate(info.weights):
            node = NodeDelivery(
                rank=info.rank,
                tier=delivered.tier,
                seconds=delivered.seconds,
                bytes_copied=delivered.bytes_copied,
            )
            statuses[i].nodes.append(node)
            how = (
                "node cache hit"
                if node.tier == "node"
                else f"copied {human_bytes(node.bytes_copied)} from the {node.tier} cache"
                if node.tier == "cluster"
                else f"copied {human_bytes(node.bytes_copied)} from the mirror"
            )
            evicted = delivered.evicted
            extra = f"; evicted {len(evicted)} older set(s)" if evicted else ""
            if delivered.over_budget:
                extra += "; the node cache is over its budget (every other set is in use)"
            say(
                f"rank {node.rank}: weights[{i}] at {statuses[i].mount_location}: {how} "
                f"in {node.seconds:.2f} s{extra}"
            )


def _follow(stream: Any, request: _Request) -> None:
    try:
        for ref in stream:
            event = ray.get(ref)
            if isinstance(event, MirrorProgress):
                request.status = request.status.model_copy(update=dataclasses.asdict(event))
            elif isinstance(event, MirrorFailed):
                request.error = event.error
            else:
                ws = event.weight_set
                total = ws.total_bytes
                request.weight_set = ws
                request.status = request.status.model_copy(
                    update={
                        "revision": ws.revision,
                        "mirror": event.mirror.value,
                        "files_total": len(ws.files),
                        "bytes_total": total,
                        "files_done": len(ws.files),
                        "bytes_done": total,
                    }
                )
    except Exception as e:  # the mirror actor died, or a bug in it
        request.error = f"the weight mirror failed: {type(e).__name__}: {e}"
    finally:
        if request.weight_set is None and request.error is None:
            request.error = "the weight mirror ended without an answer"
        request.done.set()


def _progress(s: WeightsStatus) -> str:
    return (
        f"mirroring {s.files_done}/{s.files_total} files, "
        f"{human_bytes(s.bytes_done)} of {human_bytes(s.bytes_total)}"
    )


def _outcome(r: _Request) -> str:
    s = r.status
    took = time.monotonic() - r.started
    size = f"{s.files_total} file(s), {human_bytes(s.bytes_total)}"
    revision = (s.revision or "")[:12]
    if s.mirror == "hit":
        return f"already mirrored at revision {revision} ({size}; checked in {took:.2f} s)"
    if s.mirror == "shared":
        return f"mirrored at revision {revision} by another job's copy ({size}, {took:.1f} s)"
    return f"mirrored revision {revision}: {size} in {took:.1f} s"

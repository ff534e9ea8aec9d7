"""Where a job's ranks are placed (`Placement`): the placement group of a plan's bundles (near
the training cache when the job asks), why it waits while it cannot be placed, and a lost
rank's bundle placed again.

Ray's placement groups are reached only through `PlacementGroups` (`RayPlacementGroups` here),
and the nodes through `ClusterNodes`: tests hand it fakes of both (tests/test_placement_wait.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from orchestrator import actor_names, settings
from orchestrator.controller.cluster_nodes import ClusterNodes, live
from orchestrator.controller.fault_judge import FaultJudge
from orchestrator.controller.plan import GroupPlan
from orchestrator.controller.rank_group import GroupError
from orchestrator.controller.training_cache import affinity_selector
from orchestrator.spec.placement import describe_shortfall, never_fits
from orchestrator.storage.records import JobRecord

POLL_S = 0.2
CACHE_AFFINITY_WAIT_S = 3.0


class PlacementGroups(Protocol):
    """Ray's placement groups, as the placement uses them."""

    def create(
        self, bundles: list[dict[str, float]], strategy: str, name: str,
        selector: list[dict[str, str]] | None = None,
    ) -> Any:  # fmt: skip
        """A new placement group's handle (it is placed in the background)."""

    def ready(self, group: Any, timeout_s: float) -> bool:
        """Whether `group` is placed, waiting up to `timeout_s`."""

    def where(self, group: Any) -> tuple[str, dict[int, str]]:
        """The group's state ("CREATED", "RESCHEDULING", ...) and each bundle's node."""

    def bundle(self, group: Any, index: int) -> Any:
        """The scheduling strategy that puts an actor in bundle `index`."""

    def remove(self, group: Any) -> None: ...


class RayPlacementGroups:
    def create(
        self, bundles: list[dict[str, float]], strategy: str, name: str,
        selector: list[dict[str, str]] | None = None,
    ) -> Any:  # fmt: skip
        from ray.util.placement_group import placement_group

        if selector is None:
            return placement_group(bundles, strategy=strategy, name=name)
        return placement_group(bundles, strategy=strategy, name=name,
                               bundle_label_selector=selector)  # fmt: skip

    def ready(self, group: Any, timeout_s: float) -> bool:
        import ray

        done, _ = ray.wait([group.ready()], timeout=timeout_s)
        return bool(done)

    def where(self, group: Any) -> tuple[str, dict[int, str]]:
        import ray

        table = ray.util.placement_group_table(group)
        nodes = table.get("bundles_to_node_id", {})
        return str(table.get("state", "")), {int(i): str(n) for i, n in nodes.items()}

    def bundle(self, group: Any, index: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=index
        )

    def remove(self, group: Any) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(group)


class Placement:
    """One placement group for the job's ranks, from the first plan to the job's release."""

    def __init__(
        self,
        record: JobRecord,
        say: Callable[[str], None],
        nodes: ClusterNodes,
        groups: PlacementGroups | None = None,
    ) -> None:
        self.record, self.say, self.nodes = record, say, nodes
        self.groups: PlacementGroups = groups or RayPlacementGroups()
        self.group: Any = None
        self.plan: GroupPlan | None = None
        self.cache_affinity: str | None = None  # where it was placed for its cache, and why

    def reserve(
        self,
        plan: GroupPlan,
        timeout_s: float,
        on_pending: Callable[[str], None],
        check_stop: Callable[[], None],
    ) -> None:
        """Place `plan`'s bundles; `on_pending(reason)` each time the reason it waits changes.
        GroupError when it cannot be placed within `timeout_s`, or ever on this cluster."""
        self.plan = plan
        bundles, count = plan.bundles, plan.size
        name = actor_names.placement_group(self.record.job_id)
        spread = plan.strategy == "STRICT_SPREAD"
        table = self.nodes.table()
        if not settings.CLUSTER_AUTOSCALES.get() and never_fits(bundles[0], count, table, spread):
            raise GroupError(
                "cannot be placed on this cluster even when it is idle: "
                f"{describe_shortfall(bundles[0], count, table)}. If nodes join on "
                f"demand (an autoscaler), set {settings.CLUSTER_AUTOSCALES.name}=1 in the head "
                "node's `ray start` environment and such a job waits for them"
            )
        if self._reserve_near_cache(plan, name):
            return
        self.group = self.groups.create(bundles, plan.strategy, name)
        deadline = time.monotonic() + timeout_s
        reason = None
        while not self.groups.ready(self.group, 1.0 if reason is None else POLL_S * 5):
            check_stop()
            new_reason = describe_shortfall(bundles[0], count, self.nodes.table())
            if new_reason != reason:
                reason = new_reason
                on_pending(reason)
            if time.monotonic() > deadline:
                raise GroupError(f"could not be scheduled within {timeout_s:g} s: {reason}")

    def _reserve_near_cache(self, plan: GroupPlan, name: str) -> bool:
        """require_cache_affinity: try the nodes that hold the project's cache first, briefly."""
        alive = set(live(self.nodes))
        selector, self.cache_affinity = affinity_selector(self.record, plan.size, alive)
        if selector is None:
            return False
        group = self.groups.create(plan.bundles, plan.strategy, name, selector)
        if self.groups.ready(group, CACHE_AFFINITY_WAIT_S):
            self.group = group
            self.cache_affinity = "placed on node(s) holding the project's cache"
            self.say(f"training cache: {self.cache_affinity}")
            return True
        self.groups.remove(group)
        self.cache_affinity = (
            f"the node(s) holding the project's cache had no room within "
            f"{CACHE_AFFINITY_WAIT_S:g} s: placed anywhere"
        )
        self.say(f"training cache: {self.cache_affinity}")
        return False

    def placed_nodes(self) -> list[str]:
        """The node of each rank's bundle, as placed now."""
        _, where = self.groups.where(self.group)
        return [where[i] for i in sorted(where)]

    def bundle(self, rank: int) -> Any:
        """The scheduling strategy that puts an actor in `rank`'s bundle."""
        return self.groups.bundle(self.group, rank)

    def place_again(
        self,
        ranks: list[int],
        old_nodes: list[str],
        judge: FaultJudge,
        timeout_s: float,
        on_pending: Callable[[str], None],
        check_stop: Callable[[], None],
    ) -> None:
        """Until Ray has placed lost `ranks`' bundles again, off `old_nodes` (their nodes
        before: a dead node's bundles move by themselves, a leaving one's once it is gone).
        GroupError when not within `timeout_s`."""
        assert self.plan is not None
        deadline = time.monotonic() + timeout_s
        reason = None
        while True:
            check_stop()
            alive = set(live(self.nodes))
            waiting = judge.why_wait(old_nodes)
            if waiting is None and self._placed_elsewhere(ranks, set(old_nodes) - alive):
                return
            if waiting is None:
                shortfall = describe_shortfall(self.plan.bundles[0], 1, self.nodes.table())
                waiting = f"placing rank(s) {', '.join(map(str, ranks))} again: {shortfall}"
            if waiting != reason:
                reason = waiting
                on_pending(reason)
            if time.monotonic() > deadline:
                raise GroupError(
                    f"rank(s) {', '.join(map(str, ranks))} could not be placed again within "
                    f"{timeout_s:g} s: {reason}"
                )
            time.sleep(POLL_S * 5)

    def _placed_elsewhere(self, ranks: list[int], dead: set[str]) -> bool:
        """The group is placed again and none of `ranks` is on a `dead` node (the GCS may tell
        a node's death a moment before it moves the node's bundles)."""
        state, where = self.groups.where(self.group)
        return state == "CREATED" and not any(where.get(rank, "") in dead for rank in ranks)

    def release(self) -> None:
        if self.group is not None:
            self.groups.remove(self.group)

"""Which waiting jobs' images the queue asks nodes to pull ahead, and on which nodes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from orchestrator.scheduler.image_prefetch import ImagePrefetch
from orchestrator.scheduler.model import Decision, Node, Waiting
from orchestrator.scheduler.resources import Resources
from orchestrator.storage.queue_store import QueueEntry

GPU_NODE = Node("gpu-node", Resources.of(CPU=16, memory=64e9, H100=8), Resources.of(CPU=0))
CPU_NODE = Node("cpu-node", Resources.of(CPU=16, memory=64e9), Resources.of(CPU=16))
SMALL_NODE = Node("small-node", Resources.of(CPU=2, memory=8e9), Resources.of(CPU=2))
NODES = [GPU_NODE, CPU_NODE, SMALL_NODE]


def entry(job_id: str, image: str | None, **bundle: float) -> QueueEntry:
    return QueueEntry(job_id=job_id, pushed_at=0.0, image=image,
                      bundle=dict(Resources.of(**bundle).amounts))  # fmt: skip


def asked(decision: Decision, entries: list[QueueEntry], times: int = 1) -> list[tuple[str, str]]:
    calls: list[tuple[str, str]] = []
    with ThreadPoolExecutor(1) as pool:
        prefetch = ImagePrefetch(lambda node, e: calls.append((node, e.job_id)), pool)
        for _ in range(times):
            prefetch.consider(decision, {e.job_id: e for e in entries}.get, NODES)
    return sorted(calls)


def test_the_next_jobs_images_go_to_the_nodes_they_fit_once_each():
    entries = [
        entry("gpu-job", "reg/train:1", CPU=8, memory=1e9, H100=8),
        entry("cpu-job", "reg/prep:1", CPU=4, memory=1e9),
        entry("third", "reg/third:1", CPU=1, memory=1e9),  # third in line: not yet
    ]
    waiting = [Waiting("cpu-job", 2, "r"), Waiting("third", 3, "r"), Waiting("gpu-job", 1, "r")]
    # Asked on every decision: each node is asked once for a job.
    assert asked(Decision(waiting=waiting), entries, times=3) == [
        ("cpu-node", "cpu-job"), ("gpu-node", "cpu-job"), ("gpu-node", "gpu-job"),
    ]  # fmt: skip


def test_a_held_job_goes_to_its_held_nodes_and_a_job_without_an_image_nowhere():
    entries = [entry("held", "reg/a:1", CPU=1, memory=1e9), entry("bare", None, CPU=1)]
    decision = Decision(waiting=[Waiting("held", 1, "r"), Waiting("bare", 2, "r")],
                        reserved={"held": ("small-node", "small-node")})  # fmt: skip
    assert asked(decision, entries) == [("small-node", "held")]


def test_a_job_that_left_the_queue_meanwhile_is_skipped():
    assert asked(Decision(waiting=[Waiting("gone", 1, "r")]), []) == []


def test_what_it_remembers_asking_is_only_for_the_next_jobs():
    """A service that runs for months sees millions of jobs: it keeps the next ones' asks only,
    and asks again for a job that comes back to the front."""
    calls: list[tuple[str, str]] = []
    entries = {f"j{n}": entry(f"j{n}", f"reg/{n}:1", CPU=4, memory=1e9) for n in range(50)}
    with ThreadPoolExecutor(1) as pool:
        prefetch = ImagePrefetch(lambda node, e: calls.append((node, e.job_id)), pool)
        for n in range(49):
            front = [Waiting(f"j{n}", 1, "r"), Waiting(f"j{n + 1}", 2, "r")]
            prefetch.consider(Decision(waiting=front), entries.get, NODES)
            assert len(prefetch.asked) <= 4  # 2 jobs x the 2 nodes they fit
        prefetch.consider(Decision(waiting=[Waiting("j0", 1, "r")]), entries.get, NODES)
    assert calls.count(("cpu-node", "j0")) == 2 and calls.count(("cpu-node", "j25")) == 1

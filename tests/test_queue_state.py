"""The queue's durable state and its view of the cluster, without Ray: quotas and entries in
every kind of storage root, demands from a job's compute, nodes from Ray's node table."""

from __future__ import annotations

from orchestrator import definitions as d
from orchestrator.scheduler.cluster_view import bundle_of, nodes_from_ray, snapshot
from orchestrator.scheduler.policy import SchedulingPolicy
from orchestrator.storage.queue_store import QueueEntry, QueueStore

GiB = 1024**3


def test_quotas_and_entries_survive_a_new_reader(root):
    store = QueueStore(root)
    assert store.quotas() == {} and store.entries() == []
    store.set_quota("vision", {"GPU:H100": 16, "CPU": 128})
    store.set_quota("speech", {"GPU:H100": 8})
    store.set_quota("speech", None)  # no quota: unlimited
    first = QueueEntry(job_id="j1", team="vision", pushed_at=2.0, bundle={"GPU:H100": 8})
    second = QueueEntry(job_id="j0", team=None, pushed_at=1.0, bundle={"CPU": 2}, priority=3)
    store.put(first)
    store.put(second)
    store.put(first.model_copy(update={"state": "admitted", "placed_on": ["n1"]}))

    again = QueueStore(type(root)(root.url))  # a restarted service reads the same
    assert again.quotas() == {"vision": {"GPU:H100": 16, "CPU": 128}}
    assert [(e.job_id, e.state) for e in again.entries()] == [("j0", "queued"), ("j1", "admitted")]
    again.remove("j1")
    again.remove("j1")  # gone already: nothing to do
    assert [e.job_id for e in store.entries()] == ["j0"]


def test_a_jobs_compute_is_its_demand_per_node_with_gpus_of_their_type():
    gpu = d.Compute(node_count=2, cpu_count=16, memory="64Gi", accelerator="H100:8")
    assert bundle_of(gpu) == {"CPU": 16.0, "memory": 64.0 * GiB, "GPU:H100": 8.0}
    assert bundle_of(d.Compute()) == {"CPU": 1.0, "memory": 2.0 * GiB}


def test_free_is_what_ray_says_less_what_admitted_jobs_hold_before_they_reserve():
    table = [
        {"NodeID": "a", "Alive": True,
         "Resources": {"CPU": 16, "GPU": 2, "memory": 64 * GiB, "accelerator_type:H100": 1}},
        {"NodeID": "b", "Alive": True,
         "Resources": {"CPU": 16, "GPU": 2, "memory": 64 * GiB, "accelerator_type:H100": 1}},
        {"NodeID": "gone", "Alive": False, "Resources": {"CPU": 16}},
    ]  # fmt: skip
    # Ray: a's GPUs are free (the admitted job has not reserved yet); b runs something not ours.
    available = {"a": {"CPU": 16, "GPU": 2, "memory": 64 * GiB},
                 "b": {"CPU": 8, "GPU": 1, "memory": 32 * GiB}}  # fmt: skip
    nodes = nodes_from_ray(table, available)
    assert [n.node_id for n in nodes] == ["a", "b"]
    assert nodes[1].free.get("GPU:H100") == 1 and nodes[0].capacity.get("GPU:H100") == 2
    admitted = QueueEntry(job_id="held", pushed_at=0, bundle={"GPU:H100": 2, "CPU": 4},
                          state="admitted", placed_on=["a"], admitted_at=1.0)  # fmt: skip
    waiting = QueueEntry(job_id="next", pushed_at=2, bundle={"GPU:H100": 2, "CPU": 4})
    snap = snapshot([admitted, waiting], nodes, {}, now=3.0)  # pushed 1 s ago: not held
    assert snap.nodes[0].free.get("GPU:H100") == 0  # held for the admitted job
    decision = SchedulingPolicy().decide(snap)
    assert decision.admit == [] and decision.waiting[0].reason == (
        "needs 1 node with 2 H100, 4 CPU free: 0 such nodes free"
    )

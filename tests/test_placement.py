"""Placement bundles and the PENDING reason, from the spec and a node list alone (no Ray)."""

from __future__ import annotations

from orchestrator import definitions as d
from orchestrator.spec.placement import (
    bundles_for,
    describe_shortfall,
    never_fits,
    strategy_for,
)

GiB = 2**30


def node(cpu: float, gpu: float = 0, memory: float = 16 * GiB, alive: bool = True, **extra):
    return {"Alive": alive, "Resources": {"CPU": cpu, "GPU": gpu, "memory": memory, **extra}}


def test_bundle_per_node_with_the_accelerator_type_as_a_constraint():
    compute = d.Compute(node_count=2, cpu_count=8, memory="64Gi", accelerator="H100:8")
    bundles = bundles_for(compute)
    assert (
        bundles
        == [
            {"CPU": 8, "memory": 64 * GiB, "GPU": 8, "accelerator_type:H100": 0.001},
        ]
        * 2
    )
    assert strategy_for(compute) == "STRICT_SPREAD"
    assert strategy_for(d.Compute()) == "PACK"
    assert bundles_for(d.Compute()) == [{"CPU": 1, "memory": 2 * GiB}]


def test_shortfall_names_what_is_missing():
    bundle = bundles_for(d.Compute(cpu_count=4, accelerator="H100:8"))[0]
    nodes = [
        node(cpu=2),
        node(cpu=16, gpu=8, **{"accelerator_type:A100": 1}),
        node(64, alive=False),
    ]
    reason = describe_shortfall(bundle, 4, nodes)
    assert reason.startswith("needs 4 nodes with CPU 4, memory 2.0 GiB, GPU 8, accelerator H100")
    assert "0 of 2 alive nodes have that much in total" in reason
    assert "(no node has H100 GPUs; the cluster has A100)" in reason


def test_shortfall_names_the_gpus_the_largest_node_lacks():
    bundle = bundles_for(d.Compute(cpu_count=1, accelerator="H100:2"))[0]
    reason = describe_shortfall(bundle, 1, [node(cpu=16, gpu=1, **{"accelerator_type:H100": 1})])
    assert reason.endswith("(the largest has only GPU 1)")


def test_shortfall_when_the_resources_exist_but_are_busy():
    bundle = bundles_for(d.Compute(cpu_count=2))[0]
    reason = describe_shortfall(bundle, 1, [node(cpu=8)])
    assert "1 of 1 alive node has that much in total but their resources are in use" in reason


def test_shortfall_with_no_nodes():
    assert describe_shortfall({"CPU": 1}, 1, [node(4, alive=False)]) == "no Ray node is alive"


def test_what_can_never_fit_the_alive_nodes_even_when_idle():
    node = {"Alive": True, "Resources": {"CPU": 8, "GPU": 2, "accelerator_type:H100": 1}}
    dead = {"Alive": False, "Resources": {"CPU": 64}}
    gpu = {"CPU": 2, "GPU": 1, "accelerator_type:H100": 0.001}
    assert not never_fits(gpu, 2, [node, node], spread=True)
    assert never_fits(gpu, 3, [node, node], spread=True)  # one node per bundle
    assert not never_fits(gpu, 4, [node, node], spread=False)  # two fit on each node
    assert never_fits({"CPU": 64}, 1, [node, dead], spread=False)  # only a dead node has it
    assert never_fits({"CPU": 1, "accelerator_type:A100": 0.001}, 1, [node], spread=False)

"""The ray-train-mnist recipe (Ray Train's PyTorch quickstart on CPU), pushed unchanged to the
simulated cluster of tests/test_faults.py (nodes with disks of their own): it COMPLETES above
its accuracy threshold, one Train worker on each of its two nodes; its checkpoints are Train's,
stored with the job; every epoch's report is kept. And `orchestrator init` lists it (no Ray)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import test_faults

from orchestrator.client.api import push
from orchestrator.client.recipes import list_recipes
from orchestrator.lifecycle import JobState

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "ray-train-mnist"
EPOCHS, MIN_ACCURACY = 12, 0.9  # train.py's defaults

faults = test_faults.faults  # the module's own simulated cluster: a 2-node job and a spare


def test_the_recipe_is_listed_with_its_description():
    description = list_recipes()["ray-train-mnist"]
    assert description.startswith("Ray Train's PyTorch quickstart on CPU"), description


@pytest.mark.cluster  # starts Ray itself (a simulated cluster)
def test_the_recipe_trains_on_two_nodes_and_keeps_its_checkpoints_and_reports(storage_root, faults):
    faults.ensure_workers(3)
    job = push(RECIPE / "config.py", address=faults.dashboard_url, storage_root=storage_root)
    try:
        state = job.wait(timeout=240)
    except TimeoutError as e:
        history = [(h.state.value, h.reason) for h in job.details().history]
        raise AssertionError(f"{e}: {history}\n" + "\n".join(job.logs()[-60:])) from None
    assert state == JobState.COMPLETED, "\n".join(job.logs()[-60:])
    text = "\n".join(job.logs())

    final = re.findall(r"final test accuracy: (\d\.\d+)", text)
    assert len(final) == 1 and float(final[0]) >= MIN_ACCURACY, text
    # Worker i on the job's node i (each worker says its Ray node id), two distinct nodes.
    nodes = [n.node_id for n in job.details().nodes]
    workers = dict(re.findall(r"worker (\d)/2 running on node ([0-9a-f]+)", text))
    assert workers == {"0": nodes[0], "1": nodes[1]} and nodes[0] != nodes[1], (workers, nodes)

    reports = [r for run in job.metrics().train_reports for r in run.reports]
    assert [r.metrics["epoch"] for r in reports] == list(range(1, EPOCHS + 1)), reports
    assert all({"loss", "accuracy"} <= set(r.metrics) for r in reports), reports
    assert reports[-1].metrics["accuracy"] == pytest.approx(float(final[0]), abs=1e-4)
    # Each epoch's checkpoint is Train's, rank 0's part, stored with the job.
    committed = [r.checkpoint for r in reports]
    assert all(c and c.startswith("checkpoint_") for c in committed), committed
    stored = {m.name for m in job.checkpoints() if not m.top_level and m.complete}
    assert stored and all(n.startswith("checkpoint_") for n in stored), stored
    assert stored <= set(committed) and committed[-1] in stored, (stored, committed)

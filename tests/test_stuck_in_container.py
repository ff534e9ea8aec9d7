"""A stuck rank whose commands run in a container of the job's image (podman): `job.stacks()`
takes its Python stacks on demand while it runs, and the stuck detector stores them before the
job ends FAILED `stuck` (py-spy on the node reads the container's processes through /proc)."""

from __future__ import annotations

import time

import pytest
from conftest import make_job
from test_containers import container_cluster, python_image, registry  # noqa: F401  (fixtures)

from orchestrator.client.api import push
from orchestrator.lifecycle import JobState
from orchestrator.storage.root import StorageRoot
from orchestrator.storage.stacks import StackStore

pytestmark = pytest.mark.cluster

WAITS = """
import time
def wait_for_the_filesystem():
    time.sleep(120)
print("up", flush=True)
wait_for_the_filesystem()
"""


def test_a_stuck_rank_in_a_container_gives_its_stacks_on_demand_and_when_found(
    container_cluster,  # noqa: F811 (a fixture)
    python_image,  # noqa: F811 (a fixture)
    tmp_path,
):
    config = make_job(tmp_path / "job", f"""
        from orchestrator import definitions as d
        project = d.TrainingProject(
            name="stuck-in-a-container",
            job=d.TrainingJob(
                image=d.Image(base_image={python_image!r}),
                compute=d.Compute(cpu_count=1, memory="256Mi"),
                runtime=d.Runtime(start_commands=["python waits.py"]),
                stuck_after_s=8,
            ),
        )
        """, {"waits.py": WAITS})  # fmt: skip
    storage = str(tmp_path / "storage")
    job = push(config, address=container_cluster, storage_root=storage)
    deadline = time.monotonic() + 120
    while not any(line.endswith("] up") for line in job.logs()):
        assert time.monotonic() < deadline and not job.status().is_terminal, job.logs()
        time.sleep(0.3)
    taken = job.stacks()
    assert "wait_for_the_filesystem (waits.py:4)" in taken[0], taken
    assert job.wait(timeout=120) == JobState.FAILED, job.logs()
    assert [a.cause for a in job.attempts()] == ["stuck"]
    stored = StackStore(StorageRoot(storage), job.id).read("attempt-0")
    assert "wait_for_the_filesystem" in stored[0], stored

"""`orchestrator recreate`: an earlier job again, from its stored record and code archive."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import make_job

from orchestrator.client.api import get_job, push, recreate
from orchestrator.client.audit import events
from orchestrator.errors import OrchestratorError
from orchestrator.lifecycle import JobState
from orchestrator.storage import layout
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.root import StorageRoot

pytestmark = pytest.mark.usefixtures("ray_cluster")

CONFIG = """
from orchestrator import definitions as d
project = d.TrainingProject(
    name="recreated",
    job=d.TrainingJob(
        image=d.Image(base_image="python:3.11"),
        compute=d.Compute(memory="512Mi"),
        runtime=d.Runtime(start_commands=["python train.py"],
                          environment_variables={"LR": "0.25"}),
    ),
)
"""


def test_recreate_runs_the_same_code_and_config_again(tmp_path, storage_root):
    train = "import os\nprint('version 1, lr', os.environ['LR'])\n"
    config = make_job(tmp_path / "job", CONFIG, {"train.py": train})
    first = push(config, storage_root=storage_root)
    assert first.wait(timeout=120) == JobState.COMPLETED
    (tmp_path / "job" / "train.py").write_text("print('version 2')\n")  # the disk moved on

    result = subprocess.run(
        [sys.executable, "-m", "orchestrator", "recreate", "--job-id", first.id, "--tail",
         "--storage-root", storage_root, "-o", "json"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    pushed, _ = json.JSONDecoder().raw_decode(result.stdout)  # then the tailed lines
    new_id = pushed["training_job"]["id"]
    assert f"job {new_id} completed successfully" in result.stdout
    assert new_id != first.id
    again = get_job(new_id, storage_root=storage_root)
    assert again.status() == JobState.COMPLETED
    assert any(line.endswith("version 1, lr 0.25") for line in again.logs())
    assert again.record.recreated_from == first.id
    assert again.record.archive == first.record.archive  # not uploaded again
    assert again.record.spec == first.record.spec
    assert again.details().history[0].reason == f"recreated from job {first.id}"
    trail = [(e.verb, e.job, e.result, e.detail) for e in events(storage_root=storage_root)]
    assert trail == [("push", first.id, "ok", None),
                     ("recreate", new_id, "ok", f"from job {first.id}")]  # fmt: skip


def test_recreate_without_the_code_archive_says_so_and_submits_nothing(tmp_path, storage_root):
    config = make_job(tmp_path / "job", CONFIG, {"train.py": "print('hi')\n"})
    first = push(config, storage_root=storage_root)
    assert first.wait(timeout=120) == JobState.COMPLETED
    root = StorageRoot(storage_root)
    root.fs.rm(root.path(layout.archive(first.record.archive.sha256)))
    with pytest.raises(OrchestratorError, match=r"is no longer in .*push its config again"):
        recreate(first.id, storage_root=storage_root)
    assert [r.job_id for r in JobStore(root).records()] == [first.id]

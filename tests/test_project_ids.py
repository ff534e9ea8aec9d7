"""Project names as Baseten takes them, and the stable ids that storage, nodes and Ray use.

Real jobs on the session's Ray: a project named with a slash, spaces and unicode runs, gets an id
at its first push and keeps it; verbs take the name or the id; a project whose jobs were stored
before ids existed keeps its name as its id, so a new job loads their checkpoints. Without Ray, on
every kind of storage root: first registrations of one name racing from many processes give
one id.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import make_job

from orchestrator import definitions as d
from orchestrator.client.api import list_jobs, push
from orchestrator.lifecycle import JobState
from orchestrator.storage import layout
from orchestrator.storage.checkpoints import CheckpointStore
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.projects import ProjectStore
from orchestrator.storage.records import ArchiveRef, JobRecord, JobStatus
from orchestrator.storage.root import StorageRoot

NAME = "demo/qwen3-0.6b · 검색 (sft)"

CONFIG = """
from orchestrator import definitions as d
project = d.TrainingProject(
    name={name!r},
    job=d.TrainingJob(
        name="run 1/2",
        image=d.Image(base_image="python:3.11"),
        compute=d.Compute(memory="512Mi"),
        runtime=d.Runtime(
            start_commands=["python train.py"],
            checkpointing_config=d.CheckpointingConfig(enabled=True),
            load_checkpoint_config={load},
        ),
    ),
)
"""

TRAIN = """
import os, pathlib
print("project", repr(os.environ["BT_TRAINING_PROJECT_NAME"]), os.environ["BT_TRAINING_PROJECT_ID"])
loaded = os.environ.get("BT_LOAD_CHECKPOINT_DIR")
if loaded:
    for p in sorted(pathlib.Path(loaded).rglob("*.bin")):
        print("loaded", p.name, p.read_text())
d = pathlib.Path(os.environ["BT_CHECKPOINT_DIR"]) / "checkpoint-1"
d.mkdir()
(d / "model.bin").write_text("weights")
"""


def job_dir(tmp: Path, name: str, load: str = "None") -> Path:
    return make_job(tmp, CONFIG.format(name=name, load=load), {"train.py": TRAIN})


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args],
                          capture_output=True, text=True, timeout=120)  # fmt: skip


@pytest.mark.usefixtures("ray_cluster")
def test_a_name_with_slashes_and_unicode_runs_under_a_stable_id(tmp_path, storage_root):
    first = push(job_dir(tmp_path / "a", NAME), storage_root=storage_root)
    assert first.wait(timeout=120) == JobState.COMPLETED, first.logs()
    project_id = first.project_id
    assert project_id.startswith("p") and "/" not in project_id
    assert any(line.endswith(f"project {NAME!r} {project_id}") for line in first.logs())
    assert first["training_project"] == {"id": project_id, "name": NAME}
    assert first.record.job_name == "run 1/2"
    root = StorageRoot(storage_root)
    assert root.list_names(f"checkpoints/{project_id}/{first.id}/manifests/rank-0") == [
        "checkpoint-1.json"
    ]

    second = push(job_dir(tmp_path / "b", NAME), storage_root=storage_root)
    assert second.wait(timeout=120) == JobState.COMPLETED
    assert second.project_id == project_id  # the id is the project's, not the push's

    for project in (NAME, project_id):  # every --project takes either
        listed = json.loads(cli("view", "--project", project, "--storage-root", storage_root,
                                "-o", "json").stdout)  # fmt: skip
        assert [r["id"] for r in listed] == [first.id, second.id]
        assert {r["project_id"] for r in listed} == {project_id}
        newest_first = [j.id for j in list_jobs(project, storage_root=storage_root)]
        assert newest_first == [second.id, first.id]
    ckpts = cli("checkpoints", "list", "--project", project_id, "--storage-root", storage_root,
                "-o", "json")  # fmt: skip
    assert len(json.loads(ckpts.stdout)) == 2, ckpts.stderr
    assert [p.name for p in ProjectStore(root).all()] == [NAME]


@pytest.mark.usefixtures("ray_cluster")
def test_a_project_stored_before_ids_keeps_its_name_as_its_id(tmp_path, storage_root):
    root = StorageRoot(storage_root)
    spec = d.TrainingProject(name="old-proj", job=d.TrainingJob(image=d.Image(base_image="x")))
    archive = ArchiveRef(path="archives/x.tar", sha256="x", size_bytes=1, file_count=1,
                         config_dir=".")  # fmt: skip
    legacy = JobRecord(job_id="jlegacy000", project="old-proj", created_at=time.time() - 60,
                       spec=spec, archive=archive, storage_root=root.url)  # fmt: skip
    JobStore(root).create(legacy, JobStatus.new("jlegacy000"))
    checkpoint = tmp_path / "checkpoint-7"
    checkpoint.mkdir()
    (checkpoint / "model.bin").write_text("from before ids")
    CheckpointStore(root).upload(checkpoint, "old-proj", "jlegacy000", 0)  # the old layout

    load = "d.LoadCheckpointConfig(enabled=True, checkpoints=[d.BasetenCheckpoint.from_latest_checkpoint(project_name='old-proj')])"  # noqa: E501
    job = push(job_dir(tmp_path / "new", "old-proj", load), storage_root=storage_root)
    assert job.wait(timeout=120) == JobState.COMPLETED, job.logs()
    assert job.project_id == "old-proj"
    assert any(line.endswith("loaded model.bin from before ids") for line in job.logs())


RACERS, NAMES = 8, 12


def test_first_registrations_racing_on_one_name_give_one_project(root: StorageRoot) -> None:
    """Each racer has its own store and root, as separate processes (a team's CI and a person)
    would; they register the same new names at the same moment."""
    names = [f"race {i}/{NAME}" for i in range(NAMES)]
    start = threading.Barrier(RACERS)

    def register_all(_: int) -> list[str]:
        store = ProjectStore(StorageRoot(root.url))
        start.wait()
        return [store.ensure(name).id for name in names]

    with ThreadPoolExecutor(RACERS) as pool:
        ids_by_racer = list(pool.map(register_all, range(RACERS)))

    for i, name in enumerate(names):
        ids = {ids[i] for ids in ids_by_racer}
        assert len(ids) == 1, f"{name!r} was given {len(ids)} ids: {sorted(ids)}"
    projects = ProjectStore(root).all()
    assert sorted(p.name for p in projects) == sorted(names), "exactly one record per name"
    assert {p.name: p.id for p in projects} == dict(zip(names, ids_by_racer[0], strict=True))


def test_create_json_creates_once(root: StorageRoot) -> None:
    assert root.create_json("records/once.json", {"n": 1}) is True
    assert root.create_json("records/once.json", {"n": 2}) is False
    assert root.read_json("records/once.json") == {"n": 1}
    assert root.list_names("records") == ["once.json"], "no temp file is left behind"


def test_a_registration_cut_short_is_completed_by_the_next(root: StorageRoot) -> None:
    """A process that died between the name's record and the project's: the next push of the
    name finds the id it was given and writes the project."""
    root.create_json(layout.project_name(NAME), {"id": "pcutshort0"})
    assert ProjectStore(root).by_name(NAME) is None
    project = ProjectStore(root).ensure(NAME)
    assert (project.id, project.name) == ("pcutshort0", NAME)
    assert ProjectStore(root).by_name(NAME) == project

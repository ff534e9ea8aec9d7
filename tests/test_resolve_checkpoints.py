"""Which checkpoints of earlier jobs a job loads (`load_checkpoint_config`), before any node is
prepared: every rank's copy of each, or a CheckpointNotFound that says what to do.

No Ray: jobs stored as `push` stores them, checkpoints uploaded as the uploaders upload them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator import definitions as d
from orchestrator.client.prepare import prepare_job
from orchestrator.client.submit import store_job
from orchestrator.controller.checkpointing import CheckpointNotFound, resolve_checkpoints
from orchestrator.spec.checkpoints import CheckpointReference
from orchestrator.storage.checkpoints import CheckpointStore
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.records import JobRecord
from orchestrator.storage.root import StorageRoot


class Cluster:
    """A storage root with jobs of project `ft` and their uploaded checkpoints."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.root = StorageRoot(str(tmp_path / "storage"))
        self.store = JobStore(self.root)
        (tmp_path / "code").mkdir()
        (tmp_path / "code" / "train.py").write_text("print('hi')\n")

    def job(self, job_id: str, load: list[CheckpointReference] | None = None) -> JobRecord:
        runtime = d.Runtime(
            start_commands=["python train.py"],
            load_checkpoint_config=d.LoadCheckpointConfig(enabled=True, checkpoints=load)
            if load
            else None,
        )
        project = d.TrainingProject(
            name="ft",
            job=d.TrainingJob(image=d.Image(base_image="python:3.11"),
                              compute=d.Compute(node_count=2), runtime=runtime),
        )  # fmt: skip
        prepared = prepare_job(project, source_dir=self.tmp / "code")
        return store_job(prepared, self.root, job_id, ray_address=None)

    def checkpoint(self, record: JobRecord, name: str, ranks=(0, 1), complete=True) -> None:
        for rank in ranks:
            local = self.tmp / "local" / record.job_id / str(rank) / name
            local.mkdir(parents=True)
            (local / "model.safetensors").write_bytes(b"weights")
            CheckpointStore(self.root).upload(
                local, record.project_key, record.job_id, rank,
                incomplete_reason=None if complete else "rank 0's command exited with code 137",
            )  # fmt: skip


@pytest.fixture
def cluster(tmp_path: Path) -> Cluster:
    return Cluster(tmp_path)


def loaded(manifests) -> list[tuple[str, int, str]]:
    return sorted((m.job_id, m.node_rank, m.name) for m in manifests)


def test_a_job_without_checkpoints_to_load_loads_nothing(cluster):
    assert resolve_checkpoints(cluster.job("jnew"), cluster.store) == []


def test_the_latest_of_a_named_job_is_its_newest_complete_checkpoint_on_every_rank(cluster):
    earlier = cluster.job("jold")
    cluster.checkpoint(earlier, "checkpoint-100")
    cluster.checkpoint(earlier, "checkpoint-200", complete=False)  # its writer died saving it
    record = cluster.job("jnew", [d.BasetenCheckpoint.from_latest_checkpoint(job_id="jold")])
    assert loaded(resolve_checkpoints(record, cluster.store)) == [
        ("jold", 0, "checkpoint-100"),
        ("jold", 1, "checkpoint-100"),
    ]


def test_files_at_the_top_are_the_latest_unless_they_only_keep_a_trainers_books(cluster):
    """Ray Train rewrites its checkpoint manager's snapshot at the top after each report, so
    it is stored last: "latest" is still the checkpoint it lists, not the snapshot. Files at
    the top that are a model (save_pretrained after the last checkpoint) are the latest."""
    earlier = cluster.job("jold")
    cluster.checkpoint(earlier, "checkpoint_000001", ranks=(0,))
    top = cluster.tmp / "top"
    top.mkdir()
    (top / "checkpoint_manager_snapshot.json").write_text("{}")
    store = CheckpointStore(cluster.root)
    store.upload(top, earlier.project_key, "jold", 0, name="top-level", top_level=True)
    record = cluster.job("jnew", [d.BasetenCheckpoint.from_latest_checkpoint(job_id="jold")])
    assert loaded(resolve_checkpoints(record, cluster.store)) == [("jold", 0, "checkpoint_000001")]
    (top / "model.safetensors").write_bytes(b"weights")
    replaces = store.manifest(earlier.project_key, "jold", 0, "top-level")
    store.upload(top, earlier.project_key, "jold", 0, name="top-level", top_level=True,
                 replaces=replaces)  # fmt: skip
    assert loaded(resolve_checkpoints(record, cluster.store)) == [("jold", 0, "top-level")]


def test_the_latest_of_a_project_comes_from_its_newest_job_with_a_complete_one(cluster):
    first = cluster.job("jfirst")
    cluster.checkpoint(first, "checkpoint-50")
    second = cluster.job("jsecond")
    cluster.checkpoint(second, "checkpoint-9", complete=False)  # nothing whole in the newest
    record = cluster.job("jnew", [d.BasetenCheckpoint.from_latest_checkpoint(project_name="ft")])
    cluster.checkpoint(record, "checkpoint-1")  # the job's own are never its "latest"
    assert loaded(resolve_checkpoints(record, cluster.store)) == [
        ("jfirst", 0, "checkpoint-50"),
        ("jfirst", 1, "checkpoint-50"),
    ]


def test_a_named_checkpoint_is_loaded_by_its_name(cluster):
    earlier = cluster.job("jold")
    cluster.checkpoint(earlier, "checkpoint-100")
    cluster.checkpoint(earlier, "checkpoint-200")
    ref = d.BasetenCheckpoint.from_named_checkpoint("checkpoint-100", job_id="jold")
    record = cluster.job("jnew", [ref])
    assert loaded(resolve_checkpoints(record, cluster.store)) == [
        ("jold", 0, "checkpoint-100"),
        ("jold", 1, "checkpoint-100"),
    ]


def test_an_incomplete_named_checkpoint_is_refused_saying_how_to_look_at_it(cluster):
    earlier = cluster.job("jold")
    cluster.checkpoint(earlier, "checkpoint-200", complete=False)
    ref = d.BasetenCheckpoint.from_named_checkpoint("checkpoint-200", job_id="jold")
    with pytest.raises(CheckpointNotFound) as e:
        resolve_checkpoints(cluster.job("jnew", [ref]), cluster.store)
    assert "checkpoint 'checkpoint-200' of job jold is incomplete" in str(e.value)
    assert "orchestrator checkpoints download --job-id jold --name checkpoint-200" in str(e.value)


def test_what_matches_nothing_is_named_in_the_error(cluster):
    cluster.job("jold")
    missing = d.BasetenCheckpoint.from_named_checkpoint("checkpoint-7", job_id="jold")
    with pytest.raises(CheckpointNotFound, match="job jold has no checkpoint named 'checkpoint-7'"):
        resolve_checkpoints(cluster.job("jnew", [missing]), cluster.store)
    nobody = d.BasetenCheckpoint.from_latest_checkpoint(job_id="jnobody")
    with pytest.raises(CheckpointNotFound, match=r"checkpoints\[0\]: no job 'jnobody'"):
        resolve_checkpoints(cluster.job("jnew2", [nobody]), cluster.store)
    empty = d.BasetenCheckpoint.from_latest_checkpoint(job_id="jold")
    with pytest.raises(CheckpointNotFound, match="job jold has no complete uploaded checkpoint"):
        resolve_checkpoints(cluster.job("jnew3", [empty]), cluster.store)

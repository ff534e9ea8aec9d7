"""`orchestrator checkpoints list|download` as a user runs them, against a storage root built here.

No Ray: job records and checkpoints are written straight to the storage root, the checkpoints
through the same `CheckpointStore.upload` the node agents use.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator import definitions as d
from orchestrator.client.api import get_job
from orchestrator.storage.checkpoints import CheckpointStore, Manifest
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.records import ArchiveRef, JobRecord, JobStatus
from orchestrator.storage.root import StorageRoot

MiB = 1024 * 1024


def cli(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *map(str, args)],
        capture_output=True, text=True, cwd=cwd, timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip


def make_record(job_id: str, project: str, created_at: float) -> JobRecord:
    spec = d.TrainingProject(name=project, job=d.TrainingJob(image=d.Image(base_image="x")))
    archive = ArchiveRef(path="archives/x.tar", sha256="x", size_bytes=1, file_count=1,
                         config_dir=".")  # fmt: skip
    return JobRecord(job_id=job_id, project=project, created_at=created_at, spec=spec,
                     archive=archive, storage_root="somewhere")  # fmt: skip


def write_checkpoint(directory: Path, files: dict[str, bytes]) -> dict[str, bytes]:
    for rel, data in files.items():
        (directory / rel).parent.mkdir(parents=True, exist_ok=True)
        (directory / rel).write_bytes(data)
    return files


def full_checkpoint(seed: int) -> dict[str, bytes]:
    return {
        "model.safetensors": os.urandom(2 * MiB),
        "config.json": json.dumps({"seed": seed}).encode(),
        "tokenizer/vocab.txt": f"vocab {seed}\n".encode(),
    }


def lora_checkpoint() -> dict[str, bytes]:
    return {
        "adapter_config.json": json.dumps({"r": 16, "lora_alpha": 32}).encode(),
        "adapter_model.safetensors": os.urandom(10 * 1024),
    }


class Storage:
    """The storage root and, per (job, rank, name), the bytes of every file uploaded."""

    def __init__(self, url: str, originals: dict[tuple[str, int, str], dict[str, bytes]]) -> None:
        self.url = url
        self.originals = originals

    def manifests(self, job_id: str) -> list[Manifest]:
        return CheckpointStore(StorageRoot(self.url)).list(job_id=job_id)


@pytest.fixture(scope="module")
def storage(tmp_path_factory: pytest.TempPathFactory) -> Storage:
    """Jobs, oldest first: job-empty (no checkpoints), job-old, job-other (another project),
    job-new (most recent), whose checkpoints are, in upload order: checkpoint-20 on ranks 0
    and 1 (full), then checkpoint-100 on ranks 1 and 2 (LoRA, r=16; rank 0 has none)."""
    base = tmp_path_factory.mktemp("checkpoints")
    root = StorageRoot(base / "storage")
    jobs, store = JobStore(root), CheckpointStore(root)
    records = [("job-empty", "proj", 1.0), ("job-old", "proj", 2.0),
               ("job-other", "other", 3.0), ("job-new", "proj", 4.0)]  # fmt: skip
    for job_id, project, created in records:
        jobs.create(make_record(job_id, project, created), JobStatus.new(job_id))
    uploads = [
        ("proj", "job-old", 0, "checkpoint-5", full_checkpoint(5)),
        ("other", "job-other", 0, "checkpoint-7", full_checkpoint(7)),
        ("proj", "job-new", 0, "checkpoint-20", full_checkpoint(200)),
        ("proj", "job-new", 1, "checkpoint-20", full_checkpoint(201)),
        ("proj", "job-new", 1, "checkpoint-100", lora_checkpoint()),
        ("proj", "job-new", 2, "checkpoint-100", lora_checkpoint()),
    ]
    originals = {}
    for project, job_id, rank, name, files in uploads:
        local = base / "local" / job_id / f"rank-{rank}" / name
        originals[(job_id, rank, name)] = write_checkpoint(local, files)
        store.upload(local, project, job_id, rank)
        time.sleep(0.01)  # distinct upload times, so "newest" is unambiguous
    return Storage(root.url, originals)


def tree(directory: Path) -> dict[str, bytes]:
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in directory.rglob("*")
        if p.is_file()
    }


def table_rows(out: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.split("│")[1:-1]]
        for line in out.splitlines()
        if "│" in line and "checkpoint-" in line
    ]


# --- list ------------------------------------------------------------------------------------


def test_list_defaults_to_the_most_recent_job_and_says_so(storage):
    result = cli("checkpoints", "list", "--storage-root", storage.url)
    assert result.returncode == 0, result.stderr
    assert "no --job-id given: using the most recent job, job-new" in result.stdout
    created = [
        dt.datetime.fromtimestamp(m.created_at).strftime("%Y-%m-%d %H:%M:%S")
        for m in storage.manifests("job-new")
    ]
    assert table_rows(result.stdout) == [
        ["checkpoint-20", "job-new", "0", "full", "2.0 MiB", "3", created[0]],
        ["checkpoint-20", "job-new", "1", "full", "2.0 MiB", "3", created[1]],
        ["checkpoint-100", "job-new", "1", "lora (r=16)", "10.0 KiB", "2", created[2]],
        ["checkpoint-100", "job-new", "2", "lora (r=16)", "10.0 KiB", "2", created[3]],
    ]


def test_list_json_has_every_field_and_keeps_stdout_parseable(storage):
    result = cli("checkpoints", "list", "--storage-root", storage.url, "-o", "json")
    assert result.returncode == 0, result.stderr
    assert "most recent job, job-new" in result.stderr
    rows = json.loads(result.stdout)
    expected = [
        {"name": m.name, "job_id": "job-new", "node_rank": m.node_rank,
         "checkpoint_type": m.checkpoint_type, "lora_rank": m.lora_rank,
         "size_bytes": m.size_bytes, "file_count": len(m.files), "created_at": m.created_at,
         "complete": True, "incomplete_reason": None}
        for m in storage.manifests("job-new")
    ]  # fmt: skip
    assert rows == expected
    assert [(r["name"], r["node_rank"], r["checkpoint_type"], r["lora_rank"]) for r in rows] == [
        ("checkpoint-20", 0, "full", None),
        ("checkpoint-20", 1, "full", None),
        ("checkpoint-100", 1, "lora", 16),
        ("checkpoint-100", 2, "lora", 16),
    ]
    uploaded = storage.originals[("job-new", 0, "checkpoint-20")]
    assert rows[0]["size_bytes"] == sum(len(b) for b in uploaded.values())


def test_list_as_csv_has_the_json_fields_one_row_per_checkpoint(storage):
    as_json = json.loads(cli("checkpoints", "list", "--storage-root", storage.url, "-o",
                             "json").stdout)  # fmt: skip
    result = cli("checkpoints", "list", "--storage-root", storage.url, "-o", "csv")
    assert result.returncode == 0, result.stderr
    assert "most recent job, job-new" in result.stderr  # stdout stays a CSV file
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert list(rows[0]) == list(as_json[0])
    assert [{k: str(v) if v is not None else "" for k, v in r.items()} for r in as_json] == rows


def test_urls_on_a_local_root_say_why_there_are_none(storage):
    result = cli("checkpoints", "urls", "--job-id", "job-new", "--storage-root", storage.url)
    assert result.returncode == 1
    assert "is a local directory: it cannot make URLs" in result.stderr
    assert "orchestrator checkpoints download" in result.stderr


@pytest.mark.parametrize(
    ("sort", "order", "expected"),
    [
        # names sort by their numbers: checkpoint-20 before checkpoint-100
        ("name", "asc", [("checkpoint-20", 0), ("checkpoint-20", 1),
                         ("checkpoint-100", 1), ("checkpoint-100", 2)]),
        ("created", "desc", [("checkpoint-100", 2), ("checkpoint-100", 1),
                             ("checkpoint-20", 1), ("checkpoint-20", 0)]),
        ("size", "asc", [("checkpoint-100", 1), ("checkpoint-100", 2),
                         ("checkpoint-20", 0), ("checkpoint-20", 1)]),
    ],
)  # fmt: skip
def test_list_sorts(storage, sort, order, expected):
    result = cli("checkpoints", "list", "--job-id", "job-new", "--storage-root", storage.url,
                 "--sort", sort, "--order", order, "-o", "json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    if sort == "size":  # two full checkpoints of equal size: only the sizes' order is fixed
        assert [r["size_bytes"] for r in rows] == sorted(r["size_bytes"] for r in rows)
        assert [r["name"] for r in rows] == [name for name, _ in expected]
    else:
        assert [(r["name"], r["node_rank"]) for r in rows] == expected
    assert "most recent job" not in result.stdout + result.stderr


def test_list_a_whole_project(storage):
    result = cli("checkpoints", "list", "--project", "proj", "--storage-root", storage.url,
                 "-o", "json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [(r["job_id"], r["name"], r["node_rank"]) for r in rows] == [
        ("job-old", "checkpoint-5", 0),
        ("job-new", "checkpoint-20", 0),
        ("job-new", "checkpoint-20", 1),
        ("job-new", "checkpoint-100", 1),
        ("job-new", "checkpoint-100", 2),
    ]
    text = cli("checkpoints", "list", "--project", "proj", "--storage-root", storage.url)
    assert "checkpoints of project 'proj'" in text.stdout
    assert {row[1] for row in table_rows(text.stdout)} == {"job-old", "job-new"}


def test_list_says_when_there_are_no_checkpoints(storage):
    for args in (("--job-id", "job-empty"), ("--project", "never-pushed")):
        result = cli("checkpoints", "list", *args, "--storage-root", storage.url)
        assert result.returncode == 0, result.stderr
        assert "no checkpoints in" in result.stdout
        assert table_rows(result.stdout) == []
    as_json = cli("checkpoints", "list", "--job-id", "job-empty", "--storage-root", storage.url,
                  "-o", "json")  # fmt: skip
    assert json.loads(as_json.stdout) == []


def test_list_refuses_a_job_of_another_project(storage):
    result = cli("checkpoints", "list", "--job-id", "job-other", "--project", "proj",
                 "--storage-root", storage.url)  # fmt: skip
    assert result.returncode == 1
    assert "job job-other belongs to project 'other', not 'proj'" in result.stderr


# --- download --------------------------------------------------------------------------------


def test_download_defaults_to_the_newest_checkpoint_from_the_lowest_rank_that_has_it(
    storage, tmp_path
):
    result = cli("checkpoints", "download", "--storage-root", storage.url, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "most recent job, job-new" in result.stderr
    dest = tmp_path / "job-new-checkpoints" / "checkpoint-100"
    assert result.stdout.strip() == str(dest.resolve())
    # checkpoint-100 is newest; rank 0 has none, rank 2 uploaded it last: rank 1's copy
    assert tree(dest) == storage.originals[("job-new", 1, "checkpoint-100")]
    assert "checkpoint-100 (rank 1)" in result.stderr  # the progress bar's label


def test_download_by_name_prefers_rank_0(storage, tmp_path):
    result = cli("checkpoints", "download", "--job-id", "job-new", "--name", "checkpoint-20",
                 "--storage-root", storage.url, cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    dest = tmp_path / "job-new-checkpoints" / "checkpoint-20"
    assert tree(dest) == storage.originals[("job-new", 0, "checkpoint-20")]


def test_download_by_name_and_rank_into_a_target_directory(storage, tmp_path):
    result = cli("checkpoints", "download", "--job-id", "job-new", "--name", "checkpoint-20",
                 "--rank", "1", "--target-directory", tmp_path / "out" / "here",
                 "--storage-root", storage.url)  # fmt: skip
    assert result.returncode == 0, result.stderr
    dest = tmp_path / "out" / "here" / "checkpoint-20"
    assert result.stdout.strip() == str(dest)
    assert tree(dest) == storage.originals[("job-new", 1, "checkpoint-20")]
    assert tree(dest) != storage.originals[("job-new", 0, "checkpoint-20")]


def test_download_by_rank_takes_that_ranks_newest(storage, tmp_path):
    result = cli("checkpoints", "download", "--job-id", "job-new", "--rank", "0",
                 "--storage-root", storage.url, cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    dest = tmp_path / "job-new-checkpoints" / "checkpoint-20"
    assert tree(dest) == storage.originals[("job-new", 0, "checkpoint-20")]


def test_download_into_an_empty_existing_directory_works(storage, tmp_path):
    (tmp_path / "out" / "checkpoint-5").mkdir(parents=True)
    result = cli("checkpoints", "download", "--project", "proj", "--job-id", "job-old",
                 "--target-directory", tmp_path / "out", "--storage-root", storage.url)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (
        tree(tmp_path / "out" / "checkpoint-5") == storage.originals[("job-old", 0, "checkpoint-5")]
    )


def test_download_refuses_a_non_empty_destination(storage, tmp_path):
    dest = tmp_path / "job-new-checkpoints" / "checkpoint-100"
    dest.mkdir(parents=True)
    (dest / "mine.txt").write_text("keep me")
    result = cli("checkpoints", "download", "--storage-root", storage.url, cwd=tmp_path)
    assert result.returncode == 1
    assert "already exists and is not empty" in result.stderr
    assert "--target-directory" in result.stderr
    assert tree(dest) == {"mine.txt": b"keep me"}


def test_download_with_no_match_names_what_exists_and_writes_nothing(storage, tmp_path):
    inventory = "checkpoint-20 (ranks 0, 1), checkpoint-100 (ranks 1, 2)"
    for args, says in (
        (("--name", "checkpoint-999"), "job job-new has no checkpoint 'checkpoint-999'"),
        (("--name", "checkpoint-100", "--rank", "0"),
         "job job-new has no checkpoint 'checkpoint-100' from rank 0"),
        (("--rank", "5"), "rank 5 of job job-new uploaded no checkpoints"),
    ):  # fmt: skip
        result = cli("checkpoints", "download", "--job-id", "job-new", *args,
                     "--storage-root", storage.url, cwd=tmp_path)  # fmt: skip
        assert result.returncode == 1, result.stdout
        assert says in result.stderr
        assert inventory in result.stderr
    empty = cli("checkpoints", "download", "--job-id", "job-empty", "--storage-root", storage.url,
                cwd=tmp_path)  # fmt: skip
    assert empty.returncode == 1
    assert "job job-empty has no uploaded checkpoints" in empty.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_download_that_fails_its_checksum_keeps_nothing(tmp_path):
    root = StorageRoot(tmp_path / "storage")
    JobStore(root).create(make_record("job-x", "proj", 1.0), JobStatus.new("job-x"))
    local = tmp_path / "local" / "checkpoint-1"
    write_checkpoint(local, full_checkpoint(1))
    manifest = CheckpointStore(root).upload(local, "proj", "job-x", 0)
    stored = tmp_path / "storage" / manifest.files_dir / "config.json"
    stored.write_bytes(b"tampered")
    work = tmp_path / "work"
    work.mkdir()
    result = cli("checkpoints", "download", "--job-id", "job-x", "--storage-root", root.url,
                 cwd=work)  # fmt: skip
    assert result.returncode == 1
    assert "does not match its manifest checksum" in result.stderr
    assert list(work.iterdir()) == []


# --- SDK -------------------------------------------------------------------------------------


def test_job_handle_lists_its_own_checkpoints_oldest_first(storage):
    job = get_job("job-new", storage_root=storage.url)
    found = job.checkpoints()
    assert [(m.name, m.node_rank, m.checkpoint_type, m.lora_rank) for m in found] == [
        ("checkpoint-20", 0, "full", None),
        ("checkpoint-20", 1, "full", None),
        ("checkpoint-100", 1, "lora", 16),
        ("checkpoint-100", 2, "lora", 16),
    ]
    assert [m.created_at for m in found] == sorted(m.created_at for m in found)
    assert {f.path for f in found[0].files} == {"model.safetensors", "config.json",
                                                "tokenizer/vocab.txt"}  # fmt: skip
    assert [m.name for m in get_job("job-old", storage_root=storage.url).checkpoints()] == [
        "checkpoint-5"
    ]
    assert get_job("job-empty", storage_root=storage.url).checkpoints() == []

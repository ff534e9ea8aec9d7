"""`orchestrator download` (a job's code) and `orchestrator checkpoints urls`, as a user runs them.

No Ray: the job is stored as `push` stores it (`store_job`), on the moto S3 server, and its
checkpoint uploaded through the same `CheckpointStore.upload` the nodes use. The signed URLs are
fetched over HTTP, as `curl` would.
"""

from __future__ import annotations

import hashlib
import json
import os
import urllib.request
import uuid
from pathlib import Path

import pytest
from conftest import make_job
from test_cli_checkpoints import cli, tree

from orchestrator.client.prepare import prepare_job
from orchestrator.client.submit import store_job
from orchestrator.storage.checkpoints import CheckpointStore
from orchestrator.storage.root import StorageRoot

CONFIG = """
from orchestrator import definitions as d
project = d.TrainingProject(
    name="downloads",
    job=d.TrainingJob(image=d.Image(base_image="python:3.11"),
                      runtime=d.Runtime(start_commands=["python train.py"])),
)
"""


@pytest.fixture(scope="module")
def stored(s3_server: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A job pushed (stored) to a fresh bucket, with one checkpoint on rank 0."""
    base = tmp_path_factory.mktemp("download")
    files = {"train.py": "print('training')\n", "lib/util.py": "X = 1\n"}
    (base / "job" / "lib").mkdir(parents=True)
    config = make_job(base / "job", CONFIG, files)
    bucket = f"dl-{uuid.uuid4().hex[:8]}"
    root = StorageRoot(f"s3://{bucket}/orchestrator")
    root.fs.mkdir(bucket)
    record = store_job(prepare_job(config), root, "job-dl", ray_address=None)
    checkpoint = base / "checkpoint-3"
    checkpoint.mkdir()
    written = {"model.bin": os.urandom(300_000), "config.json": b'{"step": 3}'}
    for name, data in written.items():
        (checkpoint / name).write_bytes(data)
    CheckpointStore(root).upload(checkpoint, record.project_key, record.job_id, 0)
    return {"root": root.url, "job_dir": config.parent, "checkpoint": written}


def test_download_unpacks_the_code_as_it_was_pushed(stored, tmp_path):
    target = tmp_path / "code"
    result = cli("download", "--job-id", "job-dl", "--storage-root", stored["root"],
                 "--target-directory", target)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == target.resolve()
    assert tree(target) == tree(stored["job_dir"])


def test_download_defaults_beside_you_and_refuses_a_non_empty_target(stored, tmp_path):
    result = cli("download", "--job-id", "job-dl", "--storage-root", stored["root"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "job-dl-workspace" / "train.py").read_text() == "print('training')\n"
    again = cli("download", "--job-id", "job-dl", "--storage-root", stored["root"], cwd=tmp_path)
    assert again.returncode == 1
    assert "already exists and is not empty" in again.stderr


def test_download_of_a_job_whose_archive_is_gone_says_so_and_makes_nothing(s3_server, tmp_path):
    root = StorageRoot(f"s3://dl-{uuid.uuid4().hex[:8]}/orchestrator")
    root.fs.mkdir(root.url.split("/")[2])
    record = store_job(prepare_job(make_job(tmp_path / "job", CONFIG)), root, "job-gone", None)
    root.fs.rm(root.path(record.archive.path))
    target = tmp_path / "code"
    result = cli("download", "--job-id", "job-gone", "--storage-root", root.url,
                 "--target-directory", target)  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "is no longer in" in result.stderr and "Traceback" not in result.stderr
    assert not target.exists()


def test_checkpoint_urls_fetch_each_file_until_they_expire(stored):
    result = cli("checkpoints", "urls", "--job-id", "job-dl", "--storage-root", stored["root"],
                 "--expires", "600", "-o", "json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    listing = json.loads(result.stdout)
    assert listing["checkpoint"]["name"] == "checkpoint-3"
    by_path = {f["path"]: f for f in listing["files"]}
    assert sorted(by_path) == sorted(stored["checkpoint"])
    for path, data in stored["checkpoint"].items():
        url = by_path[path]["url"]
        assert "Expires=" in url or "X-Amz-Expires=600" in url, url
        with urllib.request.urlopen(url, timeout=30) as response:  # a plain HTTP client
            body = response.read()
        assert body == data
        assert hashlib.sha256(body).hexdigest() == by_path[path]["sha256"]

    text = cli("checkpoints", "urls", "--job-id", "job-dl", "--storage-root", stored["root"])
    assert text.returncode == 0, text.stderr
    lines = dict(line.split("\t") for line in text.stdout.splitlines())
    assert sorted(lines) == sorted(stored["checkpoint"])
    assert "valid until" in text.stderr

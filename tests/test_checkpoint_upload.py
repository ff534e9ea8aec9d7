"""Checkpoint upload and download on local, S3 (moto) and GCS (fake-gcs-server) roots; no Ray.

The uploader is used directly here; on a cluster it is a Ray actor in each rank's bundle.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from orchestrator.agents.checkpoint_uploader import CheckpointUploader
from orchestrator.storage.checkpoints import CheckpointStore, UploadSettings
from orchestrator.storage.root import StorageRoot


def write_checkpoint(directory: Path, files: dict[str, bytes]) -> Path:
    """Written the recommended way: into a hidden directory, then renamed into place."""
    hidden = directory.parent / f".{directory.name}.tmp"
    for rel, data in files.items():
        (hidden / rel).parent.mkdir(parents=True, exist_ok=True)
        (hidden / rel).write_bytes(data)
    hidden.rename(directory)
    return directory


def wait_until(predicate, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_upload_commits_a_manifest_and_download_checks_it(root: StorageRoot, tmp_path):
    local = write_checkpoint(
        tmp_path / "checkpoint-100",
        {"model.safetensors": os.urandom(3 * 1024 * 1024 + 7), "sub/optimizer.pt": b"opt"},
    )
    store = CheckpointStore(root)
    manifest = store.upload(local, "proj", "job1", 0, UploadSettings(concurrency=2))
    assert [f.path for f in manifest.files] == ["model.safetensors", "sub/optimizer.pt"]
    assert manifest.size_bytes == 3 * 1024 * 1024 + 7 + 3
    assert manifest.checkpoint_type == "full"
    (listed,) = store.list("proj", "job1")
    assert listed.name == "checkpoint-100" and listed.node_rank == 0
    got = store.download(listed, tmp_path / "down")
    for rel in ("model.safetensors", "sub/optimizer.pt"):
        assert (got / rel).read_bytes() == (local / rel).read_bytes()


def test_a_lora_adapter_is_recognised_with_its_rank(root: StorageRoot, tmp_path):
    local = write_checkpoint(
        tmp_path / "checkpoint-7",
        {"adapter_config.json": json.dumps({"r": 32}).encode(), "adapter_model.bin": b"w"},
    )
    manifest = CheckpointStore(root).upload(local, "proj", "job1", 1)
    assert (manifest.checkpoint_type, manifest.lora_rank) == ("lora", 32)


def test_a_corrupted_file_is_refused_on_download(tmp_path):
    root = StorageRoot(tmp_path / "root")
    store = CheckpointStore(root)
    store.upload(write_checkpoint(tmp_path / "c1", {"w.bin": b"good"}), "p", "j", 0)
    root.write_bytes("checkpoints/p/j/rank-0/c1/w.bin", b"evil")
    with pytest.raises(OSError, match="does not match its manifest checksum"):
        store.download(store.list("p", "j")[0], tmp_path / "down")


def test_uploader_uploads_settled_checkpoints_while_the_job_runs(root: StorageRoot, tmp_path):
    local = tmp_path / "ckpts"
    local.mkdir()
    uploader = CheckpointUploader(
        "proj", "job1", 0, root.url, str(local), {"settle_s": 0.5}, volume_size_gib=None
    )
    store = CheckpointStore(root)
    write_checkpoint(local / "checkpoint-1", {"w.bin": b"one"})
    (local / ".checkpoint-2.partial").mkdir()  # hidden: being written, never uploaded
    wait_until(lambda: [m.name for m in store.list("proj", "job1")] == ["checkpoint-1"],
               "checkpoint-1 to be uploaded while the job runs")  # fmt: skip
    write_checkpoint(local / "checkpoint-2", {"w.bin": b"two"})
    result = uploader.flush(timeout=60)
    assert result["uploaded"] == ["checkpoint-1", "checkpoint-2"] and result["pending"] == []
    assert [m.name for m in store.list("proj", "job1")] == ["checkpoint-1", "checkpoint-2"]
    assert any("checkpoint checkpoint-1 uploaded: 1 files" in e for e in result["events"])


def test_flush_uploads_what_had_not_settled(tmp_path):
    root = StorageRoot(tmp_path / "root")
    local = tmp_path / "ckpts"
    local.mkdir()
    uploader = CheckpointUploader("p", "j", 0, root.url, str(local), {"settle_s": 3600})
    write_checkpoint(local / "checkpoint-9", {"w.bin": b"nine"})
    time.sleep(1.2)  # two scans: it is seen, but far from settled
    assert CheckpointStore(root).list("p", "j") == []
    assert uploader.flush(timeout=30)["uploaded"] == ["checkpoint-9"]
    assert [m.name for m in CheckpointStore(root).list("p", "j")] == ["checkpoint-9"]


def test_delete_local_after_upload(tmp_path):
    root = StorageRoot(tmp_path / "root")
    local = tmp_path / "ckpts"
    local.mkdir()
    uploader = CheckpointUploader(
        "p", "j", 0, root.url, str(local), {"settle_s": 0, "delete_local": True}
    )
    write_checkpoint(local / "checkpoint-1", {"w.bin": b"x"})
    wait_until(lambda: not (local / "checkpoint-1").exists(), "the local copy to be deleted")
    assert [m.name for m in CheckpointStore(root).list("p", "j")] == ["checkpoint-1"]
    uploader.flush(timeout=10)


def test_volume_size_warns_then_reports_over(tmp_path):
    root = StorageRoot(tmp_path / "root")
    local = tmp_path / "ckpts"
    local.mkdir()
    gib = 2**30
    # A sparse file counts its full size, as the volume would.
    with open(local / "big.bin", "wb") as f:
        f.truncate(int(0.95 * gib))
    uploader = CheckpointUploader("p", "j", 0, root.url, str(local), {"settle_s": 3600}, 1)
    wait_until(lambda: any("warning" in e for e in uploader.poll(0)["events"]), "the warning")
    assert uploader.poll(0)["over_volume"] is None
    with open(local / "big2.bin", "wb") as f:
        f.truncate(int(0.1 * gib))
    wait_until(lambda: uploader.poll(0)["over_volume"], "the over-volume error")
    assert "over volume_size_gib=1" in uploader.poll(0)["over_volume"]
    uploader._stop.set()


KILLED_UPLOADER = """
import sys
from pathlib import Path
from orchestrator.storage.checkpoints import CheckpointStore, UploadSettings
from orchestrator.storage.root import StorageRoot
store = CheckpointStore(StorageRoot(sys.argv[1]))
print("uploading", flush=True)
store.upload(Path(sys.argv[2]), "p", "j", 0, UploadSettings(concurrency=1, bandwidth_mbps=2))
print("done", flush=True)
"""


def test_a_killed_upload_shows_nothing_and_a_restarted_uploader_completes_it(root, tmp_path):
    local = tmp_path / "ckpts"
    local.mkdir()
    write_checkpoint(
        local / "checkpoint-5", {f"shard-{i}.bin": os.urandom(1_000_000) for i in range(8)}
    )
    script = tmp_path / "upload.py"
    script.write_text(textwrap.dedent(KILLED_UPLOADER))
    worker = subprocess.Popen(
        [sys.executable, str(script), root.url, str(local / "checkpoint-5")],
        stdout=subprocess.PIPE, text=True, env={**os.environ},
    )  # fmt: skip
    try:
        assert worker.stdout.readline().strip() == "uploading"
        wait_until(lambda: root.list_names("checkpoints/p/j/rank-0/checkpoint-5"), "some files")
        os.kill(worker.pid, signal.SIGKILL)  # 8 MB at 2 MB/s: killed mid-upload
        worker.wait()
    finally:
        if worker.poll() is None:
            worker.kill()
    store = CheckpointStore(root)
    assert root.list_names("checkpoints/p/j/rank-0/checkpoint-5"), "partial files are there"
    assert store.list("p", "j") == [], "but no reader may see a half checkpoint"

    restarted = CheckpointUploader("p", "j", 0, root.url, str(local), {"settle_s": 0})
    result = restarted.flush(timeout=60)
    assert result["uploaded"] == ["checkpoint-5"]
    (manifest,) = store.list("p", "j")
    assert len(manifest.files) == 8
    got = store.download(manifest, tmp_path / "down")
    assert (got / "shard-3.bin").read_bytes() == (
        local / "checkpoint-5" / "shard-3.bin"
    ).read_bytes()


def test_an_earlier_jobs_leftovers_are_not_uploaded_as_this_jobs(tmp_path):
    root = StorageRoot(tmp_path / "root")
    local = tmp_path / "ckpts"
    old = write_checkpoint(local / "checkpoint-50", {"w.bin": b"last week"})
    for path in (old / "w.bin", old):
        os.utime(path, (time.time() - 3600, time.time() - 3600))
    started = time.time() - 60
    uploader = CheckpointUploader("p", "j", 0, root.url, str(local), {"settle_s": 0}, None, started)
    write_checkpoint(local / "checkpoint-1", {"w.bin": b"mine"})
    result = uploader.flush(timeout=30)
    assert result["uploaded"] == ["checkpoint-1"] and result["pending"] == []
    assert any(
        "skipping checkpoint-50: written before this job started" in e for e in result["events"]
    )
    assert [m.name for m in CheckpointStore(root).list("p", "j")] == ["checkpoint-1"]


def test_a_failed_upload_is_reported_once(tmp_path):
    root = StorageRoot(tmp_path / "root")
    local = tmp_path / "ckpts"
    write_checkpoint(local / "checkpoint-1", {"w.bin": b"x"})
    (root.fs.mkdir(root.path("checkpoints/p/j/rank-0"), create_parents=True))
    # A file where the checkpoint's directory must go makes every upload of it fail.
    Path(root.path("checkpoints/p/j/rank-0/checkpoint-1")).write_text("in the way")
    uploader = CheckpointUploader("p", "j", 0, root.url, str(local), {"settle_s": 0})
    result = uploader.flush(timeout=30)
    assert result["pending"] == [] and list(result["failed"]) == ["checkpoint-1"]


def test_a_checkpoint_rewritten_in_place_is_uploaded_again(tmp_path):
    root = StorageRoot(tmp_path / "root")
    local = tmp_path / "ckpts"
    (local / "checkpoint-1").mkdir(parents=True)
    (local / "checkpoint-1" / "w.bin").write_bytes(b"half")  # written in place, in two goes
    store = CheckpointStore(root)
    uploader = CheckpointUploader("p", "j", 0, root.url, str(local), {"settle_s": 0.2})
    wait_until(lambda: store.list("p", "j"), "the first (early) upload")
    (local / "checkpoint-1" / "w.bin").write_bytes(b"half and the rest")
    wait_until(lambda: store.list("p", "j")[0].size_bytes == len(b"half and the rest"),
               "the checkpoint to be uploaded again")  # fmt: skip
    got = store.download(store.list("p", "j")[0], tmp_path / "down")
    assert (got / "w.bin").read_bytes() == b"half and the rest"
    uploader.flush(timeout=10)

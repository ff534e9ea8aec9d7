"""Checkpoint upload and download on local, S3 (moto) and GCS (fake-gcs-server) roots; no Ray.

The uploader is used directly here; on a cluster it is a Ray actor in each rank's bundle.
tests/test_checkpoint_writers.py runs the same rules through jobs, writer by writer.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from orchestrator.agents.checkpoint_uploader import CheckpointUploader
from orchestrator.node.checkpoint_rules import earlier_checkpoints
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
        time.sleep(0.05)


def scanned(up: CheckpointUploader, scans: int = 3) -> None:
    """Wait until `up` has finished `scans` more scans (at least two begun after this call):
    what it has not uploaded by then it did not upload on sight. A wait on its own counter, not
    on a clock, so a loaded machine cannot make an absence check pass too early."""
    start = up.poll().scans
    wait_until(lambda: up.poll().scans >= start + scans, f"{scans} more scans")


def uploader(root: StorageRoot, local: Path, rank: int = 0, earlier=None, **settings):
    """Watching when returned, as the controller has it before the commands start."""
    local.mkdir(parents=True, exist_ok=True)
    up = CheckpointUploader(
        "p", "j", rank, root.url, str(local), settings, None, earlier if earlier else {}
    )
    assert up.ready(10)
    return up


def states(result: dict) -> dict[str, str]:
    return {e.name: e.state for e in result.entries}


def reasons(result: dict) -> dict[str, str | None]:
    return {e.name: e.reason for e in result.entries}


def names(root: StorageRoot) -> list[str]:
    return [m.name for m in CheckpointStore(root).list("p", "j")]


def test_upload_commits_a_manifest_and_download_checks_it(root: StorageRoot, tmp_path):
    local = write_checkpoint(
        tmp_path / "checkpoint-100",
        {"model.safetensors": os.urandom(3 * 1024 * 1024 + 7), "sub/optimizer.pt": b"opt"},
    )
    store = CheckpointStore(root)
    manifest = store.upload(local, "proj", "job1", 0, UploadSettings(concurrency=2))
    assert [f.path for f in manifest.files] == ["model.safetensors", "sub/optimizer.pt"]
    assert manifest.size_bytes == 3 * 1024 * 1024 + 7 + 3
    assert (manifest.checkpoint_type, manifest.version, manifest.complete) == ("full", 1, True)
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
    manifest = store.upload(write_checkpoint(tmp_path / "c1", {"w.bin": b"good"}), "p", "j", 0)
    root.write_bytes(f"{manifest.files_dir}/w.bin", b"evil")
    with pytest.raises(OSError, match="does not match its manifest checksum"):
        store.download(store.list("p", "j")[0], tmp_path / "down")


def test_uploader_uploads_settled_checkpoints_while_the_job_runs(root: StorageRoot, tmp_path):
    local = tmp_path / "ckpts"
    up = uploader(root, local, settle_s=0.5)
    write_checkpoint(local / "checkpoint-1", {"w.bin": b"one"})
    (local / ".checkpoint-2.partial").mkdir()  # hidden: being written, never uploaded
    wait_until(lambda: names(root) == ["checkpoint-1"], "checkpoint-1 while the job runs")
    write_checkpoint(local / "checkpoint-2", {"w.bin": b"two"})
    result = up.flush(timeout=60, clean=True)
    assert states(result) == {"checkpoint-1": "uploaded", "checkpoint-2": "uploaded"}
    assert names(root) == ["checkpoint-1", "checkpoint-2"]
    assert any("checkpoint checkpoint-1 uploaded" in e and "1 files" in e for e in result.events)


def test_flush_uploads_what_had_not_settled_once_its_writer_exited_cleanly(tmp_path):
    root = StorageRoot(tmp_path / "root")
    local = tmp_path / "ckpts"
    up = uploader(root, local, settle_s=3600)
    (local / "checkpoint-9").mkdir()
    (local / "checkpoint-9" / "w.bin").write_bytes(b"nine")  # in place: only settling says done
    scanned(up)  # it is seen, but far from settled
    assert names(root) == []
    assert states(up.flush(timeout=30, clean=True)) == {"checkpoint-9": "uploaded"}
    (manifest,) = CheckpointStore(root).list("p", "j")
    assert manifest.complete


def test_a_checkpoint_cut_off_by_its_writers_death_is_stored_as_incomplete(root, tmp_path):
    local = tmp_path / "ckpts"
    up = uploader(root, local, settle_s=3600)
    write_checkpoint(local / "checkpoint-1", {"w.bin": b"whole"})
    wait_until(lambda: names(root) == ["checkpoint-1"], "the renamed checkpoint")
    (local / "checkpoint-2").mkdir()
    (local / "checkpoint-2" / "model.bin").write_bytes(b"1 of 2 files")
    scanned(up)
    result = up.flush(timeout=30, clean=False, how="rank 0's command exited with code 137")
    assert states(result) == {"checkpoint-1": "uploaded", "checkpoint-2": "incomplete"}
    why = reasons(result)["checkpoint-2"]
    assert why.startswith("rank 0's command exited with code 137")
    assert "before it was complete" in why
    by_name = {m.name: m for m in CheckpointStore(root).list("p", "j")}
    assert by_name["checkpoint-1"].complete and not by_name["checkpoint-2"].complete
    assert by_name["checkpoint-2"].incomplete_reason == why


def test_a_settle_judged_after_the_writer_died_is_taken_back(tmp_path):
    """The uploader hears of a rank's end a moment late; what settled only in that moment had
    not been quiet for settle_s while its writer lived."""
    root = StorageRoot(tmp_path / "root")
    local = tmp_path / "ckpts"
    up = uploader(root, local, settle_s=0.5)
    (local / "checkpoint-3").mkdir()
    (local / "checkpoint-3" / "w.bin").write_bytes(b"cut short")
    written = time.time()
    wait_until(lambda: names(root) == ["checkpoint-3"], "the settled upload")
    up.writer_ended(False, "rank 0's command exited with code 137", at=written + 0.1)
    wait_until(lambda: not CheckpointStore(root).list("p", "j")[0].complete, "the take-back")
    result = up.flush(timeout=30, clean=False)
    assert states(result) == {"checkpoint-3": "incomplete"}
    assert any("checkpoint-3 marked INCOMPLETE" in e for e in result.events)


def test_delete_local_after_upload(tmp_path):
    root = StorageRoot(tmp_path / "root")
    local = tmp_path / "ckpts"
    up = uploader(root, local, settle_s=0, delete_local=True)
    write_checkpoint(local / "checkpoint-1", {"w.bin": b"x"})
    wait_until(lambda: not (local / "checkpoint-1").exists(), "the local copy to be deleted")
    assert names(root) == ["checkpoint-1"]
    assert states(up.flush(timeout=10, clean=True)) == {"checkpoint-1": "uploaded"}


def test_volume_size_warns_then_reports_over(tmp_path):
    root = StorageRoot(tmp_path / "root")
    local = tmp_path / "ckpts"
    local.mkdir()
    gib = 2**30
    # A sparse file counts its full size, as the volume would.
    with open(local / "big.bin", "wb") as f:
        f.truncate(int(0.95 * gib))
    up = CheckpointUploader("p", "j", 0, root.url, str(local), {"settle_s": 3600}, 1, {})
    wait_until(lambda: any("warning" in e for e in up.poll().events), "the warning")
    assert up.poll().over_volume is None
    with open(local / "big2.bin", "wb") as f:
        f.truncate(int(0.1 * gib))
    wait_until(lambda: up.poll().over_volume, "the over-volume error")
    assert "over volume_size_gib=1" in up.poll().over_volume
    up._stop.set()


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
    files = "checkpoints/p/j/rank-0/checkpoint-5/v1"
    try:
        assert worker.stdout.readline().strip() == "uploading"
        wait_until(lambda: root.list_names(files), "some files")
        os.kill(worker.pid, signal.SIGKILL)  # 8 MB at 2 MB/s: killed mid-upload
        worker.wait()
    finally:
        if worker.poll() is None:
            worker.kill()
    store = CheckpointStore(root)
    assert root.list_names(files), "partial files are there"
    assert store.list("p", "j") == [], "but no reader may see a half checkpoint"

    restarted = uploader(root, local, settle_s=0)
    assert states(restarted.flush(timeout=60, clean=True)) == {"checkpoint-5": "uploaded"}
    (manifest,) = store.list("p", "j")
    assert len(manifest.files) == 8
    got = store.download(manifest, tmp_path / "down")
    assert (got / "shard-3.bin").read_bytes() == (
        local / "checkpoint-5" / "shard-3.bin"
    ).read_bytes()


def test_a_restarted_uploader_skips_what_is_stored_and_redoes_what_changed(tmp_path):
    root = StorageRoot(tmp_path / "root")
    local = tmp_path / "ckpts"
    first = uploader(root, local, settle_s=0)
    write_checkpoint(local / "checkpoint-1", {"w.bin": b"kept"})
    write_checkpoint(local / "checkpoint-2", {"w.bin": b"old"})
    wait_until(lambda: len(names(root)) == 2, "both uploads")
    first._stop.set()  # as a killed uploader: gone without a flush
    (local / "checkpoint-2" / "w.bin").write_bytes(b"rewritten while no uploader watched")
    restarted = uploader(root, local, settle_s=0)
    result = restarted.flush(timeout=30, clean=True)
    assert states(result) == {"checkpoint-1": "uploaded", "checkpoint-2": "uploaded"}
    uploads = [e for e in result.events if " uploaded" in e]
    assert len(uploads) == 1 and "checkpoint-2 uploaded again" in uploads[0]
    by_name = {m.name: m for m in CheckpointStore(root).list("p", "j")}
    assert (by_name["checkpoint-1"].version, by_name["checkpoint-2"].version) == (1, 2)


def test_an_earlier_jobs_leftovers_are_not_uploaded_as_this_jobs(tmp_path):
    root = StorageRoot(tmp_path / "root")
    local = tmp_path / "ckpts"
    write_checkpoint(local / "checkpoint-50", {"w.bin": b"last week"})
    write_checkpoint(local / "checkpoint-60", {"w.bin": b"last week too"})
    up = uploader(root, local, settle_s=0, earlier=earlier_checkpoints(local))
    (local / "checkpoint-1").mkdir()  # this job's, though it stays empty a while
    scanned(up)
    (local / "checkpoint-1" / "w.bin").write_bytes(b"mine")
    (local / "checkpoint-60" / "w.bin").write_bytes(b"overwritten by this job")
    result = up.flush(timeout=30, clean=True)
    assert states(result) == {
        "checkpoint-1": "uploaded",
        "checkpoint-50": "earlier_job",
        "checkpoint-60": "uploaded",
    }
    said = [e for e in result.events if "skipping checkpoint-50" in e]
    assert len(said) == 1 and "an earlier job's" in said[0]
    assert any("checkpoint-60 was changed by this job" in e for e in result.events)
    assert names(root) == ["checkpoint-1", "checkpoint-60"]


def test_copied_checkpoints_keep_old_file_times_and_are_still_this_jobs(root, tmp_path):
    """`cp -a`, `shutil.copytree`, `tar x`: a base model exported as checkpoint-0."""
    base = tmp_path / "base-model"
    write_checkpoint(base, {"model.safetensors": os.urandom(5000), "config.json": b"{}"})
    year_ago = time.time() - 365 * 86400
    for path in (*base.rglob("*"), base):
        os.utime(path, (year_ago, year_ago))
    local = tmp_path / "ckpts"
    up = uploader(root, local, settle_s=0.2)
    shutil.copytree(base, local / "checkpoint-0")  # copy2: the old times come along
    assert (local / "checkpoint-0" / "config.json").stat().st_mtime < year_ago + 1
    result = up.flush(timeout=30, clean=True)
    assert states(result) == {"checkpoint-0": "uploaded"}
    assert names(root) == ["checkpoint-0"]


def test_a_failed_upload_is_reported_once(tmp_path):
    root = StorageRoot(tmp_path / "root")
    local = tmp_path / "ckpts"
    write_checkpoint(local / "checkpoint-1", {"w.bin": b"x"})
    root.fs.mkdir(root.path("checkpoints/p/j/rank-0"), create_parents=True)
    # A file where the checkpoint's directory must go makes every upload of it fail.
    Path(root.path("checkpoints/p/j/rank-0/checkpoint-1")).write_text("in the way")
    result = uploader(root, local, settle_s=0).flush(timeout=30, clean=True)
    assert states(result) == {"checkpoint-1": "failed"}
    assert "Error" in reasons(result)["checkpoint-1"]


def test_a_rewrite_replaces_the_stored_version_atomically(root, tmp_path):
    """While version 2 uploads, a reader still downloads version 1 whole; then version 2."""
    first = {f"s{i}.bin": bytes([i]) * 100_000 for i in range(4)}
    local = write_checkpoint(tmp_path / "checkpoint-1", first)
    store = CheckpointStore(root)
    v1 = store.upload(local, "p", "j", 0)
    second = {name: os.urandom(100_000) for name in first}
    for name, data in second.items():
        (local / name).write_bytes(data)
    # One file at a time at 0.1 MB/s: the files after the first wait about 1 s each.
    slow = UploadSettings(bandwidth_mbps=0.1, concurrency=1)
    upload = threading.Thread(target=lambda: store.upload(local, "p", "j", 0, slow, replaces=v1))
    upload.start()
    wait_until(lambda: root.list_names("checkpoints/p/j/rank-0/checkpoint-1/v2"), "version 2")
    during = store.manifest("p", "j", 0, "checkpoint-1")
    read = store.download(during, tmp_path / "during")
    assert during.version == 1 and upload.is_alive()
    assert {name: (read / name).read_bytes() for name in first} == first
    upload.join()
    current = store.manifest("p", "j", 0, "checkpoint-1")
    assert current.version == 2
    assert root.list_names("checkpoints/p/j/rank-0/checkpoint-1") == ["v2"]
    read = store.download(current, tmp_path / "after")
    assert {name: (read / name).read_bytes() for name in first} == second


def test_a_checkpoint_deleted_during_its_upload_is_abandoned_cleanly(root, tmp_path):
    """The Hugging Face Trainer's save_total_limit removes the oldest checkpoint, maybe while
    it uploads: nothing of it is kept, a line says so, and the next one is uploaded."""
    local = tmp_path / "ckpts"
    up = uploader(root, local, settle_s=0, bandwidth_mbps=1, concurrency=1)
    write_checkpoint(local / "checkpoint-1", {f"s{i}.bin": os.urandom(400_000) for i in range(5)})
    partial = "checkpoints/p/j/rank-0/checkpoint-1/v1"
    wait_until(lambda: root.list_names(partial), "the upload to be under way")
    shutil.rmtree(local / "checkpoint-1")
    write_checkpoint(local / "checkpoint-2", {"w.bin": b"next"})
    result = up.flush(timeout=60, clean=True)
    assert states(result) == {"checkpoint-1": "deleted", "checkpoint-2": "uploaded"}
    assert "during its upload" in reasons(result)["checkpoint-1"]
    assert any("upload abandoned, nothing partial kept" in e for e in result.events)
    assert names(root) == ["checkpoint-2"]
    assert root.list_names("checkpoints/p/j/rank-0/checkpoint-1") == []


def test_a_checkpoint_made_and_deleted_between_two_scans_is_still_accounted_for(root, tmp_path):
    """A trainer with save_total_limit can save and rotate a checkpoint away faster than a scan
    (0.1 s): the job's end still says what became of it, not nothing."""
    local = tmp_path / "ckpts"
    up = uploader(root, local, settle_s=0)
    (local / "checkpoint-1").mkdir()  # as the Trainer does: created in place, filled, rotated
    (local / "checkpoint-1" / "w.bin").write_bytes(b"gone at once")
    shutil.rmtree(local / "checkpoint-1")  # well within one scan
    write_checkpoint(local / "checkpoint-2", {"w.bin": b"kept"})
    result = up.flush(timeout=60, clean=True)
    assert states(result) == {"checkpoint-1": "deleted", "checkpoint-2": "uploaded"}
    assert "deleted by the job before it was uploaded" in reasons(result)["checkpoint-1"]
    assert any("checkpoint-1 was deleted by the job" in e for e in result.events)


def test_a_directory_staged_and_renamed_within_one_scan_is_not_called_deleted(root, tmp_path):
    local = tmp_path / "ckpts"
    up = uploader(root, local, settle_s=0)
    (local / "staging").mkdir()  # a writer's own staging name, renamed at once
    (local / "staging" / "w.bin").write_bytes(b"step 5")
    (local / "staging").rename(local / "checkpoint-5")
    result = up.flush(timeout=60, clean=True)
    assert states(result) == {"checkpoint-5": "uploaded"}


def test_an_empty_directory_is_never_a_checkpoint(tmp_path):
    root = StorageRoot(tmp_path / "root")
    local = tmp_path / "ckpts"
    up = uploader(root, local, settle_s=0)
    (local / "checkpoint-1").mkdir()
    scanned(up)
    result = up.flush(timeout=10, clean=True)
    assert states(result) == {"checkpoint-1": "ignored"}
    assert names(root) == []


def test_top_level_links_are_not_followed_and_top_level_files_are_one_checkpoint(root, tmp_path):
    """A link at the top is never followed; the files at the top (`torch.save(...,
    f"{dir}/model.pt")`) are the checkpoint `top-level` (tests/test_checkpoint_top_level.py)."""
    private = tmp_path / "home" / ".ssh"
    private.mkdir(parents=True)
    (private / "id_rsa").write_text("PRIVATE KEY 91c2")
    local = tmp_path / "ckpts"
    up = uploader(root, local, settle_s=0)
    os.symlink(private, local / "latest")  # a link to a directory outside
    os.symlink(private / "id_rsa", local / "key")  # a link to a file outside
    (local / "model.pt").write_bytes(b"a file at the top")
    write_checkpoint(local / "checkpoint-1", {"w.bin": b"x"})
    result = up.flush(timeout=30, clean=True)
    assert states(result) == {
        "checkpoint-1": "uploaded", "key": "ignored", "latest": "ignored", "top-level": "uploaded",
    }  # fmt: skip
    assert names(root) == ["checkpoint-1", "top-level"]
    (top,) = [m for m in CheckpointStore(root).list("p", "j") if m.name == "top-level"]
    assert [f.path for f in top.files] == ["model.pt"]
    said = [e for e in result.events if "ignoring latest" in e]
    assert len(said) == 1 and "symbolic link" in said[0]
    assert not any("ignoring model.pt" in e for e in result.events), result.events
    assert not any(b"PRIVATE KEY" in root.fs.cat_file(p) for p in root.fs.find(root.path("")))


def test_temporary_names_are_not_checkpoints_until_renamed(root, tmp_path):
    local = tmp_path / "ckpts"
    up = uploader(root, local, settle_s=0, temporary_patterns=("*.partial-save",))
    for name in ("tmp-checkpoint-5", "state.orbax-checkpoint-tmp-1732", "c7.partial-save"):
        (local / name).mkdir()
        (local / name / "w.bin").write_bytes(b"being written")
    scanned(up)  # quiet for longer than settle_s (0): still not checkpoints
    assert names(root) == []
    os.rename(local / "tmp-checkpoint-5", local / "checkpoint-5")
    os.rename(local / "state.orbax-checkpoint-tmp-1732", local / "state")
    result = up.flush(timeout=30, clean=True)
    assert states(result) == {
        "checkpoint-5": "uploaded", "state": "uploaded", "c7.partial-save": "ignored",
    }  # fmt: skip
    assert reasons(result)["c7.partial-save"].startswith("a writer's temporary directory")
    assert names(root) == ["checkpoint-5", "state"]


def test_shards_without_metadata_wait_on_rank_0_only(tmp_path):
    """torch.distributed.checkpoint's coordinator writes .metadata on node rank 0 alone."""
    root = StorageRoot(tmp_path / "root")
    ups = [uploader(root, tmp_path / f"rank-{rank}", rank=rank, settle_s=0.2) for rank in (0, 1)]
    for rank in (0, 1):
        (tmp_path / f"rank-{rank}" / "step-1").mkdir()
        (tmp_path / f"rank-{rank}" / "step-1" / f"__{rank}_0.distcp").write_bytes(b"shard")

    def ranks() -> list[int]:
        return sorted(m.node_rank for m in CheckpointStore(root).list("p", "j"))

    wait_until(lambda: ranks() == [1], "rank 1's shards, settled")
    scanned(ups[0])  # rank 0's, written first, has been quiet for settle_s as long as rank 1's
    assert ranks() == [1], "rank 0 waits for .metadata"
    (tmp_path / "rank-0" / "step-1" / ".metadata").write_bytes(b"plan")
    wait_until(lambda: ranks() == [0, 1], "rank 0's checkpoint, with its .metadata")
    for up in ups:
        up.flush(timeout=10, clean=True)


def test_a_root_refusing_its_first_lookup_in_the_flush_is_a_failed_upload_not_an_error(tmp_path):
    """A checkpoint first seen by the final flush, on a root whose checkpoints/ is a file: the
    flush reports the checkpoint failed (the controller said "uploader unreachable" when the
    lookup's NotADirectoryError escaped it; it depended on which scan saw the checkpoint first)."""
    storage = tmp_path / "root"
    storage.mkdir()
    (storage / "checkpoints").write_text("a file where checkpoints/ must go")
    up = uploader(StorageRoot(storage), tmp_path / "ck", settle_s=3600)
    up._stop.set()  # no watch scan between the write and the flush
    up._thread.join(5)
    write_checkpoint(tmp_path / "ck" / "checkpoint-1", {"w.bin": b"w"})
    result = up.flush(timeout=10, clean=True, how="the commands exited 0")
    assert states(result) == {"checkpoint-1": "failed"}, result.entries
    assert "Not a directory" in (reasons(result)["checkpoint-1"] or ""), result.entries

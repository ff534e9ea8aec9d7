"""Files saved straight into `$BT_CHECKPOINT_DIR` (issue 58): one checkpoint of their own,
`top-level`, with a directory checkpoint's guarantees; the uploader used directly, no Ray.

nanoGPT saves `torch.save(checkpoint, os.path.join(out_dir, 'ckpt.pt'))` over the last one at
every evaluation and resumes from `out_dir/ckpt.pt`; `save_pretrained(os.environ[
"BT_CHECKPOINT_DIR"])` writes config.json and model.safetensors at the top. Through jobs:
tests/test_resume_faults.py (a crash and a retry) and tests/test_deploy.py (served).
"""

from __future__ import annotations

import io
import json
import os
import threading
import time

import pytest
import torch
from test_checkpoint_upload import names, reasons, scanned, states, uploader, wait_until

from orchestrator.node.checkpoint_rules import earlier_checkpoints
from orchestrator.node.node_root import NODE_ROOT_ENV
from orchestrator.storage.checkpoints import CheckpointStore
from orchestrator.storage.local_checkpoint import mark_checkpoint_complete
from orchestrator.storage.root import StorageRoot


def nanogpt_save(out_dir, step: int, size: int = 200_000) -> None:
    """As nanoGPT's train.py: one file, overwritten in place."""
    torch.save({"iter_num": step, "model": torch.full((size,), float(step))},
               os.path.join(out_dir, "ckpt.pt"))  # fmt: skip


def stored_step(store: CheckpointStore, tmp_path, name: str = "top-level") -> tuple[int, int]:
    """(version, iter_num) of the stored ckpt.pt, read back through a download; (0, 0) when
    none is stored."""
    manifest = store.manifest("p", "j", 0, name)
    if manifest is None:
        return 0, 0
    got = store.download(manifest, tmp_path / f"read-{time.monotonic_ns()}")
    return manifest.version, torch.load(got / "ckpt.pt")["iter_num"]


def test_a_file_overwritten_in_place_is_a_new_version_each_time_it_settles(root, tmp_path):
    """Each settled ckpt.pt is stored once, as the next version of `top-level`; a reader polling
    the storage root meanwhile only ever reads a whole torch file of a step that was saved."""
    local = tmp_path / "out"
    store = CheckpointStore(root)
    up = uploader(root, local, settle_s=0.3)
    read: list[int] = []
    done = threading.Event()

    def reader() -> None:
        while not done.is_set():
            manifest = store.manifest("p", "j", 0, "top-level")
            if manifest is not None:
                try:
                    got = store.download(manifest, tmp_path / "reader")
                except FileNotFoundError:
                    continue  # replaced as it was read, and gone since: read the next one
                read.append(torch.load(got / "ckpt.pt")["iter_num"])

    polling = threading.Thread(target=reader)
    polling.start()
    try:
        for step in (250, 500, 750):
            nanogpt_save(local, step)
            wait_until(lambda s=step: stored_step(store, tmp_path)[1] == s, f"step {step} stored")
    finally:
        done.set()
        polling.join()
    result = up.flush(timeout=30, clean=True)
    assert states(result) == {"top-level": "uploaded"}
    assert stored_step(store, tmp_path) == (3, 750)
    uploads = [e for e in result.events if "checkpoint top-level uploaded" in e]
    assert len(uploads) == 3, result.events
    assert "(settled)" in uploads[0] and "version 3 replaces version 2" in uploads[2]
    assert not any("ignoring" in e for e in result.events), result.events
    assert read and set(read) <= {250, 500, 750}, read
    (manifest,) = store.list("p", "j")
    assert (manifest.top_level, [f.path for f in manifest.files]) == (True, ["ckpt.pt"])


def test_a_file_rewritten_during_its_upload_is_uploaded_again_never_half(tmp_path):
    """One file at a time at 0.05 MB/s: meta.json waits 2 s behind ckpt.pt's 100 KB, and is
    rewritten meanwhile. That upload is abandoned, nothing of it kept, and the files are
    uploaded again as they are now."""
    root = StorageRoot(tmp_path / "root")
    local = tmp_path / "out"
    store = CheckpointStore(root)
    up = uploader(root, local, settle_s=0, bandwidth_mbps=0.05, concurrency=1)
    (local / "meta.json").write_text('{"iter_num": 1}')
    nanogpt_save(local, 1, size=25_000)
    v1 = "checkpoints/p/j/rank-0/top-level/v1"
    wait_until(lambda: len(root.list_names(v1)) == 2, "meta.json's turn in the upload")
    nanogpt_save(local, 2, size=25_000)
    (local / "meta.json").write_text('{"iter_num": 2}')
    result = up.flush(timeout=60, clean=True)
    assert states(result) == {"top-level": "uploaded"}
    assert any("checkpoint top-level changed during its upload" in e for e in result.events), (
        result.events
    )
    assert stored_step(store, tmp_path) == (1, 2), "the abandoned upload was never a version"
    got = store.download(store.manifest("p", "j", 0, "top-level"), tmp_path / "got")
    assert json.loads((got / "meta.json").read_text()) == {"iter_num": 2}


def test_files_at_the_top_beside_checkpoint_directories(root, tmp_path):
    """The Hugging Face Trainer's checkpoint-N/ directories, and its final save_model() into
    the same output_dir: the directories are checkpoints, the files at the top one more."""
    local = tmp_path / "out"
    up = uploader(root, local, settle_s=0.2)
    (local / "checkpoint-1").mkdir()
    (local / "checkpoint-1" / "model.safetensors").write_bytes(b"step 1")
    (local / "config.json").write_text("{}")
    (local / "model.safetensors").write_bytes(b"final")
    (local / ".orchestrator-complete").touch()  # marks the files at the top complete
    result = up.flush(timeout=30, clean=True)
    assert states(result) == {"checkpoint-1": "uploaded", "top-level": "uploaded"}
    by_name = {m.name: m for m in CheckpointStore(root).list("p", "j")}
    assert [f.path for f in by_name["checkpoint-1"].files] == ["model.safetensors"]
    top = by_name["top-level"]
    assert [f.path for f in top.files] == ["config.json", "model.safetensors"]
    assert (top.checkpoint_type, top.top_level) == ("full", True)
    assert any("checkpoint top-level uploaded (marked complete)" in e for e in result.events)


def test_an_earlier_jobs_file_at_the_top_is_not_uploaded_until_this_job_changes_it(tmp_path):
    root = StorageRoot(tmp_path / "root")
    local = tmp_path / "out"
    local.mkdir()
    nanogpt_save(local, 5000)  # last week's run, same out_dir
    up = uploader(root, local, settle_s=0, earlier=earlier_checkpoints(local))
    scanned(up)
    wait_until(lambda: any("skipping top-level" in e for e in up.poll().events), "the skip")
    assert names(root) == []
    assert up.poll().writes.wrote is None, "an earlier job's file is not this rank writing"
    nanogpt_save(local, 10)  # this job's first evaluation
    result = up.flush(timeout=30, clean=True)
    assert states(result) == {"top-level": "uploaded"}
    assert any("top-level was changed by this job" in e for e in result.events)
    assert stored_step(CheckpointStore(root), tmp_path)[1] == 10
    said = [e for e in result.events if "skipping top-level" in e]
    assert len(said) == 1 and "an earlier job's" in said[0]


def test_save_pretrained_at_the_top_is_a_full_model_and_adapters_a_lora(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    root = StorageRoot(tmp_path / "root")
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_head=2, n_layer=1, vocab_size=64))
    full = tmp_path / "full"
    up = uploader(root, full, settle_s=0.3)
    model.save_pretrained(os.fspath(full))
    assert states(up.flush(timeout=30, clean=True)) == {"top-level": "uploaded"}
    (manifest,) = CheckpointStore(root).list("p", "j")
    assert manifest.checkpoint_type == "full"
    assert {"config.json", "model.safetensors"} <= {f.path for f in manifest.files}

    lora = tmp_path / "lora"
    up = uploader(root, lora, rank=1, settle_s=0.3)
    (lora / "adapter_config.json").write_text(json.dumps({"r": 8}))
    (lora / "adapter_model.safetensors").write_bytes(b"adapters")
    assert states(up.flush(timeout=30, clean=True)) == {"top-level": "uploaded"}
    adapters = CheckpointStore(root).manifest("p", "j", 1, "top-level")
    assert (adapters.checkpoint_type, adapters.lora_rank) == ("lora", 8)


def test_a_directory_named_top_level_keeps_its_name_and_the_files_get_another(root, tmp_path):
    local = tmp_path / "out"
    (local / "top-level").mkdir(parents=True)
    (local / "top-level" / "w.bin").write_bytes(b"a directory of the user's")
    up = uploader(root, local, settle_s=0.2)
    nanogpt_save(local, 1)
    result = up.flush(timeout=30, clean=True)
    assert states(result) == {"top-level": "uploaded", "top-level-files": "uploaded"}
    by_name = {m.name: m for m in CheckpointStore(root).list("p", "j")}
    assert [f.path for f in by_name["top-level"].files] == ["w.bin"]
    assert [f.path for f in by_name["top-level-files"].files] == ["ckpt.pt"]
    said = [e for e in result.events if "are checkpoint top-level-files" in e]
    assert len(said) == 1, result.events


def test_a_directory_made_later_with_the_files_name_is_ignored(root, tmp_path):
    local = tmp_path / "out"
    up = uploader(root, local, settle_s=0.2)
    nanogpt_save(local, 1)
    wait_until(lambda: names(root) == ["top-level"], "ckpt.pt stored")
    (local / "top-level").mkdir()
    (local / "top-level" / "w.bin").write_bytes(b"would clobber the files' versions")
    result = up.flush(timeout=30, clean=True)
    assert states(result) == {"top-level": "uploaded", "top-level/": "ignored"}
    assert reasons(result)["top-level/"].startswith("a directory with the name the files at")
    assert any("ignoring top-level/: a directory with the name" in e for e in result.events)
    assert [f.path for f in CheckpointStore(root).list("p", "j")[0].files] == ["ckpt.pt"]


def test_delete_local_removes_only_the_uploaded_files(tmp_path):
    root = StorageRoot(tmp_path / "root")
    local = tmp_path / "out"
    up = uploader(root, local, settle_s=0, delete_local=True)
    (local / "checkpoint-1").mkdir()
    nanogpt_save(local, 1)
    wait_until(lambda: not (local / "ckpt.pt").exists(), "ckpt.pt deleted once stored")
    assert (local / "checkpoint-1").is_dir() and names(root) == ["top-level"]
    up.flush(timeout=10, clean=True)


def test_a_cut_off_rewrite_never_replaces_the_whole_stored_version(tmp_path, monkeypatch):
    """The rank is killed while it overwrites ckpt.pt: version 1 stays the stored, complete one;
    before the retry the cut-off file is set aside and version 1 restored at the same path."""
    monkeypatch.setenv(NODE_ROOT_ENV, str(tmp_path / "node"))
    root = StorageRoot(tmp_path / "root")
    store = CheckpointStore(root)
    local = tmp_path / "out"
    up = uploader(root, local, settle_s=3600)
    nanogpt_save(local, 100)
    mark_checkpoint_complete(local)
    wait_until(lambda: names(root) == ["top-level"], "step 100 stored")
    (local / "ckpt.pt").write_bytes(b"half a torch fi")  # killed mid-save
    scanned(up)
    ended = up.end_attempt(30, clean=False, how="rank 0's command exited with code 137")
    (entry,) = ended.entries
    assert (entry.name, entry.state) == ("top-level", "incomplete")
    assert "version 1 stays stored" in entry.reason, entry.reason
    v1 = store.manifest("p", "j", 0, "top-level")
    assert (v1.version, v1.complete) == (1, True)

    up.begin_attempt(1, v1, [])
    assert torch.load(local / "ckpt.pt")["iter_num"] == 100, "restored at the same path"
    aside = tmp_path / "node" / "jobs" / "j" / "rank-0" / "set-aside" / "attempt-1" / "top-level"
    assert (aside / "ckpt.pt").read_bytes() == b"half a torch fi"
    scanned(up)
    assert store.manifest("p", "j", 0, "top-level").version == 1, "not uploaded again"


def test_a_replacement_node_gets_the_files_back_at_their_paths(tmp_path, monkeypatch):
    """Rank 0's node was lost: its new uploader restores ckpt.pt into $BT_CHECKPOINT_DIR itself,
    where `--init_from=resume` reads it, and does not store it again. The controller, polling
    with the lost uploader's cursor, reads the new one's events from their start (the restore
    was lost from the job's log once the new list had grown past the old cursor)."""
    monkeypatch.setenv(NODE_ROOT_ENV, str(tmp_path / "node"))
    root = StorageRoot(tmp_path / "root")
    store = CheckpointStore(root)
    first = uploader(root, tmp_path / "lost", settle_s=0)
    nanogpt_save(tmp_path / "lost", 42)
    wait_until(lambda: names(root) == ["top-level"], "ckpt.pt stored")
    wait_until(lambda: first.poll().next.index >= 1, "the upload said")
    cursor = first.poll().next
    first._stop.set()  # gone with its node
    manifest = store.manifest("p", "j", 0, "top-level")
    up = uploader(root, tmp_path / "new", settle_s=0)
    up.begin_attempt(1, manifest, [])
    assert torch.load(tmp_path / "new" / "ckpt.pt")["iter_num"] == 42
    said = up.poll(cursor).events
    assert any("restored rank-0/top-level from the storage root" in e for e in said), said
    scanned(up)
    result = up.flush(timeout=10, clean=True)
    assert states(result) == {"top-level": "uploaded"}
    assert store.manifest("p", "j", 0, "top-level").version == 1
    assert any("restored rank-0/top-level from the storage root" in e for e in result.events)


def test_a_file_held_open_for_writing_is_not_settled(tmp_path):
    root = StorageRoot(tmp_path / "root")
    local = tmp_path / "out"
    up = uploader(root, local, settle_s=0)
    with open(local / "ckpt.pt", "wb") as f:
        buffer = io.BytesIO()
        torch.save({"iter_num": 1}, buffer)
        f.write(buffer.getvalue()[:10])
        f.flush()
        scanned(up, 5)
        assert names(root) == [], "a file still open for writing is not whole"
        f.write(buffer.getvalue()[10:])
    wait_until(lambda: names(root) == ["top-level"], "stored once closed")
    up.flush(timeout=10, clean=True)


@pytest.mark.parametrize("hidden", [".metadata"])
def test_hidden_files_at_the_top_are_part_of_it(tmp_path, hidden):
    """torch.distributed.checkpoint saved straight into the directory: its `.metadata`, written
    after the shards, is what makes it whole; rank 0 waits for it."""
    root = StorageRoot(tmp_path / "root")
    local = tmp_path / "out"
    up = uploader(root, local, settle_s=0.2, format_wait_s=3600)
    (local / "__0_0.distcp").write_bytes(b"shard")
    scanned(up, 8)
    assert names(root) == []
    (local / hidden).write_bytes(b"plan")
    wait_until(lambda: names(root) == ["top-level"], "stored with its .metadata")
    (manifest,) = CheckpointStore(root).list("p", "j")
    assert [f.path for f in manifest.files] == [hidden, "__0_0.distcp"]
    up.flush(timeout=10, clean=True)


def test_a_replacement_node_gets_a_directory_and_the_pointer_at_the_top_that_names_it(
    tmp_path, monkeypatch
):
    """DeepSpeed's layout: `global_step<N>/` and `latest` (the tag `load_checkpoint` reads) at
    the top. Rank 0's node was lost: its new uploader restores both, so the resumed trainer
    finds `latest` and the directory it names."""
    monkeypatch.setenv(NODE_ROOT_ENV, str(tmp_path / "node"))
    root = StorageRoot(tmp_path / "root")
    store = CheckpointStore(root)
    lost = tmp_path / "lost"
    first = uploader(root, lost, settle_s=0)
    (lost / "global_step20").mkdir()
    (lost / "global_step20" / "mp_rank_00_model_states.pt").write_bytes(b"step 20")
    mark_checkpoint_complete(lost / "global_step20")
    (lost / "latest").write_text("global_step20")
    wait_until(lambda: names(root) == ["global_step20", "top-level"], "both stored")
    first._stop.set()  # gone with its node
    step, pointer = (store.manifest("p", "j", 0, n) for n in ("global_step20", "top-level"))
    up = uploader(root, tmp_path / "new", settle_s=0)
    up.begin_attempt(1, step, [], pointer)
    new = tmp_path / "new"
    assert (new / "latest").read_text() == "global_step20"
    assert (new / "global_step20" / "mp_rank_00_model_states.pt").read_bytes() == b"step 20"
    scanned(up)
    result = up.flush(timeout=10, clean=True)
    assert states(result) == {"global_step20": "uploaded", "top-level": "uploaded"}
    assert store.manifest("p", "j", 0, "top-level").version == 1, "not stored again"

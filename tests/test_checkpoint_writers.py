"""Every way real trainers write checkpoints, through real jobs, on a local root and on S3.

Each test's job writes exactly one way; `check_stored` downloads what was stored with
`orchestrator checkpoints download`, compares every file's sha256 with what was written, and
checks that a reader polling the storage root never saw a version the writer had not finished.
The settle time is the default 0.5 s unless a test says otherwise; pauses are longer.
"""

from __future__ import annotations

import pytest
from checkpoint_jobs import (
    check_stored,
    run_writer,
    s3_root,
    stored_bytes_contain,
    uploaded_while_running,
    writer_job,
)

from orchestrator.client.api import push
from orchestrator.storage.root import StorageRoot

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.fixture(params=["local", "s3"])
def root_url(request, storage_root: str) -> str:
    return storage_root if request.param == "local" else s3_root()


def entry_states(job) -> dict[str, str]:
    return {e.name: e.state for e in job.details().checkpoints.entries}


HUGGING_FACE_LIKE = """
import json, os, time
from ckptlib import ROOT, slow_write, wrote

time.sleep(1)
for step in (10, 20):
    d = ROOT / f"checkpoint-{step}"
    d.mkdir()                                    # made first, filled later
    time.sleep(0.8)
    (d / "config.json").write_text(json.dumps({"step": step}))
    slow_write(d / "model.safetensors", [os.urandom(200_000) for _ in range(3)], 0.7)
    (d / "training_args.bin").write_bytes(os.urandom(300))
    time.sleep(0.8)                              # gathering the optimizer state
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        (d / name).write_bytes(os.urandom(5_000))
        time.sleep(0.2)
    time.sleep(0.8)
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    wrote(d.name)
"""


def test_hugging_face_trainer_style_checkpoints(tmp_path, root_url):
    job, observer = run_writer(tmp_path, root_url, "hf-like", HUGGING_FACE_LIKE)
    check_stored(job, observer, ["checkpoint-10", "checkpoint-20"], tmp_path)
    assert job.details().checkpoints.sync_status == "synced"


REAL_TRAINER = """
import os, torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from ckptlib import ROOT, wrote

class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        x = torch.randint(0, 256, (32,))
        return {"input_ids": x, "labels": x}

model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, n_positions=64))
args = TrainingArguments(output_dir=str(ROOT), max_steps=6, save_steps=2, save_total_limit=2,
                         per_device_train_batch_size=4, report_to=[], use_cpu=True)
Trainer(model=model, args=args, train_dataset=Tokens()).train()
for name in sorted(os.listdir(ROOT)):
    wrote(name)
"""


def test_the_real_hugging_face_trainer_with_rotation(tmp_path, storage_root):
    """transformers' own Trainer, saving every 2 steps and keeping the last 2 locally."""
    job, observer = run_writer(tmp_path, storage_root, "hf-trainer", REAL_TRAINER)
    check_stored(job, observer, ["checkpoint-4", "checkpoint-6"], tmp_path)
    # checkpoint-2 was rotated away: stored whole before that, or reported deleted; never partial
    states = entry_states(job)
    assert states["checkpoint-4"] == states["checkpoint-6"] == "uploaded"
    assert states["checkpoint-2"] in ("uploaded", "deleted"), states
    if states["checkpoint-2"] == "uploaded":
        stored = {m.name for m in job.checkpoints()}
        assert stored == {"checkpoint-2", "checkpoint-4", "checkpoint-6"}


TORCH_DCP = """
import os, time, torch
import torch.distributed.checkpoint as dcp
from ckptlib import ROOT, wrote

# As a multi-rank save looks on the coordinator's node: shards first, .metadata after every
# rank has reported (the gather can take longer than the settle time).
d = ROOT / "step-100"
d.mkdir()
for i in range(12):
    (d / f"__{i}_0.distcp").write_bytes(os.urandom(20_000))
    time.sleep(0.05)
time.sleep(1.2)
(d / ".metadata").write_bytes(os.urandom(800))
wrote("step-100")

# And torch's own writer, with several threads.
state = {"w": torch.randn(256, 256), "b": torch.randn(256)}
writer = dcp.FileSystemWriter(str(ROOT / "step-200"), thread_count=4)
dcp.save(state, storage_writer=writer)
wrote("step-200")
time.sleep(1)
"""


def test_torch_distributed_checkpoint(tmp_path, root_url):
    job, observer = run_writer(tmp_path, root_url, "dcp", TORCH_DCP)
    check_stored(job, observer, ["step-100", "step-200"], tmp_path)


RENAMED_INTO_PLACE = """
import os
from ckptlib import ROOT, held_until_told, wrote

tmp = ROOT / ".checkpoint-1.partial"
tmp.mkdir()
for i in range(3):
    (tmp / f"part-{i}.bin").write_bytes(os.urandom(50_000))
tmp.rename(ROOT / "checkpoint-1")
wrote("checkpoint-1")
print("renamed", flush=True)
held_until_told()
"""


def test_a_rename_into_place_is_the_commit(tmp_path, root_url, monkeypatch):
    """With a settle time far longer than the job, only the rename can start the upload."""
    monkeypatch.setenv("ORCHESTRATOR_CHECKPOINT_SETTLE_S", "60")
    job = push(writer_job(tmp_path / "job", "renamed", RENAMED_INTO_PLACE), storage_root=root_url)
    observer = uploaded_while_running(job, root_url, "checkpoint-1", tmp_path / "job")
    check_stored(job, observer, ["checkpoint-1"], tmp_path)
    assert any("checkpoint-1 uploaded (renamed into place)" in line for line in job.logs())


CHUNKED = """
import json, os
from ckptlib import ROOT, slow_write, wrote

d = ROOT / "checkpoint-1"
d.mkdir()
(d / "meta.json").write_text(json.dumps({"epoch": 1}))
slow_write(d / "weights.bin", [os.urandom(100_000) for _ in range(4)], 0.9)
wrote("checkpoint-1")
"""


def test_a_file_that_grows_in_chunks_with_long_pauses(tmp_path, root_url):
    job, observer = run_writer(tmp_path, root_url, "chunked", CHUNKED)
    check_stored(job, observer, ["checkpoint-1"], tmp_path)


REWRITTEN = """
import os, time
from ckptlib import ROOT, slow_write, wrote

tmp = ROOT / ".c"
tmp.mkdir()
for name in ("a.bin", "b.bin"):
    (tmp / name).write_bytes(os.urandom(80_000))
tmp.rename(ROOT / "checkpoint-1")
wrote("checkpoint-1")
time.sleep(2)                                    # uploaded by now
d = ROOT / "checkpoint-1"
for name in ("a.bin", "b.bin"):                  # then rewritten in place, file by file
    slow_write(d / name, [os.urandom(60_000) for _ in range(3)], 0.7)
    time.sleep(0.2)
wrote("checkpoint-1")
time.sleep(1.5)
"""


def test_a_checkpoint_rewritten_in_place_replaces_the_stored_one(tmp_path, root_url):
    job, observer = run_writer(tmp_path, root_url, "rewritten", REWRITTEN)
    check_stored(job, observer, ["checkpoint-1"], tmp_path)
    assert len(observer.seen["checkpoint-1"]) == 2, "the first version, then the second"
    (manifest,) = job.checkpoints()
    assert manifest.version == 2
    # The replaced version's files are gone from the storage root.
    root = StorageRoot(root_url)
    base = f"checkpoints/{job.project_id}/{job.id}/rank-0/checkpoint-1"
    assert root.list_names(base) == ["v2"]


NESTED_AND_MANY = """
import os
from ckptlib import ROOT, wrote

tmp = ROOT / ".big"
for i in range(1200):
    path = tmp / f"shard-{i // 100:02d}" / f"deep-{i % 3}" / f"f{i}.bin"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(64 + i % 50))
tmp.rename(ROOT / "checkpoint-many")
wrote("checkpoint-many")
"""


def test_nested_directories_and_over_a_thousand_small_files(tmp_path, root_url):
    job, observer = run_writer(tmp_path, root_url, "many-files", NESTED_AND_MANY)
    check_stored(job, observer, ["checkpoint-many"], tmp_path)
    (manifest,) = job.checkpoints()
    assert len(manifest.files) == 1200


SYMLINKS = """
import os, pathlib
from ckptlib import ROOT, wrote

private = pathlib.Path(os.environ["BT_SCRATCH_DIR"]) / "private"
private.mkdir()
(private / "id_rsa").write_text("KEY " + "a9e3f7-ETAVIRP"[::-1])    # not in the archive as such
tmp = ROOT / ".c1"
tmp.mkdir()
(tmp / "model.bin").write_bytes(os.urandom(10_000))
os.symlink("model.bin", tmp / "model-alias.bin")          # inside: uploaded as that file
os.symlink(private / "id_rsa", tmp / "key.pem")           # outside: never followed
os.symlink(private, tmp / "private-dir")
tmp.rename(ROOT / "checkpoint-1")
wrote("checkpoint-1", skip=("key.pem",))
"""


def test_links_inside_a_checkpoint(tmp_path, root_url):
    job, observer = run_writer(tmp_path, root_url, "links", SYMLINKS)
    check_stored(job, observer, ["checkpoint-1"], tmp_path)
    logs = "\n".join(job.logs())
    assert "skipped link key.pem: it points outside the checkpoint" in logs
    assert "skipped link private-dir: it points outside the checkpoint" in logs
    assert not stored_bytes_contain(root_url, b"PRIVATE-7f3e9a")


MARKED = """
import os
from orchestrator import mark_checkpoint_complete
from ckptlib import ROOT, held_until_told, wrote

d = ROOT / "checkpoint-1"
d.mkdir()
(d / "weights.bin").write_bytes(os.urandom(30_000))
mark_checkpoint_complete(d)
wrote("checkpoint-1")
held_until_told()
"""


def test_the_completion_marker_starts_the_upload_at_once(tmp_path, root_url, monkeypatch):
    monkeypatch.setenv("ORCHESTRATOR_CHECKPOINT_SETTLE_S", "60")
    job = push(writer_job(tmp_path / "job", "marked", MARKED), storage_root=root_url)
    observer = uploaded_while_running(job, root_url, "checkpoint-1", tmp_path / "job")
    check_stored(job, observer, ["checkpoint-1"], tmp_path)
    assert any("checkpoint-1 uploaded (marked complete)" in line for line in job.logs())


REUSED_PATH = """
import os, time
from ckptlib import ROOT, wrote

time.sleep(1)
d = ROOT / "checkpoint-51"
d.mkdir()                                        # this job's, however long it stays empty
time.sleep(2)
(d / "weights.bin").write_bytes(os.urandom(20_000))
wrote("checkpoint-51")
"""


def test_a_reused_checkpoint_path(tmp_path, root_url):
    """An earlier job's checkpoints are skipped (said once); a new directory is this job's."""
    reused = tmp_path / "shared-checkpoints"
    (reused / "checkpoint-50").mkdir(parents=True)
    (reused / "checkpoint-50" / "weights.bin").write_bytes(b"an earlier job's")
    job, observer = run_writer(
        tmp_path, root_url, "reused", REUSED_PATH, checkpoint_path=str(reused)
    )
    check_stored(job, observer, ["checkpoint-51"], tmp_path)
    assert [m.name for m in job.checkpoints()] == ["checkpoint-51"]
    said = [line for line in job.logs() if "skipping checkpoint-50" in line]
    assert len(said) == 1 and "an earlier job's" in said[0]
    assert entry_states(job) == {"checkpoint-50": "earlier_job", "checkpoint-51": "uploaded"}

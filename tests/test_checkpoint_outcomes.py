"""What a job says about its checkpoints when it ends, and what later jobs load from them.

Real jobs on the session's local Ray, on a local root and on the moto S3 server: a writer killed
mid-checkpoint, checkpoints copied in with old file times, links and temporary names at the top
of $BT_CHECKPOINT_DIR, and a storage root that refuses checkpoints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoint_jobs import check_stored, run_writer, s3_root, stored_bytes_contain, writer_job
from typer.testing import CliRunner

from orchestrator.cli.app import app
from orchestrator.client.api import list_jobs, push
from orchestrator.lifecycle import CHECKPOINTS_NOT_STORED_EXIT, JobState

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.fixture(params=["local", "s3"])
def root_url(request, storage_root: str) -> str:
    return storage_root if request.param == "local" else s3_root()


KILLED_MID_CHECKPOINT = """
import os, signal, time
from ckptlib import ROOT, wrote

tmp = ROOT / ".c1"
tmp.mkdir()
(tmp / "model.bin").write_bytes(os.urandom(20_000))
(tmp / "optimizer.bin").write_bytes(os.urandom(20_000))
tmp.rename(ROOT / "checkpoint-1")
wrote("checkpoint-1")
time.sleep(2)
d = ROOT / "checkpoint-2"
d.mkdir()
(d / "model.bin").write_bytes(os.urandom(20_000))   # 1 of 2 files, then the process dies
os.kill(os.getpid(), signal.SIGKILL)
"""

READER = """
import os, pathlib
root = pathlib.Path(os.environ["BT_LOAD_CHECKPOINT_DIR"])
for path in sorted(root.rglob("*.bin")):
    print(f"loaded {path.relative_to(root)}", flush=True)
"""


def test_a_checkpoint_cut_off_by_a_crash_is_never_the_latest(tmp_path, root_url):
    job = push(writer_job(tmp_path / "a", "crashes", KILLED_MID_CHECKPOINT), storage_root=root_url)
    assert job.wait(timeout=120) == JobState.FAILED
    by_name = {m.name: m for m in job.checkpoints()}
    assert by_name["checkpoint-1"].complete
    cut = by_name["checkpoint-2"]
    assert not cut.complete and [f.path for f in cut.files] == ["model.bin"]
    assert "exited with code 137" in cut.incomplete_reason
    summary = job.details().checkpoints
    assert summary.incomplete == {"rank-0/checkpoint-2": cut.incomplete_reason}
    assert summary.all_uploaded and summary.sync_status == "incomplete"
    assert any("checkpoint rank-0/checkpoint-2: incomplete:" in line for line in job.logs())

    listed = CliRunner().invoke(
        app, ["checkpoints", "list", "--job-id", job.id, "--storage-root", root_url]
    )
    row = next(line for line in listed.output.splitlines() if "checkpoint-2" in line)
    assert "INCOMPLETE" in row

    latest = "d.LoadCheckpointConfig(enabled=True)"  # the project's latest checkpoint
    loads = push(writer_job(tmp_path / "b", "crashes", READER, load=latest), storage_root=root_url)
    assert loads.wait(timeout=120) == JobState.COMPLETED, loads.logs()
    loaded = [line.split("] ", 1)[1] for line in loads.logs() if "] loaded " in line]
    assert loaded == [
        "loaded rank-0/checkpoint-1/model.bin",
        "loaded rank-0/checkpoint-1/optimizer.bin",
    ]

    named = (
        "d.LoadCheckpointConfig(enabled=True, checkpoints=["
        f"d.BasetenCheckpoint.from_named_checkpoint('checkpoint-2', job_id='{job.id}')])"
    )
    refused = push(writer_job(tmp_path / "c", "crashes", READER, load=named), storage_root=root_url)
    assert refused.wait(timeout=120) == JobState.DEPLOY_FAILED
    cause = refused.details().failure.cause
    assert f"checkpoint 'checkpoint-2' of job {job.id} is incomplete" in cause


COPIED_IN = """
import os, shutil, time
from ckptlib import ROOT, wrote

base = ROOT.parent / "base-model"            # as a loaded or exported model sits on the node
base.mkdir()
(base / "model.safetensors").write_bytes(os.urandom(30_000))
(base / "config.json").write_text("{}")
old = time.time() - 30 * 86400
for path in (*base.iterdir(), base):
    os.utime(path, (old, old))
time.sleep(1)
shutil.copytree(base, ROOT / "checkpoint-0")  # copy2: file times a month old
wrote("checkpoint-0")
"""


def test_a_checkpoint_copied_in_with_old_file_times_is_this_jobs(tmp_path, root_url):
    job, observer = run_writer(tmp_path, root_url, "copied", COPIED_IN)
    check_stored(job, observer, ["checkpoint-0"], tmp_path)


TOP_LEVEL_LINK = """
import os, pathlib
from ckptlib import ROOT, wrote

keys = pathlib.Path(os.environ["BT_SCRATCH_DIR"]) / "ssh"
keys.mkdir()
(keys / "id_ed25519").write_text("KEY " + "b1d4-ETAVIRP"[::-1])
os.symlink(keys, ROOT / "latest")            # outside $BT_CHECKPOINT_DIR
tmp = ROOT / ".c"
tmp.mkdir()
(tmp / "w.bin").write_bytes(os.urandom(1000))
tmp.rename(ROOT / "checkpoint-1")
wrote("checkpoint-1")
"""


def test_a_link_at_the_top_of_the_checkpoint_directory_is_not_followed(tmp_path, root_url):
    job, observer = run_writer(tmp_path, root_url, "top-link", TOP_LEVEL_LINK)
    check_stored(job, observer, ["checkpoint-1"], tmp_path)
    said = [line for line in job.logs() if "ignoring latest" in line]
    assert len(said) == 1 and "symbolic link" in said[0]
    assert not stored_bytes_contain(root_url, b"PRIVATE-4d1b")


TEMPORARY_NAMES = """
import os, time
from ckptlib import ROOT, slow_write, wrote

for tmp, final in (("tmp-checkpoint-5", "checkpoint-5"),            # transformers 4.36-4.37
                   ("state.orbax-checkpoint-tmp-1732", "state")):   # Orbax
    d = ROOT / tmp
    d.mkdir()
    for i in range(2):
        (d / f"part-{i}.bin").write_bytes(os.urandom(10_000))
        time.sleep(0.8)                      # quiet for longer than the settle time
    os.rename(d, ROOT / final)
    wrote(final)
"""


def test_writers_temporary_directories_are_not_checkpoints(tmp_path, root_url):
    job, observer = run_writer(tmp_path, root_url, "tmp-names", TEMPORARY_NAMES)
    check_stored(job, observer, ["checkpoint-5", "state"], tmp_path)
    assert sorted(observer.seen) == ["checkpoint-5", "state"], "no temporary name was listed"


SAVES_ONE = """
import os
from ckptlib import ROOT, wrote

tmp = ROOT / ".c"
tmp.mkdir()
(tmp / "w.bin").write_bytes(os.urandom(1000))
tmp.rename(ROOT / "checkpoint-1")
wrote("checkpoint-1")
"""


def test_checkpoints_the_storage_root_refused_qualify_the_success(tmp_path, storage_root):
    """Commands that exit 0 with a checkpoint not stored: COMPLETED, but saying so everywhere."""
    Path(storage_root).mkdir(parents=True)
    (Path(storage_root) / "checkpoints").write_text("a file where checkpoints/ must go")
    config = writer_job(tmp_path / "job", "refused", SAVES_ONE)
    pushed = subprocess.run(
        [sys.executable, "-m", "orchestrator", "push", str(config), "--tail",
         "--storage-root", storage_root],
        capture_output=True, text=True, timeout=180, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert pushed.returncode == CHECKPOINTS_NOT_STORED_EXIT, pushed.stdout + pushed.stderr
    assert "completed, but its checkpoints were not all stored" in pushed.stdout
    assert "checkpoint rank-0/checkpoint-1: failed:" in pushed.stdout

    view = CliRunner().invoke(app, ["view", "--project", "refused", "--storage-root", storage_root])
    assert "0 of 1 stored" in view.output
    assert "its latest job" in view.output and "did not store all its checkpoints" in view.output
    (job,) = list_jobs("refused", storage_root=storage_root)
    detail = CliRunner().invoke(
        app, ["view", "--job-id", job.id, "--storage-root", storage_root, "-o", "json"]
    )
    d = json.loads(detail.output)
    assert d["status"] == "COMPLETED" and d["checkpoint_sync_status"] == "not_synced"
    assert "checkpoints were not all stored" in d["history"][-1]["reason"]
    assert d["checkpoint_problems"][0].startswith("rank-0/checkpoint-1: failed: ")

"""Jobs that write checkpoints the ways real trainers do, and what a reader sees of them.

A writer script reports each version of a checkpoint it completes (`WROTE {name, files}`: every
file's sha256). The `Observer` lists the job's committed checkpoints while it runs, as a user
polling `orchestrator checkpoints list` would. `check_stored` then downloads each checkpoint
with the CLI and compares every file with the writer's last version, and checks that every
version a reader could have seen was one the writer completed: nothing half-done, ever.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path

from conftest import make_job
from typer.testing import CliRunner

from orchestrator.cli.app import app
from orchestrator.client.api import push
from orchestrator.client.jobs import JobHandle
from orchestrator.lifecycle import JobState
from orchestrator.storage.checkpoints import CheckpointStore
from orchestrator.storage.root import StorageRoot

CONFIG = """
from orchestrator import definitions as d
project = d.TrainingProject(
    name="{project}",
    job=d.TrainingJob(
        image=d.Image(base_image="python:3.11"),
        compute=d.Compute(memory="512Mi"),
        runtime=d.Runtime(
            start_commands=["python job.py"],
            checkpointing_config=d.CheckpointingConfig(enabled=True, checkpoint_path={path}),
            load_checkpoint_config={load},
        ),
    ),
)
"""

# Beside every writer script in the job's directory.
LIB = """
import hashlib, json, os, pathlib, time

ROOT = pathlib.Path(os.environ["BT_CHECKPOINT_DIR"])
GO = pathlib.Path(__GO__)  # the test makes it once it has seen what it waited for


def held_until_told(timeout=90):
    '''Keep the job running until the test has seen what it waited for (GO made by
    `uploaded_while_running`), or for `timeout` seconds.'''
    deadline = time.monotonic() + timeout
    while not GO.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def sha(path):
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def wrote(name, skip=()):
    '''Say this version of checkpoint `name` is complete: each file's sha256 as it is now.'''
    d = ROOT / name
    files = {
        p.relative_to(d).as_posix(): sha(p)
        for p in sorted(d.rglob("*"))
        if p.is_file() and p.name != ".orchestrator-complete" and p.name not in skip
    }
    print("WROTE " + json.dumps({"name": name, "files": files}), flush=True)


def slow_write(path, chunks, pause):
    '''One file written in chunks, held open between them (torch.save of a large state).'''
    with open(path, "wb") as f:
        for i, chunk in enumerate(chunks):
            if i:
                time.sleep(pause)
            f.write(chunk)
            f.flush()
"""


def s3_root() -> str:
    """A fresh bucket on the test's moto server."""
    import s3fs

    bucket = f"writers-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem().mkdir(bucket)
    return f"s3://{bucket}/orchestrator"


def writer_job(
    directory: Path,
    project: str,
    script: str,
    checkpoint_path: str | None = None,
    load: str = "None",
) -> Path:
    config = CONFIG.format(
        project=project, path=repr(checkpoint_path) if checkpoint_path else None, load=load
    )
    lib = LIB.replace("__GO__", repr(str(go_file(directory))))
    return make_job(directory, config, {"job.py": script, "ckptlib.py": lib})


def go_file(job_directory: Path) -> Path:
    """What a writer's `held_until_told()` waits for, beside its job's directory."""
    return job_directory.with_name(f"{job_directory.name}.go")


class Observer:
    """Every committed version of each checkpoint a reader could see while the job ran."""

    def __init__(self, storage_root: str, project: str, job_id: str) -> None:
        self.store = CheckpointStore(StorageRoot(storage_root))
        self.project, self.job_id = project, job_id
        self.seen: dict[str, list[dict[str, str]]] = defaultdict(list)
        self.first_seen: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            self._look()
            time.sleep(0.15)

    def _look(self) -> None:
        for m in self.store.list(self.project, self.job_id):
            files = {f.path: f.sha256 for f in m.files}
            if files not in self.seen[m.name]:
                self.seen[m.name].append(files)
            self.first_seen.setdefault(m.name, time.monotonic())

    def stop(self) -> None:
        """Stop watching, after one last look (at what the job's end left)."""
        self._stop.set()
        self._thread.join(timeout=10)
        self._look()


def run_writer(
    tmp_path: Path, root_url: str, project: str, script: str, **kw: object
) -> tuple[JobHandle, Observer]:
    """Push a writer job, watch the storage root while it runs, and check it completed."""
    job = push(writer_job(tmp_path / "job", project, script, **kw), storage_root=root_url)
    observer = Observer(root_url, job.project_id, job.id)
    try:
        state = job.wait(timeout=120)
    finally:
        observer.stop()
    assert state == JobState.COMPLETED, "\n".join(job.logs()[-30:])
    return job, observer


def uploaded_while_running(
    job: JobHandle, root_url: str, name: str, job_directory: Path
) -> Observer:
    """Wait until `name` is listed, check the job was still running then (its writer is
    `held_until_told()`), and let it end."""
    observer = Observer(root_url, job.project_id, job.id)
    deadline = time.monotonic() + 60
    try:
        while name not in observer.first_seen:
            assert time.monotonic() < deadline, job.logs()
            time.sleep(0.1)
        assert job.status() == JobState.RUNNING, f"{name} must be uploaded while the job runs"
    finally:  # a failed test's job does not hold the session's cluster
        go_file(job_directory).touch()
    assert job.wait(timeout=60) == JobState.COMPLETED
    observer.stop()
    return observer


def wrote(job: JobHandle) -> dict[str, list[dict[str, str]]]:
    """Each checkpoint's completed versions, in the order the writer reported them."""
    versions: dict[str, list[dict[str, str]]] = defaultdict(list)
    for line in job.logs():
        if "] WROTE " in line:
            report = json.loads(line.split("] WROTE ", 1)[1])
            versions[report["name"]].append(report["files"])
    return versions


def download(job: JobHandle, name: str, target: Path) -> dict[str, str]:
    """`orchestrator checkpoints download` of one checkpoint; every file's sha256."""
    result = CliRunner().invoke(
        app,
        ["checkpoints", "download", "--job-id", job.id, "--name", name,
         "--target-directory", str(target), "--storage-root", job.record.storage_root],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    where = target / name
    return {
        p.relative_to(where).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(where.rglob("*"))
        if p.is_file()
    }


def stored_bytes_contain(root_url: str, needle: bytes) -> bool:
    """Whether any object under the storage root holds `needle`."""
    root = StorageRoot(root_url)
    return any(needle in root.fs.cat_file(path) for path in root.fs.find(root.path("")))


def check_stored(job: JobHandle, observer: Observer, names: list[str], tmp: Path) -> None:
    """Each of `names` downloads as the writer's last version; no reader saw a partial one."""
    versions = wrote(job)
    assert sorted(versions) == sorted(names), job.logs()
    for name in names:
        assert download(job, name, tmp / "down") == versions[name][-1], name
    for name, seen in observer.seen.items():
        for files in seen:
            assert files in versions.get(name, []), (
                f"a reader saw {name} as {sorted(files)}, a version its writer never completed"
            )

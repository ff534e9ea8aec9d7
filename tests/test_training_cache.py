"""The training cache on one node: persisting between jobs, per team, where the user can write,
summarized and emptied from the CLI. (Seeding between nodes: tests/test_multinode.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import eventually, make_job

from orchestrator.client.api import push
from orchestrator.client.jobs import JobHandle
from orchestrator.lifecycle import JobState

pytestmark = pytest.mark.usefixtures("ray_cluster")

CACHE_JOB = """
from orchestrator import definitions as d
project = d.TrainingProject(
    name="{project}",
    team_name={team!r},
    job=d.TrainingJob(
        image=d.Image(base_image="python:3.11"),
        compute=d.Compute(memory="256Mi"),
        runtime=d.Runtime(
            start_commands=["python cache.py"],
            cache_config=d.CacheConfig(enabled=True, {extra}),
        ),
    ),
)
"""

# Prints the cache variables and what the caches hold, then writes what it was told to.
CACHE_SCRIPT = """
import json, os, pathlib, sys
env = {{k: os.environ.get(k) for k in
       ("BT_RW_CACHE_DIR", "BT_PROJECT_CACHE_DIR", "BT_TEAM_CACHE_DIR", "HF_HOME")}}
print("ENV " + json.dumps(env))
seen = {{}}
for var in ("BT_PROJECT_CACHE_DIR", "BT_TEAM_CACHE_DIR"):
    root = pathlib.Path(os.environ[var])
    seen[var] = {{str(p.relative_to(root)): p.read_text()
                 for p in sorted(root.rglob("*")) if p.is_file()}}
print("SEEN " + json.dumps(seen))
for var, rel, text in json.loads({writes!r}):
    target = pathlib.Path(os.environ[var]) / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
"""


def cache_job(directory: Path, project: str, writes=(), team: str | None = None,
              extra: str = "") -> Path:  # fmt: skip
    body = CACHE_JOB.format(project=project, team=team, extra=extra)
    script = CACHE_SCRIPT.format(writes=json.dumps(list(writes)))
    return make_job(directory, body, {"cache.py": script})


def run(config: Path, storage_root: str, state: JobState = JobState.COMPLETED) -> JobHandle:
    job = push(config, storage_root=storage_root)
    got = job.wait(timeout=120)
    assert got == state, (got, job.details().failure, job.logs()[-15:])
    return job


def printed(job: JobHandle, tag: str) -> dict:
    return json.loads(
        next(line for line in job.logs() if f"] {tag} " in line).split(f"] {tag} ")[1]
    )


def test_the_cache_persists_between_jobs_of_a_project(tmp_path, storage_root):
    project = f"cached-{uuid.uuid4().hex[:6]}"
    writes = [("BT_PROJECT_CACHE_DIR", "wheels/torch.whl", "wheel bytes"),
              ("BT_TEAM_CACHE_DIR", "shared/tokenizer.json", "{}")]  # fmt: skip
    first = run(cache_job(tmp_path / "one", project, writes, extra="enable_legacy_hf_mount=True"),
                storage_root)  # fmt: skip
    env = printed(first, "ENV")
    # The default /root/.cache becomes a directory of the job the user can write; exported.
    base = env["BT_RW_CACHE_DIR"]
    assert base != "/root/.cache" and f"/jobs/{first.id}/" in base
    assert env["BT_PROJECT_CACHE_DIR"] == f"{base}/user_artifacts"
    assert env["BT_TEAM_CACHE_DIR"] == f"{base}/team_artifacts"
    assert env["HF_HOME"] == f"{base}/huggingface"
    assert printed(first, "SEEN") == {"BT_PROJECT_CACHE_DIR": {}, "BT_TEAM_CACHE_DIR": {}}
    assert first.details().cache.written_back == {"files": 2, "bytes": 13, "deleted": 0}
    eventually(lambda: not Path(base).exists(), "the job's cache directory to go with the job")

    second = run(cache_job(tmp_path / "two", project), storage_root)
    assert printed(second, "SEEN") == {
        "BT_PROJECT_CACHE_DIR": {"wheels/torch.whl": "wheel bytes"},
        "BT_TEAM_CACHE_DIR": {"shared/tokenizer.json": "{}"},
    }
    [node] = second.details().cache.nodes
    assert node.had_copy and node.files_seeded == 0, "the node's own copy was current"
    assert second.details().cache.written_back == {"files": 0, "bytes": 0, "deleted": 0}


def test_a_team_never_sees_another_teams_cache(tmp_path, storage_root):
    project = f"shared-name-{uuid.uuid4().hex[:6]}"
    writes = [("BT_PROJECT_CACHE_DIR", "red-project.txt", "red"),
              ("BT_TEAM_CACHE_DIR", "red-team.txt", "red")]  # fmt: skip
    run(cache_job(tmp_path / "red", project, writes, team="red"), storage_root)
    blue = run(cache_job(tmp_path / "blue", project, team="blue"), storage_root)
    assert printed(blue, "SEEN") == {"BT_PROJECT_CACHE_DIR": {}, "BT_TEAM_CACHE_DIR": {}}
    red_again = run(cache_job(tmp_path / "red2", f"other-{project}", team="red"), storage_root)
    assert printed(red_again, "SEEN")["BT_TEAM_CACHE_DIR"] == {"red-team.txt": "red"}
    assert printed(red_again, "SEEN")["BT_PROJECT_CACHE_DIR"] == {}


def test_cache_summarize_and_delete(tmp_path, storage_root):
    project = f"summarized-{uuid.uuid4().hex[:6]}"
    writes = [("BT_PROJECT_CACHE_DIR", "b/big.bin", "x" * 3000),
              ("BT_PROJECT_CACHE_DIR", "a.txt", "small")]  # fmt: skip
    run(cache_job(tmp_path / "one", project, writes), storage_root)

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "orchestrator", "cache", *args, project,
             "--storage-root", storage_root],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    listed = cli("summarize", "-o", "json", "--sort", "size", "--order", "desc")
    assert listed.returncode == 0, listed.stderr
    summary = json.loads(listed.stdout)
    assert [(f["path"], f["size_bytes"]) for f in summary["files"]] == [("b/big.bin", 3000),
                                                                       ("a.txt", 5)]  # fmt: skip
    assert summary["total_bytes"] == 3005
    table = cli("summarize")
    assert "b/big.bin" in table.stdout and "2 file(s), 2.9 KiB" in table.stdout

    deleted = cli("delete", "--yes")
    assert deleted.returncode == 0 and "2 file(s)" in deleted.stdout
    assert "is empty" in cli("summarize").stdout
    after = run(cache_job(tmp_path / "two", project), storage_root)
    assert printed(after, "SEEN")["BT_PROJECT_CACHE_DIR"] == {}, "emptied on the node too"
    assert after.details().cache.nodes[0].files_deleted == 2


def test_an_explicit_mount_base_path_is_honoured_or_refused(tmp_path, storage_root):
    project = f"explicit-{uuid.uuid4().hex[:6]}"
    base = tmp_path / "my-cache"
    job = run(cache_job(tmp_path / "one", project, extra=f"mount_base_path={str(base)!r}"),
              storage_root)  # fmt: skip
    assert printed(job, "ENV")["BT_PROJECT_CACHE_DIR"] == f"{base}/user_artifacts"
    eventually(lambda: not (base / "user_artifacts").exists(), "its links to be removed")
    assert base.is_dir(), "the base the user chose stays"

    (tmp_path / "a-file").write_text("not a directory")
    bad = tmp_path / "a-file" / "cache"
    job = run(cache_job(tmp_path / "two", project, extra=f"mount_base_path={str(bad)!r}"),
              storage_root, JobState.DEPLOY_FAILED)  # fmt: skip
    assert f"cannot create cache_config.mount_base_path {bad}/user_artifacts on this node" in (
        job.details().failure.cause
    )

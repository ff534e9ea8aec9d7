"""Weights delivered before the code starts: mirrored once, cached on the node, linked in place.

Against real servers on loopback: S3 (moto), a Hugging Face Hub stand-in that the real
huggingface_hub client talks to, and an https file server with a test CA.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import fsspec
import pytest
from conftest import HF_TOKEN, HF_TOKEN_SECRET, HF_WRONG_TOKEN_SECRET, eventually, make_job

from orchestrator.agents.weight_cache import NODE_CACHE_DIR_ENV, NODE_CACHE_GIB_ENV
from orchestrator.client.api import push
from orchestrator.client.jobs import JobHandle
from orchestrator.cluster.local import LocalCluster
from orchestrator.lifecycle import JobState
from orchestrator.storage.root import StorageRoot

pytestmark = pytest.mark.usefixtures("ray_cluster")

WEIGHTS_JOB = """
from orchestrator import definitions as d
project = d.TrainingProject(
    name="weights-tests",
    job=d.TrainingJob(
        image=d.Image(base_image="python:3.11"),
        compute=d.Compute(memory="256Mi"),
        weights=[d.WeightsSource(**w) for w in {weights!r}],
        runtime=d.Runtime(start_commands=["python show.py"]),
    ),
)
"""

# Prints every file under each mount with its content, so tests see what the job saw.
SHOW = """
import pathlib
for mount in {mounts!r}:
    root = pathlib.Path(mount)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        print(f"FILE {{path.relative_to(root)}} {{path.read_bytes().decode()!r}}")
"""


def weights_job(directory: Path, weights: list[dict]) -> Path:
    mounts = [w["mount_location"] for w in weights]
    return make_job(
        directory, WEIGHTS_JOB.format(weights=weights), {"show.py": SHOW.format(mounts=mounts)}
    )


def files_seen(job: JobHandle) -> dict[str, str]:
    seen = {}
    for line in job.logs():
        if "] FILE " in line:
            path, _, content = line.split("] FILE ", 1)[1].partition(" ")
            seen[path] = eval(content)
    return seen


def run(config: Path, storage_root: str, state: JobState = JobState.COMPLETED) -> JobHandle:
    job = push(config, storage_root=storage_root)
    got = job.wait(timeout=120)
    assert got == state, (got, job.details().failure, job.logs()[-15:])
    return job


@pytest.fixture
def bucket(s3_server) -> str:
    name = f"weights-{uuid.uuid4().hex[:8]}"
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir(name)
    fs.pipe(
        {
            f"{name}/models/tiny/config.json": b'{"layers": 2}',
            f"{name}/models/tiny/weights/model.safetensors": b"W" * 3000,
            f"{name}/models/tiny/README.md": b"readme",
        }
    )
    return name


def test_a_first_job_mirrors_and_a_second_gets_a_node_hit(tmp_path, storage_root, bucket):
    mount = str(tmp_path / "mnt" / "tiny")
    weights = [{"source": f"s3://{bucket}/models/tiny", "mount_location": mount}]
    first = run(weights_job(tmp_path / "one", weights), storage_root)
    expected = {
        "README.md": "readme",
        "config.json": '{"layers": 2}',
        "weights/model.safetensors": "W" * 3000,
    }
    assert files_seen(first) == expected
    status = first.details().weights[0]
    assert status.mirror == "miss" and status.files_total == 3 and status.bytes_total == 3019
    assert [n.tier for n in status.nodes] == ["mirror"]
    assert any("mirrored revision" in line for line in first.logs())
    eventually(lambda: not Path(mount).exists(), "the mount to be removed when the job ends")

    # The mirror's files are gone: the second job can only be served by the node's cache.
    root = StorageRoot(storage_root)
    [key] = root.list_names("weights")
    root.fs.rm(root.path(f"weights/{key}/files"), recursive=True)
    second = run(weights_job(tmp_path / "two", weights), storage_root)
    assert files_seen(second) == expected
    status = second.details().weights[0]
    assert status.mirror == "hit" and [n.tier for n in status.nodes] == ["node"]
    assert status.nodes[0].seconds < 1.0
    assert any("node cache hit" in line for line in second.logs())


def test_a_changed_source_is_mirrored_again(tmp_path, storage_root, bucket):
    mount = str(tmp_path / "mnt")
    weights = [{"source": f"s3://{bucket}/models/tiny/config.json", "mount_location": mount}]
    run(weights_job(tmp_path / "one", weights), storage_root)
    fsspec.filesystem("s3", skip_instance_cache=True).pipe(
        f"{bucket}/models/tiny/config.json", b'{"layers": 3}'
    )
    second = run(weights_job(tmp_path / "two", weights), storage_root)
    assert files_seen(second) == {"config.json": '{"layers": 3}'}
    assert second.details().weights[0].mirror == "miss"


def test_patterns_select_files(tmp_path, storage_root, bucket):
    weights = [
        {
            "source": f"s3://{bucket}/models/tiny",
            "mount_location": str(tmp_path / "mnt"),
            "allow_patterns": ["*.json", "weights/"],
            "ignore_patterns": ["*.md"],
        }
    ]
    job = run(weights_job(tmp_path / "job", weights), storage_root)
    assert sorted(files_seen(job)) == ["config.json", "weights/model.safetensors"]


def test_hub_repo_is_mirrored_at_its_commit_and_a_node_hit_downloads_nothing(
    tmp_path, storage_root, hub
):
    repo = f"acme/tiny-{uuid.uuid4().hex[:6]}"
    sha = hub.add_repo(repo, {"config.json": b"{}", "model.safetensors": b"M" * 500})
    weights = [{"source": f"hf://{repo}@main", "mount_location": str(tmp_path / "hf")}]
    first = run(weights_job(tmp_path / "one", weights), storage_root)
    assert files_seen(first) == {"config.json": "{}", "model.safetensors": "M" * 500}
    assert first.details().weights[0].revision == sha
    assert hub.downloads(repo) == 2

    second = run(weights_job(tmp_path / "two", weights), storage_root)
    assert second.details().weights[0].mirror == "hit"
    assert second.details().weights[0].nodes[0].tier == "node"
    assert hub.downloads(repo) == 2, "a node hit reads no file from the source"

    new_sha = hub.commit(repo, {"config.json": b'{"v": 2}'})
    third = run(weights_job(tmp_path / "three", weights), storage_root)
    assert third.details().weights[0].revision == new_sha
    assert files_seen(third)["config.json"] == '{"v": 2}'


def test_two_concurrent_jobs_mirror_once(tmp_path, storage_root, hub):
    """The second job asks while the first one's copy is held mid-way: it waits for that copy."""
    repo = f"acme/shared-{uuid.uuid4().hex[:6]}"
    hub.add_repo(repo, {f"shard-{i}.bin": bytes([65 + i]) * 200_000 for i in range(4)})
    weights = [{"source": f"hf://{repo}", "mount_location": str(tmp_path / "shared")}]
    revision_asked = lambda: sum(  # noqa: E731
        1 for method, path in hub.requests if method == "GET" and f"{repo}/revision/" in path
    )
    hub.hold_downloads()
    try:
        first = push(weights_job(tmp_path / "a", weights), storage_root=storage_root)
        eventually(lambda: any(f"/{repo}/resolve/" in p for _, p in hub.requests), "a download")
        second = push(weights_job(tmp_path / "b", weights), storage_root=storage_root)
        eventually(lambda: revision_asked() == 2, "the second job's freshness check")
    finally:
        hub.release_downloads()
    assert [j.wait(timeout=120) for j in (first, second)] == [JobState.COMPLETED] * 2
    assert hub.downloads(repo) == 4, "each file is read from the source once"
    assert [j.details().weights[0].mirror for j in (first, second)] == ["miss", "shared"]
    assert files_seen(second) == files_seen(first) and len(files_seen(second)) == 4


def test_a_private_repo_is_read_with_the_token_from_a_secret(tmp_path, storage_root, hub):
    repo = f"acme/private-{uuid.uuid4().hex[:6]}"
    hub.add_repo(repo, {"secret-model.bin": b"private"}, token=HF_TOKEN)
    mount = str(tmp_path / "private")
    ok = [{"source": f"hf://{repo}", "mount_location": mount, "auth_secret_name": HF_TOKEN_SECRET}]
    job = run(weights_job(tmp_path / "ok", ok), storage_root)
    assert files_seen(job) == {"secret-model.bin": "private"}
    assert all(HF_TOKEN not in line for line in job.logs())

    anonymous = [{"source": f"hf://{repo}", "mount_location": mount}]
    job = run(weights_job(tmp_path / "anon", anonymous), storage_root, JobState.DEPLOY_FAILED)
    assert f"weights[0] hf://{repo}" in job.details().failure.cause
    assert "not found (or not visible with the given token)" in job.details().failure.cause

    wrong = [{**ok[0], "auth": {"auth_method": "CUSTOM_SECRET",
                                "auth_secret_name": HF_WRONG_TOKEN_SECRET}}]  # fmt: skip
    del wrong[0]["auth_secret_name"]
    job = run(weights_job(tmp_path / "wrong", wrong), storage_root, JobState.DEPLOY_FAILED)
    assert f"weights[0] hf://{repo}" in job.details().failure.cause
    assert not job.details().nodes, "no node was prepared for a job whose weights failed"


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ("s3://{bucket}/models/absent", "not found"),
        ("s3://no-such-bucket-{uid}/models", "not found"),
        ("hf://acme/no-such-repo-{uid}", "repository not found"),
        ("hf://{repo}@no-such-branch", "revision 'no-such-branch' not found"),
    ],
)
def test_a_source_that_cannot_be_read_fails_the_deploy_naming_it(
    tmp_path, storage_root, bucket, hub, source, reason
):
    repo = f"acme/r-{uuid.uuid4().hex[:6]}"
    hub.add_repo(repo, {"a.bin": b"a"})
    source = source.format(bucket=bucket, uid=uuid.uuid4().hex[:6], repo=repo)
    weights = [{"source": source, "mount_location": str(tmp_path / "w")}]
    job = run(weights_job(tmp_path / "job", weights), storage_root, JobState.DEPLOY_FAILED)
    cause = job.details().failure.cause
    assert cause.startswith(f"weights[0] {source}: ") and reason in cause
    assert [e.state for e in job.details().history] == [JobState.CREATED, JobState.DEPLOY_FAILED]


def test_patterns_that_select_nothing_and_a_missing_secret_fail_the_deploy(
    tmp_path, storage_root, bucket
):
    nothing = [
        {
            "source": f"s3://{bucket}/models/tiny",
            "mount_location": str(tmp_path / "w"),
            "allow_patterns": ["*.gguf"],
        }
    ]
    job = run(weights_job(tmp_path / "none", nothing), storage_root, JobState.DEPLOY_FAILED)
    assert "select none of its 3 file(s)" in job.details().failure.cause

    no_secret = [{**nothing[0], "allow_patterns": None, "auth_secret_name": "absent_creds"}]
    job = run(weights_job(tmp_path / "nosecret", no_secret), storage_root, JobState.DEPLOY_FAILED)
    assert "secret 'absent_creds' is not set" in job.details().failure.cause


def test_s3_credentials_come_from_a_json_secret(tmp_path, storage_root, bucket):
    """JSON credentials are read and used; a secret that is not JSON is refused, unquoted."""
    source = {"source": f"s3://{bucket}/models/tiny/config.json",
              "mount_location": str(tmp_path / "w")}  # fmt: skip
    ok = [{**source, "auth_secret_name": "s3_json_creds"}]
    job = run(weights_job(tmp_path / "ok", ok), storage_root)
    assert files_seen(job) == {"config.json": '{"layers": 2}'}
    assert all("sk-json-8e1f" not in line for line in job.logs())

    bad = [{**source, "auth_secret_name": "s3_not_json"}]
    job = run(weights_job(tmp_path / "bad", bad), storage_root, JobState.DEPLOY_FAILED)
    assert "the source's secret is not JSON" in job.details().failure.cause
    assert "AKIA-not-json" not in job.details().failure.cause


def test_an_https_file_is_delivered(tmp_path, storage_root, https_files):
    https_files.put("files/vocab.txt", b"hello vocabulary")
    url = f"{https_files.url}/files/vocab.txt"
    weights = [{"source": url, "mount_location": str(tmp_path / "vocab")}]
    job = run(weights_job(tmp_path / "job", weights), storage_root)
    assert files_seen(job) == {"vocab.txt": "hello vocabulary"}
    assert https_files.downloads("/files/vocab.txt") == 1


def test_view_shows_the_weights(tmp_path, storage_root, bucket):
    weights = [{"source": f"s3://{bucket}/models/tiny", "mount_location": str(tmp_path / "v")}]
    job = run(weights_job(tmp_path / "job", weights), storage_root)
    from typer.testing import CliRunner

    from orchestrator.cli.app import app

    result = CliRunner().invoke(
        app, ["view", "--job-id", job.id, "--storage-root", storage_root, "-o", "json"]
    )
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["weights"][0]["source"] == f"s3://{bucket}/models/tiny"
    assert shown["weights"][0]["files_done"] == 3


def test_the_node_cache_evicts_the_least_recently_used_set_under_its_budget(
    tmp_path, storage_root, bucket, monkeypatch
):
    """A cluster whose nodes keep about 4 KB of weights: a second 3 KB set pushes out the first."""
    monkeypatch.setenv(NODE_CACHE_GIB_ENV, str(4096 / 1024**3))
    monkeypatch.setenv(NODE_CACHE_DIR_ENV, str(tmp_path / "small-cache"))
    cluster = LocalCluster(state_dir=tmp_path / "small-cache-cluster")
    info = cluster.start()
    try:

        def deliver(name: str, path: str) -> JobHandle:
            weights = [
                {"source": f"s3://{bucket}/{path}", "mount_location": str(tmp_path / "mnt" / name)}
            ]
            job = push(weights_job(tmp_path / name, weights), address=info.dashboard_url,
                       storage_root=storage_root)  # fmt: skip
            assert job.wait(timeout=120) == JobState.COMPLETED, (job.logs()[-10:], job.details())
            return job

        fsspec.filesystem("s3", skip_instance_cache=True).pipe(
            f"{bucket}/other/model.safetensors", b"O" * 3000
        )
        first = deliver("first", "models/tiny/weights")
        assert first.details().weights[0].nodes[0].tier == "mirror"
        again = deliver("again", "models/tiny/weights")
        assert again.details().weights[0].nodes[0].tier == "node"
        other = deliver("other", "other")
        assert any("evicted 1 older set(s)" in line for line in other.logs())
        back = deliver("back", "models/tiny/weights")
        assert back.details().weights[0].mirror == "hit"
        assert back.details().weights[0].nodes[0].tier == "mirror", "evicted: copied again"
        assert files_seen(back) == {"model.safetensors": "W" * 3000}
    finally:
        cluster.stop()


def test_a_mount_location_holding_files_is_refused_and_left_alone(tmp_path, storage_root, bucket):
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "mine.txt").write_text("the user's own file")
    weights = [{"source": f"s3://{bucket}/models/tiny", "mount_location": str(occupied)}]
    job = run(weights_job(tmp_path / "job", weights), storage_root, JobState.DEPLOY_FAILED)
    assert f"mount_location {occupied} already exists on this node and is not empty" in (
        job.details().failure.cause
    )
    assert (occupied / "mine.txt").read_text() == "the user's own file"


WAITER = """
import pathlib, sys, time
mount, flag = pathlib.Path({mount!r}), pathlib.Path({flag!r})
print("SEES", sorted(p.name for p in mount.iterdir()), flush=True)
deadline = time.monotonic() + 90
while not flag.exists() and time.monotonic() < deadline:
    time.sleep(0.1)
print("STILL SEES", sorted(p.name for p in mount.iterdir()), flush=True)
"""


def test_jobs_sharing_a_mount_location_on_a_node(tmp_path, storage_root, bucket):
    """A running job's mount is never repointed: a job wanting other contents there is refused,
    one wanting the same contents shares it, and the link stays until its last user ends."""
    mount, flag = tmp_path / "shared-mount", tmp_path / "release"
    tiny = {"source": f"s3://{bucket}/models/tiny/config.json", "mount_location": str(mount)}
    first = push(
        make_job(tmp_path / "first", WEIGHTS_JOB.format(weights=[tiny]),
                 {"show.py": WAITER.format(mount=str(mount), flag=str(flag))}),
        storage_root=storage_root,
    )  # fmt: skip
    try:
        eventually(lambda: any("] SEES " in line for line in first.logs()), "the first job")
        other = [{**tiny, "source": f"s3://{bucket}/models/tiny/README.md"}]
        refused = run(weights_job(tmp_path / "other", other), storage_root, JobState.DEPLOY_FAILED)
        assert f"mount_location {mount} is in use on this node by another running job" in (
            refused.details().failure.cause
        )
        same = run(weights_job(tmp_path / "same", [tiny]), storage_root)
        assert files_seen(same) == {"config.json": '{"layers": 2}'}
    finally:
        flag.write_text("go")
    assert first.wait(timeout=120) == JobState.COMPLETED
    assert any(line.endswith("STILL SEES ['config.json']") for line in first.logs())
    eventually(lambda: not mount.exists(), "the last user to remove the mount")

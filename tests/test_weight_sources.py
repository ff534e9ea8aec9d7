"""Reading each kind of weights source and mirroring it into each kind of storage root, no Ray."""

from __future__ import annotations

import importlib.util
import json
import uuid
from pathlib import Path

import fsspec
import pytest

from orchestrator.agents.weight_cache import _from_mirror
from orchestrator.agents.weight_mirror import Progress, copy_set
from orchestrator.node.weight_sources import (
    CW_ENDPOINT_ENV,
    R2_ENDPOINT_ENV,
    SourceError,
    open_source,
)
from orchestrator.spec.weights import WeightsSource
from orchestrator.storage.root import StorageRoot
from orchestrator.storage.weights import MirrorStore, select, set_key


def source(url: str, **extra) -> WeightsSource:
    return WeightsSource(source=url, mount_location="/weights", **extra)


def mirror(spec: WeightsSource, root: StorageRoot, secret: str | None = None):
    src = open_source(spec, secret)
    revision = src.resolve()
    key = set_key(src.identity, revision, spec.allow_patterns, spec.ignore_patterns)
    return copy_set(src, spec, revision, key, MirrorStore(root), Progress())


def read_back(root: StorageRoot, weight_set, dest: Path) -> dict[str, bytes]:
    _from_mirror(root, weight_set)(dest)
    return {p.relative_to(dest).as_posix(): p.read_bytes() for p in dest.rglob("*") if p.is_file()}


def test_patterns_follow_huggingface_hub(tmp_path):
    paths = ["config.json", "model.safetensors", "onnx/model.onnx", "README.md", "a/b/c.json"]
    assert select(paths, None, None) == paths
    assert select(paths, ["*.json"], None) == ["config.json", "a/b/c.json"]
    assert select(paths, ["onnx/"], None) == ["onnx/model.onnx"]
    assert select(paths, None, ["*.md", "onnx/"]) == ["config.json", "model.safetensors",
                                                      "a/b/c.json"]  # fmt: skip


def test_a_hub_repo_mirrors_into_every_kind_of_storage_root(root, tmp_path, hub):
    repo = f"acme/roots-{uuid.uuid4().hex[:6]}"
    files = {"config.json": b"{}", "sub/model.safetensors": b"S" * 1000}
    sha = hub.add_repo(repo, files)
    weight_set = mirror(source(f"hf://{repo}"), root)
    assert weight_set.revision == sha and weight_set.total_bytes == 1002
    assert MirrorStore(root).manifest(weight_set.key) == weight_set
    assert read_back(root, weight_set, tmp_path / "node") == files


def test_a_tag_resolves_to_its_commit_and_datasets_work(hub):
    repo = f"acme/data-{uuid.uuid4().hex[:6]}"
    sha = hub.add_repo(repo, {"train.jsonl": b"{}\n"}, repo_type="dataset", tags=("v1",))
    hub.commit(repo, {"train.jsonl": b"{}\n{}\n"}, repo_type="dataset")
    src = open_source(source(f"hf://datasets/{repo}@v1"), None)
    assert src.resolve() == sha
    assert [(f.path, f.size) for f in src.files()] == [("train.jsonl", 3)]
    assert src.identity == f"hf://datasets/{repo}"


def test_a_gcs_prefix_is_read_and_a_changed_object_changes_the_revision(gcs_server, tmp_path):
    bucket = f"w-{uuid.uuid4().hex[:8]}"
    fs = fsspec.filesystem("gs", token="anon", skip_instance_cache=True)
    fs.mkdir(bucket)
    fs.pipe({f"{bucket}/m/a.bin": b"a", f"{bucket}/m/d/b.bin": b"bb"})
    spec = source(f"gs://{bucket}/m")
    src = open_source(spec, None)
    first = src.resolve()
    assert sorted((f.path, f.size) for f in src.files()) == [("a.bin", 1), ("d/b.bin", 2)]
    root = StorageRoot(tmp_path / "root")
    weight_set = mirror(spec, root)
    assert read_back(root, weight_set, tmp_path / "node") == {"a.bin": b"a", "d/b.bin": b"bb"}
    fs.pipe(f"{bucket}/m/a.bin", b"changed")
    assert open_source(spec, None).resolve() != first


def test_r2_reads_through_the_s3_api_at_the_accounts_endpoint(s3_server, monkeypatch, tmp_path):
    bucket = f"r2-{uuid.uuid4().hex[:8]}"
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir(bucket)
    fs.pipe(f"{bucket}/m/w.bin", b"r2 data")
    spec = source(f"r2://acct123.{bucket}/m")
    monkeypatch.delenv(R2_ENDPOINT_ENV, raising=False)
    assert open_source(spec, None).fs.endpoint_url == "https://acct123.r2.cloudflarestorage.com"
    monkeypatch.setenv(R2_ENDPOINT_ENV, s3_server)  # the loopback server plays R2
    creds = json.dumps({"aws_access_key_id": "k", "aws_secret_access_key": "s"})
    root = StorageRoot(tmp_path / "root")
    weight_set = mirror(spec, root, creds)
    assert read_back(root, weight_set, tmp_path / "node") == {"w.bin": b"r2 data"}


def test_cw_reads_through_the_s3_api_at_coreweaves_endpoint(s3_server, monkeypatch, tmp_path):
    bucket = f"cw-{uuid.uuid4().hex[:8]}"
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir(bucket)
    fs.pipe({f"{bucket}/m/w.bin": b"cw data", f"{bucket}/m/d/t.json": b"{}"})
    spec = source(f"cw://{bucket}/m")
    monkeypatch.delenv(CW_ENDPOINT_ENV, raising=False)
    default = open_source(spec, None).fs
    assert default.endpoint_url == "https://cwobject.com"
    assert default.config_kwargs == {"s3": {"addressing_style": "virtual"}}
    monkeypatch.setenv(CW_ENDPOINT_ENV, s3_server)  # the loopback server plays CoreWeave
    creds = json.dumps({"aws_access_key_id": "k", "aws_secret_access_key": "s"})
    assert open_source(spec, creds).fs.endpoint_url == s3_server
    root = StorageRoot(tmp_path / "root")
    weight_set = mirror(spec, root, creds)
    assert read_back(root, weight_set, tmp_path / "node") == {"w.bin": b"cw data",
                                                              "d/t.json": b"{}"}  # fmt: skip
    with pytest.raises(SourceError, match="lacks aws_secret_access_key"):
        open_source(spec, json.dumps({"aws_access_key_id": "k"}))


def test_s3_secret_must_be_json_with_both_keys(s3_server):
    spec = source("s3://bucket/path")
    with pytest.raises(SourceError, match="secret is not JSON"):
        open_source(spec, "AKIA-plain-text")
    with pytest.raises(SourceError, match="lacks aws_secret_access_key") as e:
        open_source(spec, json.dumps({"aws_access_key_id": "AKIAVISIBLE"}))
    assert "AKIAVISIBLE" not in str(e.value)


def test_an_https_file_and_its_absence(https_files, tmp_path):
    https_files.put("w/tok.json", b'{"vocab": 3}')
    spec = source(f"{https_files.url}/w/tok.json")
    root = StorageRoot(tmp_path / "root")
    weight_set = mirror(spec, root)
    assert read_back(root, weight_set, tmp_path / "node") == {"tok.json": b'{"vocab": 3}'}
    missing = open_source(source(f"{https_files.url}/w/absent.json"), None)
    with pytest.raises(SourceError, match="not found"):
        missing.resolve()
    assert ("HEAD", "/w/absent.json") in https_files.requests  # refused by the server, not TLS


@pytest.mark.skipif(importlib.util.find_spec("adlfs") is not None, reason="adlfs is installed")
def test_azure_without_adlfs_says_what_to_install():
    with pytest.raises(SourceError, match=r"need the adlfs package .* pip install adlfs"):
        open_source(source("azure://acct/container/models/x"), None)

"""The storage stack the tests run is the one users get, and a record being rewritten is never
read cut, on a local directory, a real S3 server (moto) and fake-gcs-server. No Ray."""

from __future__ import annotations

import sys
import threading
import time
from importlib.metadata import version
from pathlib import Path

import fsspec.asyn
import pytest
from packaging.requirements import Requirement
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:
    tomllib = pytest.importorskip("tomli")

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
# The async stack: s3fs over aiobotocore, gcsfs over aiohttp, fsspec's async core.
STACK = ("fsspec", "s3fs", "gcsfs", "aiobotocore")


def floors() -> dict[str, Version]:
    """Each STACK package's `>=` floor in pyproject's dependencies (what `pip install .` gets)."""
    declared = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    found = {}
    for line in declared:
        requirement = Requirement(line)
        for spec in requirement.specifier:
            if requirement.name in STACK and spec.operator == ">=":
                found[requirement.name] = Version(spec.version)
    return found


def test_pyproject_gives_the_storage_stack_floors():
    """Without floors a resolver squeezed by moto's newest boto3 picked s3fs 0.4.2 (boto3-based)
    for `.[dev]` while `.` got a modern one: the tests ran an S3 client no user runs."""
    assert sorted(floors()) == sorted(STACK)
    assert floors()["s3fs"] >= Version("2023.1"), "s3fs's async (aiobotocore) line"


def test_the_installed_storage_stack_is_the_modern_async_one():
    import gcsfs
    import s3fs

    assert issubclass(s3fs.S3FileSystem, fsspec.asyn.AsyncFileSystem), s3fs.__version__
    assert issubclass(gcsfs.GCSFileSystem, fsspec.asyn.AsyncFileSystem), gcsfs.__version__
    below = {
        name: version(name) for name, floor in floors().items() if Version(version(name)) < floor
    }
    assert not below, f"installed below pyproject's floors {floors()}: {below}"


def document(n: int) -> dict[str, object]:
    """Version `n` of a record that grows with each rewrite (a reader of a stale length cuts)."""
    return {"version": n, "lines": [f"line {i} of version {n}" for i in range(n * 4)]}


def test_a_record_being_rewritten_is_never_read_cut(root):
    """A writer rewrites a growing record while readers read it: every read is a whole version.
    s3fs 0.4.2 read with HEAD then a ranged GET, and returned a cut document when a rewrite fell
    between the two."""
    writes, deadline = 150, time.monotonic() + 5
    root.write_json("jobs/j/status.json", document(0))
    written = threading.Event()
    reads: list[int] = []
    bad: list[str] = []

    def write() -> None:
        try:
            for n in range(1, writes + 1):
                if time.monotonic() > deadline:
                    break
                root.write_json("jobs/j/status.json", document(n))
        finally:
            written.set()

    def read() -> None:
        while not written.is_set():
            try:
                got = root.read_json("jobs/j/status.json")
            except Exception as e:  # a cut document is a JSONDecodeError
                bad.append(f"{type(e).__name__}: {e}")
                continue
            if got != document(got["version"]):
                bad.append(f"not a written version: {str(got)[:80]}")
            reads.append(got["version"])

    threads = [threading.Thread(target=write)] + [threading.Thread(target=read) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    assert not bad, f"{len(bad)} of {len(reads) + len(bad)} reads: {bad[:3]}"
    assert len(set(reads)) > 5, f"the readers saw too few versions to prove much: {set(reads)}"

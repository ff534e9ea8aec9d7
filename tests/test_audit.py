"""The audit trail (storage/audit.py, client/audit.py): one event per change made through us,
with who, what and how it ended, read back with `orchestrator events`. The verbs that need a
cluster (push, stop, shell, isession, deploy, deployment stop) are checked in their own modules'
tests (test_shell, test_interactive_sessions, test_deploy); here, those that need only the
storage root, the store on every backend, and writers racing from threads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator.client.audit import audited, events, record
from orchestrator.client.queue import set_capacity
from orchestrator.client.training_cache import delete_cache
from orchestrator.storage.audit import AuditEvent, append, read
from orchestrator.storage.projects import ProjectStore
from orchestrator.storage.root import StorageRoot
from orchestrator.storage.training_cache import CacheStore, LocalCopy

SECRET_VALUE = "s3cr3t-value-never-stored-0f9e"


def cli(*args: str, env: dict[str, str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True,
                          text=True, input=stdin, env=env, timeout=60)  # fmt: skip


def test_every_storage_verb_leaves_one_event_with_who_what_and_how_it_ended(tmp_path):
    """secrets set/delete (the CLI, on this machine), capacity set, cache delete: one event each,
    a refused one recorded as failed, no secret value anywhere in the trail."""
    storage_root = str(tmp_path / "storage")
    env = {**os.environ, "ORCHESTRATOR_STORAGE_ROOT": storage_root,
           "ORCHESTRATOR_SECRETS_DIR": str(tmp_path / "secrets")}  # fmt: skip
    assert cli("secrets", "set", "hf_token", "--team", "red", env=env,
               stdin=SECRET_VALUE).returncode == 0  # fmt: skip
    assert cli("secrets", "delete", "hf_token", "--team", "red", env=env).returncode == 0
    missing = cli("secrets", "delete", "hf_token", "--team", "red", env=env)
    assert missing.returncode == 1
    set_capacity("red", {"H100": 8}, cpus=64, storage_root=storage_root)
    root = StorageRoot(storage_root)
    project = ProjectStore(root).ensure("llama-ft")
    copy = LocalCopy(tmp_path / "node-cache")  # what a job left in its cache, written back
    (copy.data / "tokens.bin").write_bytes(b"x" * 1000)
    CacheStore(root, "red", project.id).write_back(copy)
    assert delete_cache("llama-ft", "red", storage_root=storage_root) == (1, 1000)

    shown = cli("events", "-o", "json", env=env)
    assert shown.returncode == 0, shown.stderr
    trail = json.loads(shown.stdout)
    assert [(e["verb"], e["result"].split(":")[0]) for e in trail] == [
        ("secrets set", "ok"), ("secrets delete", "ok"), ("secrets delete", "failed"),
        ("capacity set", "ok"), ("cache delete", "ok"),
    ]  # fmt: skip
    assert trail[0]["target"] == "hf_token" and trail[0]["team"] == "red"
    assert "no secret hf_token" in trail[2]["result"]
    assert trail[3]["detail"] == "H100 8, CPU 64" and trail[3]["team"] == "red"
    assert trail[4]["project"] == "llama-ft" and trail[4]["detail"] == "1 files, 1000 bytes"
    for e in trail:
        assert e["user"] and e["host"] and e["at"] <= time.time()
    stored = "".join(p.read_text() for p in Path(storage_root, "audit").rglob("*.json"))
    assert SECRET_VALUE not in stored + shown.stdout

    table = cli("events", "--team", "red", env={**env, "COLUMNS": "200"})
    assert table.returncode == 0 and "capacity set" in table.stdout, table.stderr
    assert "cache delete" in table.stdout and "failed: OrchestratorError" in table.stdout


def test_the_store_appends_and_filters_on_every_backend(root):
    for i, (job, team) in enumerate([("j1", "red"), ("j2", "blue"), ("j1", "red")]):
        append(root, AuditEvent(at=1_800_000_000 + i, verb="stop", result="ok", user="ann",
                                host="laptop", job=job, team=team))  # fmt: skip
    assert [e.at for e in read(root, job="j1")] == [1_800_000_000, 1_800_000_002]
    assert [e.job for e in read(root, team="blue")] == ["j2"]
    assert [e.at for e in read(root, since=1_800_000_001)] == [1_800_000_001, 1_800_000_002]
    assert read(root, project="none") == []


def test_events_from_many_threads_at_once_are_all_kept(tmp_path):
    """Eight threads recording 25 events each, many in the same microsecond: 200 events, none
    overwriting another."""
    root = StorageRoot(tmp_path / "storage")
    start = threading.Barrier(8)

    def writer(n: int) -> None:
        start.wait()
        for i in range(25):
            record(root, "push", {"job": f"t{n}-{i}"}, "ok")

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    found = read(root)
    assert sorted(e.job for e in found) == sorted(f"t{n}-{i}" for n in range(8) for i in range(25))


def test_a_failed_change_is_recorded_as_failed_and_still_raised(tmp_path):
    root = StorageRoot(tmp_path / "storage")
    with pytest.raises(ValueError, match="no such quota"), audited(root, "capacity set",
                                                                  team="red"):  # fmt: skip
        raise ValueError("no such quota\nsecond line left out")
    (event,) = read(root)
    assert event.result == "failed: ValueError: no such quota"


def test_a_trail_that_cannot_be_written_never_fails_the_change(tmp_path, caplog):
    """The change is made; the trail's storage refusing is said, not raised."""
    blocked = tmp_path / "storage"
    blocked.write_text("a file where the root's directory should be")
    with audited(StorageRoot(blocked), "stop", job="j1") as event:
        event["detail"] = "ended STOPPED"
    assert "could not record the audit event of stop" in caplog.text


def test_events_of_an_empty_root_say_so(tmp_path):
    env = {**os.environ, "ORCHESTRATOR_STORAGE_ROOT": str(tmp_path / "storage")}
    shown = cli("events", env=env)
    assert shown.returncode == 0 and "no events" in shown.stdout
    assert events(storage_root=str(tmp_path / "storage")) == []

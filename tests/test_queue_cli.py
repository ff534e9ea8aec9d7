"""`orchestrator capacity|queue|update` and their Python API, as a user runs them.

No Ray: queue entries and the service's view are written straight to a storage root through
`QueueStore`, as the queue service writes them; where a verb waits for the service, a thread
here plays the service's side of the file protocol (`take_requests`, then `put`).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from test_cli_checkpoints import cli, make_record
from typer.testing import CliRunner

from orchestrator.cli import render
from orchestrator.cli.app import app
from orchestrator.client.audit import events
from orchestrator.client.queue import capacity, queue, set_capacity, update_priority
from orchestrator.errors import ConfigError, OrchestratorError
from orchestrator.lifecycle import JobState
from orchestrator.storage import layout
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.queue_store import (
    NodeView,
    PriorityRequest,
    QueueEntry,
    QueueStore,
    QueueView,
    WaitingView,
)
from orchestrator.storage.records import JobStatus
from orchestrator.storage.root import StorageRoot

GiB = 1024**3
H100_NODE = {"GPU:H100": 8.0, "CPU": 16.0, "memory": 64.0 * GiB}


def invoke(*args: str) -> str:
    # The CLI's console took its width when it was made (from COLUMNS then): set it for this.
    taken = render.console._width
    render.console.width = 200
    try:
        result = CliRunner().invoke(app, list(args))
    finally:
        render.console._width = taken
    if result.exception is not None:
        raise result.exception
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture
def root(tmp_path) -> StorageRoot:
    """vision runs one job and waits with another; speech waits first (priority 5) and has one
    that fits no node; a job of no team has not been considered yet. Two nodes: one H100 node
    half used by vision's job, one idle A100 node."""
    root = StorageRoot(tmp_path / "storage")
    store = QueueStore(root)
    entries = [
        QueueEntry(job_id="run-v", team="vision", pushed_at=1.0, bundle=H100_NODE,
                   state="admitted", placed_on=["n1"], admitted_at=2.0),
        QueueEntry(job_id="wait-v", team="vision", pushed_at=10.0, bundle=H100_NODE, nodes=2),
        QueueEntry(job_id="wait-s", team="speech", pushed_at=20.0, priority=5,
                   bundle={"GPU:H100": 8.0}),
        QueueEntry(job_id="huge-s", team="speech", pushed_at=25.0, bundle={"GPU:H100": 16.0}),
        QueueEntry(job_id="wait-n", pushed_at=30.0, bundle={"CPU": 2.0}),
    ]  # fmt: skip
    for entry in entries:
        store.put(entry)
    store.write_view(QueueView(
        decided_at=1_700_000_000.0,
        waiting=[WaitingView(job_id="wait-s", position=1, reason="no node has 8 H100 free"),
                 WaitingView(job_id="wait-v", position=2, reason="behind wait-s")],
        impossible={"huge-s": "no node has 16 H100"},
        nodes=[
            NodeView(node_id="n1", capacity={"GPU:H100": 8, "CPU": 64, "memory": 512 * GiB},
                     free={"GPU:H100": 0, "CPU": 48, "memory": 448 * GiB}),
            NodeView(node_id="n2", capacity={"GPU:A100": 8, "CPU": 32, "memory": 256 * GiB},
                     free={"GPU:A100": 8, "CPU": 32, "memory": 256 * GiB}),
        ],
    ))  # fmt: skip
    return root


def test_capacity_set_replaces_a_teams_quota_and_clear_removes_it(root):
    out = invoke("capacity", "set", "--team", "vision", "--gpus", "h100=16", "--gpus", "A100=8",
                 "--cpus", "128", "--memory", "512Gi", "--storage-root", root.url)  # fmt: skip
    assert "team vision: 8 A100, 16 H100, 128 CPU, 512.0 GiB memory" in out
    invoke("capacity", "set", "--team", "vision", "--gpus", "H100=4", "--storage-root", root.url)
    assert QueueStore(root).quotas() == {"vision": {"GPU:H100": 4.0}}  # replaced, not merged
    out = invoke("capacity", "set", "--team", "vision", "--clear", "--storage-root", root.url)
    assert "team vision: none (unlimited)" in out
    assert QueueStore(root).quotas() == {}


def test_set_capacity_takes_sizes_and_any_case_and_no_limits_means_unlimited(root):
    quotas = set_capacity("speech", {"a100_40gb": 2}, memory="1.5Gi", storage_root=root.url)
    assert quotas == {"speech": {"GPU:A100_40GB": 2.0, "memory": 1.5 * GiB}}
    assert set_capacity("speech", storage_root=root.url) == {}
    with pytest.raises(ConfigError, match="'lots' is not a memory size"):
        set_capacity("speech", cpus=8, memory="lots", storage_root=root.url)
    with pytest.raises(ConfigError, match="cpus: -1 is not a count"):
        set_capacity("speech", cpus=-1, storage_root=root.url)
    assert QueueStore(root).quotas() == {}  # nothing written by a refused call


@pytest.mark.parametrize(
    ("value", "why"),
    [("H100", "write TYPE=COUNT"), ("H100=many", "write TYPE=COUNT"),
     ("X100=4", "'X100' is not an accelerator type: use one of T4, L4,")],
)  # fmt: skip
def test_a_bad_gpus_value_is_refused_naming_the_option(root, value, why):
    with pytest.raises(ConfigError) as refused:
        invoke("capacity", "set", "--team", "vision", "--gpus", value, "--storage-root", root.url)
    assert f"--gpus {value!r}" in str(refused.value) and why in str(refused.value)
    assert QueueStore(root).quotas() == {}


def test_a_bad_gpus_value_exits_2_with_the_reason_on_stderr(root):
    result = cli("capacity", "set", "--team", "vision", "--gpus", "X100=4", "--storage-root",
                 root.url)  # fmt: skip
    assert result.returncode == 2
    assert "--gpus 'X100=4'" in result.stderr and "H100" in result.stderr


def test_capacity_shows_each_teams_quota_use_and_queue_and_the_clusters_gpus(root):
    set_capacity("vision", {"H100": 16}, cpus=128, storage_root=root.url)
    found = capacity(storage_root=root.url)
    assert list(found["teams"]) == ["(no team)", "speech", "vision"]
    vision = found["teams"]["vision"]
    assert vision["quota"] == {"GPU:H100": 16.0, "CPU": 128.0}
    assert vision["in_use"] == H100_NODE
    assert vision["queued"] == {"GPU:H100": 16.0, "CPU": 32.0, "memory": 128.0 * GiB}  # 2 nodes
    assert (vision["jobs_running"], vision["jobs_queued"]) == (1, 1)
    speech = found["teams"]["speech"]
    assert speech["quota"] == {} and speech["queued"] == {"GPU:H100": 24.0}
    assert found["accelerators"] == {"A100": {"total": 8.0, "free": 8.0},
                                     "H100": {"total": 8.0, "free": 0.0}}  # fmt: skip
    assert found["cpus"] == {"total": 96.0, "free": 80.0}
    assert found["memory"] == {"total": 768.0 * GiB, "free": 704.0 * GiB}
    assert found["decided_at"] == 1_700_000_000.0

    out = invoke("capacity", "view", "--storage-root", root.url)
    assert "16 H100, 128 CPU" in out and "none (unlimited)" in out
    assert "8 H100, 16 CPU, 64.0 GiB memory" in out  # vision's running job
    assert "H100 GPUs" in out and "A100 GPUs" in out and "768.0 GiB" in out
    as_json = json.loads(invoke("capacity", "view", "-o", "json", "--storage-root", root.url))
    assert as_json["teams"]["vision"]["jobs_queued"] == 1


def test_capacity_before_any_service_says_the_cluster_is_unknown(tmp_path):
    url = str(tmp_path / "empty")
    assert capacity(storage_root=url) == {"teams": {}, "accelerators": {}, "cpus": {},
                                          "memory": {}, "decided_at": None}  # fmt: skip
    out = invoke("capacity", "view", "--storage-root", url)
    assert "no quotas" in out and "no queue service has reported yet" in out
    assert "prices: none set" in out
    invoke("capacity", "price", "--gpu", "H100=2.49", "--storage-root", url)
    out = invoke("capacity", "view", "--storage-root", url)
    assert "prices: H100 2.49/GPU-hour (USD)" in out
    as_json = json.loads(invoke("capacity", "view", "-o", "json", "--storage-root", url))
    assert as_json["prices"]["gpu"] == {"H100": 2.49}


def test_queue_lists_waiting_jobs_next_first_then_unconsidered_then_impossible(root):
    rows = queue(storage_root=root.url)
    assert [(r["job_id"], r["position"], r["state"]) for r in rows] == [
        ("wait-s", 1, "queued"), ("wait-v", 2, "queued"), ("wait-n", None, "queued"),
        ("huge-s", None, "impossible"),
    ]  # fmt: skip
    assert rows[1]["demand"] == "2 x (8 H100, 16 CPU, 64.0 GiB memory)"
    assert rows[1]["reason"] == "behind wait-s" and rows[0]["priority"] == 5
    assert rows[2]["team"] is None and "not yet considered" in rows[2]["reason"]
    assert rows[3]["reason"] == "no node has 16 H100"
    with_running = queue(include_running=True, storage_root=root.url)
    assert with_running[0]["job_id"] == "run-v" and with_running[0]["state"] == "admitted"

    out = invoke("queue", "--storage-root", root.url)
    lines = {job: next(line for line in out.splitlines() if job in line)
             for job in ("wait-s", "wait-v", "wait-n", "huge-s")}  # fmt: skip
    rows_at = [out.index(line) for line in lines.values()]
    assert rows_at == sorted(rows_at)  # in the queue's order
    assert "no node has 8 H100 free" in lines["wait-s"]
    assert "impossible: no node has 16 H100" in lines["huge-s"]
    assert "run-v" not in out
    as_json = json.loads(invoke("queue", "-o", "json", "--storage-root", root.url))
    assert [r["job_id"] for r in as_json] == ["wait-s", "wait-v", "wait-n", "huge-s"]


def test_queue_names_each_job_by_its_project_and_name_from_its_record(root):
    store = JobStore(root)
    named = make_record("wait-s", "speech", 20.0).model_copy(update={"job_name": "asr-large"})
    store.create(named, JobStatus.new("wait-s"))
    store.create(make_record("wait-v", "vision", 10.0), JobStatus.new("wait-v"))  # no name
    root.write_bytes(layout.record("huge-s"), b"{not json")  # unreadable; wait-n has none
    rows = {r["job_id"]: r for r in queue(storage_root=root.url)}
    assert (rows["wait-s"]["project"], rows["wait-s"]["job_name"]) == ("speech", "asr-large")
    assert (rows["wait-v"]["project"], rows["wait-v"]["job_name"]) == ("vision", None)
    assert rows["wait-n"]["project"] is None and rows["huge-s"]["job_name"] is None

    out = invoke("queue", "--storage-root", root.url)
    lines = {job: next(line for line in out.splitlines() if job in line)
             for job in ("wait-s", "wait-v", "wait-n", "huge-s")}  # fmt: skip
    assert "│ speech/asr-large │" in lines["wait-s"]
    assert re.search(r"│ wait-v │ vision +│ vision +│", lines["wait-v"])  # no name: the project
    assert "│ wait-n │ -" in lines["wait-n"] and "│ huge-s │ -" in lines["huge-s"]
    as_json = json.loads(invoke("queue", "-o", "json", "--storage-root", root.url))
    assert [(r["job_id"], r["project"], r["job_name"]) for r in as_json] == [
        ("wait-s", "speech", "asr-large"), ("wait-v", "vision", None), ("wait-n", None, None),
        ("huge-s", None, None),
    ]  # fmt: skip


def test_queue_all_says_why_each_running_job_was_or_was_not_preempted(tmp_path):
    root = StorageRoot(tmp_path / "storage")
    store = QueueStore(root)
    running = {"gone": {"preemption": "preempted by next: borrowed capacity its team's quota "
                                      "needs", "preempted_by": "next"},
               "kept": {}, "lent": {"borrowed": True}, "plain": {}}  # fmt: skip
    for i, (job_id, extra) in enumerate(running.items()):
        store.put(QueueEntry(job_id=job_id, team="t", pushed_at=float(i), bundle={"CPU": 1},
                             state="admitted", placed_on=["n1"], **extra))  # fmt: skip
    spared = "not preempted for urgent: preemption within a team is off " \
        "(ORCHESTRATOR_QUEUE_PREEMPT_WITHIN_TEAM=never)"  # fmt: skip
    store.write_view(QueueView(spared={"kept": spared}))
    rows = {r["job_id"]: r["reason"] for r in queue(include_running=True, storage_root=root.url)}
    assert rows == {
        "gone": "preempted by next: borrowed capacity its team's quota needs",
        "kept": spared,
        "lent": "borrowed: it gives way first when the owners need their quota",
        "plain": "",
    }
    out = invoke("queue", "--all", "--storage-root", root.url)
    assert "ORCHESTRATOR_QUEUE_PREEMPT_WITHIN_TEAM=never" in out


def test_an_empty_queue_says_so(tmp_path):
    assert "the queue is empty" in invoke("queue", "--storage-root", str(tmp_path / "empty"))


# -- update --priority ---------------------------------------------------------------------------


def _job(root: StorageRoot, job_id: str, *states: JobState) -> None:
    store = JobStore(root)
    status = JobStatus.new(job_id)
    store.create(make_record(job_id, "proj", 1.0), status)
    for state in states:
        status = status.moved_to(state)
    store.put_status(status)


@contextmanager
def service(root: StorageRoot, apply: Callable[[QueueStore, PriorityRequest], None]) -> Iterator:
    """The queue service's side of a priority request: take it, then rewrite the entry."""
    store, done = QueueStore(root), threading.Event()

    def serve() -> None:
        while not done.wait(0.02):
            for request in store.take_requests():
                apply(store, request)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _applied(store: QueueStore, request: PriorityRequest) -> None:
    entry = store.entry(request.job_id)
    assert entry is not None
    store.put(entry.model_copy(update={"priority": request.priority}))


def _admitted_first(store: QueueStore, request: PriorityRequest) -> None:
    entry = store.entry(request.job_id)
    assert entry is not None
    store.put(entry.model_copy(update={"state": "admitted", "placed_on": ["n1"]}))


def test_update_changes_a_waiting_jobs_priority_once_the_service_applies_it(root):
    _job(root, "wait-v", JobState.PENDING)
    with service(root, _applied):
        assert update_priority("wait-v", 9, storage_root=root.url) == 9
        out = invoke("update", "--job-id", "wait-v", "--priority", "3", "--storage-root",
                     root.url)  # fmt: skip
    assert "job wait-v: priority 3" in out
    assert QueueStore(root).entry("wait-v").priority == 3
    trail = [(e.verb, e.result, e.detail) for e in events(job="wait-v", storage_root=root.url)]
    assert trail == [("update", "ok", "priority 9"), ("update", "ok", "priority 3")]


def test_update_refuses_a_job_that_is_not_pending_or_not_waiting_in_the_queue(root):
    _job(root, "run-v", JobState.DEPLOYING, JobState.RUNNING)
    _job(root, "gone", JobState.PENDING)  # PENDING, but no queue entry
    _job(root, "wait-v", JobState.PENDING)
    with pytest.raises(OrchestratorError, match="job run-v is RUNNING: only a PENDING job"):
        update_priority("run-v", 9, storage_root=root.url)
    with pytest.raises(OrchestratorError, match="job gone is PENDING but not in the queue"):
        update_priority("gone", 9, storage_root=root.url)
    store = QueueStore(root)
    store.put(store.entry("wait-v").model_copy(update={"state": "admitted"}))
    with pytest.raises(OrchestratorError, match="job wait-v is PENDING but admitted already"):
        update_priority("wait-v", 9, storage_root=root.url)
    assert not any(store.request_pending(j) for j in ("run-v", "gone", "wait-v"))
    refused = [(e.job, e.result.split(":")[0]) for e in events(storage_root=root.url)]
    assert refused == [("run-v", "failed"), ("gone", "failed"), ("wait-v", "failed")]

    result = cli("update", "--job-id", "run-v", "--priority", "9", "--storage-root", root.url)
    assert result.returncode == 1 and "can be re-prioritised" in result.stderr


def test_update_says_when_the_job_left_the_queue_before_the_change(root):
    _job(root, "wait-v", JobState.PENDING)
    with service(root, _admitted_first), pytest.raises(OrchestratorError, match="left the queue"):
        update_priority("wait-v", 9, storage_root=root.url, timeout_s=2)
    assert QueueStore(root).entry("wait-v").priority == 0


def test_update_with_no_queue_service_times_out_and_leaves_the_request(root):
    _job(root, "wait-v", JobState.PENDING)
    with pytest.raises(OrchestratorError, match=r"no queue service took the request within 0.3 s"):
        update_priority("wait-v", 9, storage_root=root.url, timeout_s=0.3)
    store = QueueStore(root)
    assert store.request_pending("wait-v")  # a service started later still applies it
    assert [(r.job_id, r.priority) for r in store.take_requests()] == [("wait-v", 9)]

"""A Ray Train job's checkpoints, without a cluster: where Train's writes land on a node
(agents/ray_train_storage.py), a directory that is a checkpoint only once Train committed it
(the uploader in Train mode), the restore before a retry (the other nodes' parts beside a node's
own, Train's snapshot naming the resume point), and the rule that picks it (`train_resume_point`).
The same end to end on a simulated cluster with a lost node: tests/test_ray_train_resume.py.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from test_checkpoint_upload import names, reasons, scanned, states, uploader, wait_until

from orchestrator.agents import ray_train_storage
from orchestrator.agents.ray_train_seams import resume_snapshot, seams
from orchestrator.agents.ray_train_storage import PREFIX, NodeCheckpointDirs
from orchestrator.controller.checkpointing import train_commits, train_snapshot
from orchestrator.controller.resume_point import TrainCommit, train_resume_point
from orchestrator.storage.checkpoints import CheckpointStore, Manifest, ManifestFile
from orchestrator.storage.root import StorageRoot
from orchestrator.storage.train_reports import TrainReport, TrainRun

# --- where Train's writes land -------------------------------------------------------------------


@pytest.fixture
def node_fs(tmp_path, monkeypatch) -> tuple[pafs.FileSystem, Path]:
    """Train's filesystem as a process on node rank 1 resolves it (its own checkpoint dir)."""
    monkeypatch.setattr(ray_train_storage, "node_rank", lambda group: 1)
    monkeypatch.setenv("ORCHESTRATOR_NODE_ROOT", str(tmp_path / "node"))
    handler = NodeCheckpointDirs("jtrain1", "orchestrator-jtrain1", "run", None, "/nowhere")
    return pafs.PyFileSystem(handler), tmp_path / "node/jobs/jtrain1/rank-1/checkpoints"


def test_a_checkpoint_written_under_the_run_lands_in_the_nodes_checkpoint_dir(node_fs):
    fs, local = node_fs
    run = f"{PREFIX}/run"
    fs.create_dir(f"{run}/checkpoint_1", recursive=True)
    with fs.open_output_stream(f"{run}/checkpoint_1/shard-1.txt") as f:
        f.write(b"1@0")
    assert (local / "checkpoint_1" / "shard-1.txt").read_bytes() == b"1@0"
    with fs.open_input_stream(f"{run}/checkpoint_1/shard-1.txt") as f:
        assert f.read() == b"1@0"
    listed = fs.get_file_info(pafs.FileSelector(run, recursive=True))
    assert sorted(i.path for i in listed) == [f"{run}/checkpoint_1",
                                              f"{run}/checkpoint_1/shard-1.txt"]  # fmt: skip
    fs.delete_dir(f"{run}/checkpoint_1")  # Train's num_to_keep
    assert not (local / "checkpoint_1").exists()


def test_trains_storage_check_is_answered_on_every_node_and_kept_in_no_checkpoint(node_fs):
    fs, local = node_fs
    fs.create_dir(f"{PREFIX}/run", recursive=True)
    marker = f"{PREFIX}/run/.validate_storage_marker"
    (info,) = fs.get_file_info([marker])  # a node where the controller never wrote it
    assert info.type == pafs.FileType.File
    with fs.open_output_stream(marker):
        pass
    assert sorted(p.name for p in local.iterdir()) == []  # not a file at the top


def test_a_path_outside_the_run_is_refused_and_the_node_is_resolved_where_it_is_used(node_fs):
    fs, _ = node_fs
    with pytest.raises(ValueError, match="outside the job's Ray Train storage /orchestrator-job/"):
        fs.get_file_info(["/home/user/ray_results/x"])
    (ancestor,) = fs.get_file_info([PREFIX])  # Train makes the storage path's parents
    assert ancestor.type == pafs.FileType.Directory
    handler = NodeCheckpointDirs("j", "g", "run", "/ckpt", "/driver")
    handler._dir = Path("/resolved/on/this/node")
    assert pickle.loads(pickle.dumps(handler))._dir is None  # each process resolves its own
    assert pickle.loads(pickle.dumps(handler)) == handler


def test_the_driver_and_trains_controller_off_the_jobs_nodes_use_rank_0s_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(ray_train_storage, "node_rank", lambda group: None)
    handler = NodeCheckpointDirs("j", "g", "run", None, str(tmp_path / "rank-0"))
    assert handler.directory == tmp_path / "rank-0" and handler.directory.is_dir()
    # Without checkpointing: a directory of the attempt's in each rank's scratch, never stored.
    monkeypatch.setenv("ORCHESTRATOR_NODE_ROOT", str(tmp_path / "node"))
    unstored = NodeCheckpointDirs("j", "g", "run", None, "", attempt=2)
    assert unstored.rank_dir(1) == tmp_path / "node/jobs/j/rank-1/scratch/ray-train/attempt-2"


# --- committed, then uploaded --------------------------------------------------------------------


def test_a_train_directory_is_uploaded_once_committed_and_never_if_not(
    root: StorageRoot, tmp_path, monkeypatch
):
    monkeypatch.setenv("ORCHESTRATOR_NODE_ROOT", str(tmp_path / "node-root"))  # the rank's own
    local = tmp_path / "ck"
    up = uploader(root, local, settle_s=0.1)
    up.tracker.commit_only = True  # as CheckpointUploader(train_run=True) has it
    for name in ("checkpoint_a", "checkpoint_b"):
        (local / name).mkdir()
        (local / name / "model.pt").write_bytes(b"w" * 100)
    scanned(up, 10)  # quiet far past settle_s: a Train directory does not settle
    assert names(root) == []
    up.train_committed("checkpoint_a", [0, 1])
    wait_until(lambda: names(root) == ["checkpoint_a"], "the committed checkpoint stored")
    (stored,) = CheckpointStore(root).list("p", "j")
    assert stored.train_parts == [0, 1]  # whole once node 1's part is stored too
    up.train_committed("checkpoint_never_written", [0])  # no part on this node: nothing to do
    result = up.flush(timeout=10)
    assert names(root) == ["checkpoint_a"]  # the one never committed is not stored at all
    assert states(result)["checkpoint_b"] == "ignored"
    assert "Ray Train never committed it" in reasons(result)["checkpoint_b"]


def manifest(rank: int, name: str, at: float, files: dict[str, bytes]) -> Manifest:
    import hashlib

    return Manifest(
        project="p", job_id="j", node_rank=rank, name=name, created_at=at, size_bytes=1,
        files=[ManifestFile(path=p, size=len(b), sha256=hashlib.sha256(b).hexdigest())
               for p, b in files.items()],
    )  # fmt: skip


def test_a_retry_puts_the_other_nodes_parts_beside_its_own_and_trains_snapshot(
    root: StorageRoot, tmp_path, monkeypatch
):
    monkeypatch.setenv("ORCHESTRATOR_NODE_ROOT", str(tmp_path / "node-root"))  # set aside there
    store = CheckpointStore(root)
    for rank, files in ((0, {"model.pt": b"m", "shard-0.txt": b"0"}), (1, {"shard-1.txt": b"1"})):
        part = tmp_path / f"part{rank}" / "checkpoint_x"
        part.mkdir(parents=True)
        for rel, data in files.items():
            (part / rel).write_bytes(data)
        store.upload(part, "p", "j", rank, up_settings(), name="checkpoint_x")
    stored = {m.node_rank: m for m in store.list("p", "j")}
    local = tmp_path / "node1"  # a replacement node 1: nothing of the job
    up = uploader(root, local, rank=1)
    up.tracker.commit_only = True
    up.begin_attempt(1, stored[1], [], None, [stored[0]], None)
    assert sorted(p.name for p in (local / "checkpoint_x").iterdir()) == [
        "model.pt", "shard-0.txt", "shard-1.txt"
    ]  # fmt: skip
    scanned(up, 5)
    assert [m.version for m in store.list("p", "j") if m.node_rank == 1] == [1]  # not again
    driver = tmp_path / "node0"
    up0 = uploader(root, driver, rank=0)
    snapshot = resume_snapshot(seams(), "checkpoint_x", {"step": 4}, 4)
    up0.begin_attempt(1, stored[0], [], None, [stored[1]], snapshot)
    written = json.loads((driver / "checkpoint_manager_snapshot.json").read_text())
    assert written["latest_checkpoint_result"]["checkpoint_dir_name"] == "checkpoint_x"
    assert written["current_report_index"] == 5
    up0.begin_attempt(2, None, ["checkpoint_x"], None, [], "")  # from the start: no snapshot
    assert not (driver / "checkpoint_manager_snapshot.json").exists()
    up.flush(timeout=5), up0.flush(timeout=5)


def up_settings():
    from orchestrator.storage.checkpoints import UploadSettings

    return UploadSettings()


# --- the resume point ----------------------------------------------------------------------------


def part(rank: int, name: str, at: float, complete: bool = True) -> Manifest:
    m = manifest(rank, name, at, {f"shard-{rank}.txt": name.encode()})
    return m.model_copy(update={"complete": complete})


def test_the_newest_commit_whose_every_part_is_stored_is_resumed_whole():
    commits = [TrainCommit(f"checkpoint_{i}", (0, 1), 10.0 * i, i) for i in (1, 2, 3)]
    # checkpoint_3: node 1's part was lost with its node; an orphan was never committed.
    manifests = [part(0, "checkpoint_1", 11), part(1, "checkpoint_1", 11),
                 part(0, "checkpoint_2", 21), part(1, "checkpoint_2", 22),
                 part(0, "checkpoint_3", 31)]  # fmt: skip
    point = train_resume_point(manifests, commits, ranks=2)
    assert point.name == "checkpoint_2" and point.commit == commits[1]
    assert {r: m.node_rank for r, m in point.copies.items()} == {0: 0, 1: 1}
    assert {r: [m.node_rank for m in ms] for r, ms in point.parts.items()} == {0: [1], 1: [0]}
    assert point.newer == {0: ["checkpoint_3"], 1: []}


def test_a_checkpoint_only_rank_0_wrote_goes_to_every_node_and_none_whole_starts_over():
    commits = [TrainCommit("checkpoint_1", (0,), 10, 0)]
    point = train_resume_point([part(0, "checkpoint_1", 11)], commits, ranks=2)
    assert point.name == "checkpoint_1"
    assert [m.node_rank for m in point.parts[1]] == [0] and 1 not in point.copies
    half = [part(0, "checkpoint_1", 11, complete=False)]
    start = train_resume_point(half, commits, ranks=2)
    assert (start.name, start.newer) == (None, {0: ["checkpoint_1"], 1: []})
    assert start.why == "no checkpoint Ray Train committed is stored whole"
    assert train_snapshot(start.commit) == ""
    uncommitted = train_resume_point([part(0, "checkpoint_9", 11)], [], ranks=1)
    assert uncommitted.name is None and uncommitted.why == "Ray Train committed no checkpoint"


def test_the_commits_are_read_from_the_stored_rounds():
    run = TrainRun(job_id="j", run_id="r", started_at=1, reports=[
        TrainReport(index=0, at=5, metrics={"step": 0}),
        TrainReport(index=1, at=6, metrics={"step": 1}, checkpoint="checkpoint_a", parts=[0, 1]),
    ])  # fmt: skip
    assert train_commits([run]) == [TrainCommit("checkpoint_a", (0, 1), 6, 1, {"step": 1})]
    # A round lost with the driver's node after the uploaders had its commit: the parts say.
    later = part(0, "checkpoint_b", 9).model_copy(update={"train_parts": [0, 1]})
    assert train_commits([run], [later, part(0, "checkpoint_a", 7)]) == [
        TrainCommit("checkpoint_a", (0, 1), 6, 1, {"step": 1}),
        TrainCommit("checkpoint_b", (0, 1), 9, 2),
    ]

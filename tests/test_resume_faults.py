"""A retried job never resumes a rank from another rank's state unless the job's checkpoints are
known to be shared (issue 58), on the simulated GPU cluster of tests/test_faults.py.

- Every rank saves its own state (`.checkpoint-N` renamed to `checkpoint-N`, holding the rank's
  number). Rank 0's node crashes before its first save, or during it (its `.checkpoint-2` half
  written); rank 1 goes on and stores checkpoints while Ray has not yet declared the node dead.
  Rank 0 may write (it was not seen running with an empty directory after another rank stored
  one, or was seen writing) and stored none: the next attempt starts every rank again, says why
  in the job's log, and never restores rank 1's checkpoint on rank 0.
- Rank 0 saves for every rank; rank 1's node crashes after rank 0 stored checkpoints. Rank 1
  was seen running with an empty directory after rank 0's first: it gets rank 0's copy, and
  the job keeps its progress.
- nanoGPT's pattern: rank 0 overwrites `$BT_CHECKPOINT_DIR/ckpt.pt` in place (the checkpoint
  `top-level`), its node crashes, and every rank finds ckpt.pt at the same path on the retry.
"""

from __future__ import annotations

import time

import pytest
import test_faults
import torch
from conftest import eventually, make_job

from orchestrator.client.api import push
from orchestrator.lifecycle import JobState

pytestmark = pytest.mark.cluster  # starts Ray itself (a simulated cluster)

faults = test_faults.faults  # the module's own simulated cluster: a 2-node job and a spare
lines_of, stored = test_faults.lines_of, test_faults.stored

# Each rank resumes from the newest checkpoint in its directory and says whose state it holds;
# it waits for GO before its first step (the test crashes rank 0's node there, or while rank 0,
# told to HOLD, is halfway through its first save), then saves its own state every second step.
TRAIN = """
import os, pathlib, sys, time
rank, attempt = os.environ["BT_NODE_RANK"], os.environ["BT_RETRY_COUNT"]
ck = pathlib.Path(os.environ["BT_CHECKPOINT_DIR"])
go, steps, hold = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "hold"
hold = hold and rank == "0" and attempt == "0"
found = {int(p.name.split("-")[1]): p for p in ck.glob("checkpoint-*")}
start = max(found, default=0)
whose = (found[start] / "rank").read_text() if start else rank
print(f"attempt {attempt} resumes at {start} with rank {whose}'s state", flush=True)
while not go.exists():
    time.sleep(0.05)
for step in range(start + 1, steps + 1):
    time.sleep(0.5)
    if step % 2 == 0:
        tmp = ck / f".checkpoint-{step}"
        tmp.mkdir()
        (tmp / "rank").write_text(rank)
        while hold:
            print(f"saving checkpoint-{step}", flush=True)
            time.sleep(60)  # its node crashes here
        (tmp / "state").write_bytes(os.urandom(1024))  # this rank's own
        os.rename(tmp, ck / f"checkpoint-{step}")
        print(f"saved checkpoint-{step}", flush=True)
print("done", flush=True)
"""


# Rank 0 saves the state of every rank, one checkpoint a step; rank 1 writes nothing and, like
# the DDP recipe's ranks, resumes from the newest checkpoint in its own directory.
SHARED = """
import os, pathlib, sys, time
rank, attempt = os.environ["BT_NODE_RANK"], os.environ["BT_RETRY_COUNT"]
ck = pathlib.Path(os.environ["BT_CHECKPOINT_DIR"])
steps = int(sys.argv[1])
start = max((int(p.name.split("-")[1]) for p in ck.glob("checkpoint-*")), default=0)
print(f"attempt {attempt} resumes at {start}", flush=True)
for step in range(start + 1, steps + 1):
    time.sleep(1.0)
    if rank == "0":
        tmp = ck / f".checkpoint-{step}"
        tmp.mkdir()
        (tmp / "state").write_text(str(step))
        os.rename(tmp, ck / f"checkpoint-{step}")
print("done", flush=True)
"""


@pytest.mark.parametrize("when", ["before", "during"])
def test_a_rank_crashed_before_or_during_its_first_save_is_not_resumed_from_another_ranks_state(
    tmp_path, storage_root, faults, when
):
    faults.ensure_workers(3)
    go = tmp_path / "go"
    args = f"{go} 24 {'hold' if when == 'during' else '-'}"
    config = test_faults.two_node_job(tmp_path / "job", TRAIN, args)
    job = push(config, address=faults.dashboard_url, storage_root=storage_root, retries=1)

    def both_waiting() -> bool:
        return all(
            any(line.startswith("attempt 0 resumes at 0") for line in lines_of(job, rank))
            for rank in (0, 1)
        )

    eventually(both_waiting, "both ranks to start", 90)
    crashed = job.details().nodes[0].node_id
    if when == "during":
        go.touch()
        eventually(lambda: "saving checkpoint-2" in lines_of(job, 0), "rank 0's first save", 30)
    faults.cluster.remove_node(faults.node(crashed), allow_graceful=False)
    go.touch()
    # Rank 1 stores checkpoints of its own while Ray has not declared rank 0's node dead.
    eventually(lambda: {"checkpoint-2", "checkpoint-4"} <= stored(job, 1),
               "rank 1's checkpoints after rank 0's node crashed", 30)  # fmt: skip

    assert job.wait(timeout=180) == JobState.COMPLETED, "\n".join(job.logs()[-40:])
    first, second = job.details().attempts
    assert (first.cause, first.rank, first.node_id) == ("node_lost", 0, crashed), first
    rank0, rank1 = lines_of(job, 0), lines_of(job, 1)
    assert not [line for line in rank0 if "restored rank-1/" in line], rank0
    assert [line for line in rank0 if line.startswith("attempt 1 ")] == [
        "attempt 1 resumes at 0 with rank 0's state"
    ], rank0
    assert second.resumed_from is None, second
    logs = job.logs()
    decision = [line for line in logs if "[checkpoints] attempt 1 resumes from" in line]
    assert len(decision) == 1, logs
    said = decision[0].split("] [checkpoints] ", 1)[1]
    why = said.removeprefix("attempt 1 resumes from the start: rank 0 has no complete checkpoint (")
    assert why != said, said
    unseen = "it stored no checkpoint and was not seen running with an empty checkpoint directory"
    # Mid-save, its uploader may have told the controller of `.checkpoint-2` before the crash.
    assert why.startswith((unseen, "it had written .checkpoint-2 ") if when == "during" else unseen)
    assert "not known to be shared" in why, said
    # Rank 1's own checkpoints were set aside, so that it does not run ahead of rank 0.
    assert [line for line in rank1 if line.startswith("attempt 1 ")] == [
        "attempt 1 resumes at 0 with rank 1's state"
    ], rank1
    assert any("[checkpoints] checkpoint-4 moved to " in line and "the job starts again" in line
               for line in rank1), rank1  # fmt: skip
    test_faults.assert_nothing_left(job, faults)


def test_a_rank_that_never_writes_gets_the_writers_copy_when_its_node_crashes(
    tmp_path, storage_root, faults
):
    faults.ensure_workers(3)
    config = test_faults.two_node_job(tmp_path / "job", SHARED, "8")
    job = push(config, address=faults.dashboard_url, storage_root=storage_root, retries=1)
    eventually(lambda: {"checkpoint-2"} <= stored(job, 0), "rank 0's second checkpoint", 90)
    crashed = job.details().nodes[1].node_id
    faults.cluster.remove_node(faults.node(crashed), allow_graceful=False)

    assert job.wait(timeout=180) == JobState.COMPLETED, "\n".join(job.logs()[-40:])
    first, second = job.details().attempts
    assert (first.cause, first.rank, first.node_id) == ("node_lost", 1, crashed), first
    assert second.resumed_from is not None, "\n".join(job.logs()[-40:])
    resumed = int(second.resumed_from.split("-")[1])
    assert resumed >= 2
    decision = [line for line in job.logs() if "[checkpoints] attempt 1 resumes from" in line]
    said = decision[0].split("] [checkpoints] ", 1)[1]
    assert said.startswith(
        f"attempt 1 resumes from checkpoint-{resumed}: rank 0 writes the checkpoints for every "
        "rank; rank 1 does not: its checkpoint directory stayed empty, its commands running, "
        "while rank 0 stored checkpoint-1 and "
    ), said
    assert said.endswith("; rank(s) 1 get rank 0's copy"), said
    rank1 = lines_of(job, 1)
    assert (
        f"[checkpoints] restored rank-0/checkpoint-{resumed} from the storage root into "
        "$BT_CHECKPOINT_DIR for attempt 1: 1 files, 0.0 MB" in rank1
    ), rank1
    assert [line for line in rank1 if line.startswith("attempt 1 ")] == [
        f"attempt 1 resumes at {resumed}"
    ], rank1
    assert [line for line in lines_of(job, 0) if line.startswith("attempt 1 ")] == [
        f"attempt 1 resumes at {resumed}"
    ]
    # Its copy is rank 0's, restored: never stored again as rank 1's.
    assert {m.node_rank for m in job.checkpoints()} == {0}
    test_faults.assert_nothing_left(job, faults)


# nanoGPT's pattern (karpathy/nanoGPT train.py with --out_dir=$BT_CHECKPOINT_DIR): the master
# process overwrites out_dir/ckpt.pt in place at every evaluation, and every rank resumes from
# out_dir/ckpt.pt (--init_from=resume) when it is there.
NANOGPT = """
import os, sys, time
import torch
rank, attempt = os.environ["BT_NODE_RANK"], os.environ["BT_RETRY_COUNT"]
out_dir, max_iters = os.environ["BT_CHECKPOINT_DIR"], int(sys.argv[1])
ckpt_path = os.path.join(out_dir, "ckpt.pt")
iter_num = torch.load(ckpt_path)["iter_num"] if os.path.exists(ckpt_path) else 0
print(f"attempt {attempt} resumes at {iter_num}", flush=True)
while iter_num < max_iters:
    time.sleep(0.5)
    iter_num += 1
    if rank == "0" and iter_num % 2 == 0:  # eval_interval, master_process
        torch.save({"iter_num": iter_num, "model": torch.zeros(1000)}, ckpt_path)
print("done", flush=True)
"""

LOADER = """
import os, pathlib
import torch
root = pathlib.Path(os.environ["BT_LOAD_CHECKPOINT_DIR"])
for path in sorted(root.rglob("ckpt.pt")):
    print(f"loaded {path.relative_to(root)} at {torch.load(path)['iter_num']}", flush=True)
"""


def test_a_file_overwritten_in_place_resumes_at_its_path_after_a_crash(
    tmp_path, storage_root, faults
):
    """Issue 58: `ckpt.pt` at the top of $BT_CHECKPOINT_DIR is the checkpoint `top-level`.
    Rank 0's node crashes; the retry finds ckpt.pt at the same path on both ranks, holding the
    last step stored, and continues; a later job loads it."""
    faults.ensure_workers(3)
    config = test_faults.two_node_job(tmp_path / "job", NANOGPT, "24")
    job = push(config, address=faults.dashboard_url, storage_root=storage_root, retries=1)

    def stored_version() -> int:
        top = [m for m in job.checkpoints() if m.name == "top-level" and m.complete]
        return top[0].version if top else 0

    eventually(lambda: stored_version() >= 2, "ckpt.pt stored twice", 90)
    crashed = job.details().nodes[0].node_id
    crash_at = time.time()
    faults.cluster.remove_node(faults.node(crashed), allow_graceful=False)
    (last,) = [m for m in job.checkpoints() if m.name == "top-level"]
    saved = job.download_checkpoint(last, tmp_path / "last")
    step = torch.load(saved / "ckpt.pt")["iter_num"]

    assert job.wait(timeout=180) == JobState.COMPLETED, "\n".join(job.logs()[-40:])
    first, second = job.details().attempts
    assert (first.cause, first.rank, second.resumed_from) == ("node_lost", 0, "top-level")
    # The books: what the crash cost is the work after the version attempt 1 resumed from.
    assert second.resumed_at == pytest.approx(last.created_at, abs=0.01)
    assert first.checkpoint_at is not None and first.checkpoint_at <= crash_at < first.ended_at
    lost = job.usage().attempts[0].lost
    assert lost.held_s == pytest.approx(first.ended_at - second.resumed_at, abs=0.01)
    assert 0 < lost.held_s < first.ended_at - first.started_at
    assert lost.gpu_s == {"H100": pytest.approx(2 * 2 * lost.held_s)}  # 2 nodes of 2 H100
    for rank in (0, 1):
        lines = lines_of(job, rank)
        assert [line for line in lines if line.startswith("attempt 1 ")] == [
            f"attempt 1 resumes at {step}"
        ], lines
        assert any(line.startswith("[checkpoints] restored rank-0/top-level from the storage "
                                   "root into $BT_CHECKPOINT_DIR for attempt 1: 1 files")
                   for line in lines), lines  # fmt: skip
    assert not any("ignoring ckpt.pt" in line for line in job.logs())
    (final,) = job.checkpoints()
    assert (final.name, final.node_rank, final.complete) == ("top-level", 0, True)
    got = job.download_checkpoint(final, tmp_path / "final")
    assert torch.load(got / "ckpt.pt")["iter_num"] == 24, "\n".join(lines_of(job, 0))

    load = """
        load_checkpoint_config=definitions.LoadCheckpointConfig(enabled=True, checkpoints=[
            definitions.BasetenCheckpoint.from_latest_checkpoint(job_id=JOB)]),"""
    config = make_job(tmp_path / "reader", f"""
        from truss_train import definitions
        JOB = {job.id!r}
        project = definitions.TrainingProject(
            name="faults",
            job=definitions.TrainingJob(
                image=definitions.Image(base_image="pytorch/pytorch:2.7.1"),
                compute=definitions.Compute(cpu_count=1, memory="512Mi", accelerator="H100:2"),
                runtime=definitions.Runtime(start_commands=["python load.py"],{load}),
            ),
        )
        """, {"load.py": LOADER})  # fmt: skip
    reader = push(config, address=faults.dashboard_url, storage_root=storage_root)
    assert reader.wait(timeout=120) == JobState.COMPLETED, "\n".join(reader.logs()[-30:])
    assert "loaded rank-0/top-level/ckpt.pt at 24" in lines_of(reader, 0), reader.logs()[-30:]
    test_faults.assert_nothing_left(job, faults)

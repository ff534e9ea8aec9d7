"""A serving node's downloaded checkpoints: shared by the replicas that load them, removed by the
last one to stop (orchestrator/serving/staging.py). No Ray: replicas are threads and processes
holding copies as a replica's constructor and `__del__` do."""

from __future__ import annotations

import multiprocessing
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from orchestrator.errors import StagingError
from orchestrator.serving.served_model import BaseModelSource, ServedModel
from orchestrator.serving.staging import Holding, _once, release, stage


def hold(folder: Path, name: str = "checkpoint-30", job: str = "j1") -> tuple[Path, Holding]:
    """One replica's copy of `name`: downloaded by the first, shared by the others."""
    held: list[Holding] = []

    def fetch(tmp: Path) -> None:
        (tmp / "model.safetensors").write_bytes(b"w" * 1000)

    copy = _once(folder / job / "rank-0" / name / "v0", fetch, held, folder)
    return copy, held[0]


def test_the_last_replica_to_stop_removes_the_copy_and_the_directories_it_left_empty(tmp_path):
    folder = tmp_path / "training_checkpoints"
    first, held_first = hold(folder)
    second, held_second = hold(folder)
    _, other_job = hold(folder, job="j2")
    assert first == second and (first / "model.safetensors").exists()

    release([held_first])
    assert (first / "model.safetensors").read_bytes() == b"w" * 1000, "the second still uses it"
    release([held_second])
    assert not (folder / "j1").exists()  # the copy, its rank's and job's directories
    assert (folder / "j2" / "rank-0" / "checkpoint-30" / "v0").is_dir()  # another's: kept
    release([other_job])
    assert [p.name for p in folder.iterdir()] == [".staging.lock"]  # the folder itself stays


def test_a_replica_that_crashed_holds_nothing(tmp_path):
    """A replica killed without `__del__` leaves its marker: its process is gone, so the next
    holder to let go removes the copy all the same."""
    folder = tmp_path / "training_checkpoints"
    copy, crashed = hold(folder)
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no process has now
    crashed.marker.rename(crashed.marker.with_name(f"{gone.pid}-deadbeef@{socket.gethostname()}"))
    _, survivor = hold(folder)
    release([survivor])
    assert not copy.exists()


def test_a_crashed_replicas_copy_goes_when_the_next_replica_is_staged_on_the_node(tmp_path):
    """No replica of that copy left to let go of it: the next deployment staged on the node
    (any copy) sweeps it; copies live replicas hold stay, and so does a copy it cannot judge."""
    folder = tmp_path / "training_checkpoints"
    _, crashed = hold(folder, job="j1")
    crashed_base: list[Holding] = []
    base = _once(folder / "base-models" / "0f1e2d3c", lambda tmp: None, crashed_base, folder)
    live_copy, _live = hold(folder, job="j2")
    gone = subprocess.Popen(["true"])
    gone.wait()
    for marker in (crashed.marker, crashed_base[0].marker):
        marker.rename(marker.with_name(f"{gone.pid}-deadbeef@{socket.gethostname()}"))
    foreign = folder / "j3" / "rank-0" / "checkpoint-1" / "v0"  # not made here: no holders kept
    foreign.mkdir(parents=True)

    another = ServedModel(
        name="next",
        engine="transformers",
        storage_root=str(tmp_path / "root"),
        download_folder=str(folder),
        base=BaseModelSource(hf_repo="org/tiny"),
    )
    assert stage(another).model_dir == "org/tiny"  # loaded by the engine: nothing to download
    assert not (folder / "j1").exists() and not base.exists()
    assert (live_copy / "model.safetensors").exists()
    assert foreign.is_dir()


def test_a_replica_on_another_node_sharing_the_folder_keeps_the_copy(tmp_path):
    """A download_folder on a filesystem several nodes share: a process of another host cannot
    be asked whether it lives, so its hold counts."""
    folder = tmp_path / "training_checkpoints"
    copy, elsewhere = hold(folder)
    elsewhere.marker.rename(elsewhere.marker.with_name("4242-0badc0de@another-node"))
    _, here = hold(folder)
    release([here])
    assert (copy / "model.safetensors").exists()


def test_a_download_that_fails_leaves_nothing_once_let_go(tmp_path):
    folder = tmp_path / "training_checkpoints"
    held: list[Holding] = []

    def broken(tmp: Path) -> None:
        (tmp / "part").write_bytes(b"half")
        raise OSError("connection reset")

    with pytest.raises(StagingError, match="connection reset"):
        _once(folder / "j1" / "rank-0" / "checkpoint-30" / "v0", broken, held, folder)
    release(held)  # what `stage` does when a download fails
    assert not (folder / "j1").exists()


def test_replicas_taking_and_letting_go_at_once_never_lose_a_copy_they_hold(tmp_path):
    """8 replicas x 50 rounds, starting and stopping at once: a replica's copy is whole for as
    long as it holds it, and nothing is left when all have stopped."""
    folder = tmp_path / "training_checkpoints"
    errors: list[str] = []

    def replica() -> None:
        errors.extend(_replica_rounds(str(folder), 50))

    threads = [threading.Thread(target=replica) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == [] and not any(t.is_alive() for t in threads)
    assert not (folder / "j1").exists()


def _replica_rounds(folder: str, rounds: int) -> list[str]:
    """A replica (a thread, or a process of its own): hold, read, let go, `rounds` times."""
    errors = []
    for _ in range(rounds):
        copy, held = hold(Path(folder))
        try:
            if (copy / "model.safetensors").read_bytes() != b"w" * 1000:
                errors.append("a held copy was not whole")
        except OSError as e:
            errors.append(f"a held copy went away: {e}")
        release([held])
    return errors


def test_replica_processes_starting_and_stopping_at_once_share_the_copy_safely(tmp_path):
    """Replicas are processes: 4 of them x 30 rounds, their markers told apart by pid and the
    lock held across processes."""
    folder = tmp_path / "training_checkpoints"
    context = multiprocessing.get_context("spawn")
    with context.Pool(4) as pool:
        results = pool.starmap(_replica_rounds, [(str(folder), 30)] * 4)
    assert [e for errors in results for e in errors] == []
    assert not (folder / "j1").exists()

"""Syncing nodes' copies of a training cache with its durable copy, without Ray: what moves, what
wins, what is kept. (Through jobs: tests/test_training_cache.py and tests/test_multinode.py.)"""

from __future__ import annotations

import os
from pathlib import Path

from orchestrator.agents.training_cache_seeder import SHARED_CACHE_DIR_ENV, TrainingCacheSeeder
from orchestrator.storage.root import StorageRoot
from orchestrator.storage.training_cache import CacheStore, LocalCopy


def files(copy: LocalCopy) -> dict[str, str]:
    return {p: (copy.data / p).read_text() for p in copy.scan()}


def write(copy: LocalCopy, path: str, text: str) -> None:
    target = copy.data / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


def test_only_what_changed_moves(root, tmp_path):
    store = CacheStore(root, "team", "proj")
    a, b = LocalCopy(tmp_path / "node-a"), LocalCopy(tmp_path / "node-b")
    write(a, "pip/wheel.whl", "w1")
    write(a, "data/shard-0", "s0")
    assert store.write_back(a).as_dict() == {"files": 2, "bytes": 4, "deleted": 0}
    assert store.write_back(a).as_dict() == {"files": 0, "bytes": 0, "deleted": 0}

    assert store.seed(b).as_dict() == {"files": 2, "bytes": 4, "deleted": 0}
    assert files(b) == {"pip/wheel.whl": "w1", "data/shard-0": "s0"}
    assert store.seed(b).files == 0, "a current copy fetches nothing"

    write(a, "data/shard-0", "s0-v2")
    (a.data / "pip" / "wheel.whl").unlink()
    assert store.write_back(a).as_dict() == {"files": 1, "bytes": 5, "deleted": 1}
    assert store.seed(b).as_dict() == {"files": 1, "bytes": 5, "deleted": 1}
    assert files(b) == {"data/shard-0": "s0-v2"}


def test_last_write_back_wins_per_file_and_nothing_else_is_lost(tmp_path):
    root = StorageRoot(tmp_path / "root")
    store = CacheStore(root, None, "proj")
    a, b = LocalCopy(tmp_path / "a"), LocalCopy(tmp_path / "b")
    write(a, "shared.txt", "base")
    store.write_back(a)
    store.seed(b)
    write(a, "shared.txt", "from a")
    write(a, "only-a.txt", "a")
    write(b, "shared.txt", "from b")
    write(b, "only-b.txt", "b")
    store.write_back(a)
    store.write_back(b)  # finishes last
    fresh = LocalCopy(tmp_path / "fresh")
    store.seed(fresh)
    assert files(fresh) == {"shared.txt": "from b", "only-a.txt": "a", "only-b.txt": "b"}


def test_seeding_keeps_a_nodes_own_unsent_changes(tmp_path):
    root = StorageRoot(tmp_path / "root")
    store = CacheStore(root, None, "proj")
    a = LocalCopy(tmp_path / "a")
    write(a, "notes.txt", "v1")
    store.write_back(a)
    write(a, "notes.txt", "changed here, not yet written back")
    store.seed(a)
    assert files(a) == {"notes.txt": "changed here, not yet written back"}
    assert store.write_back(a).files == 1


def test_clear_empties_the_durable_copy_and_then_the_nodes(tmp_path):
    root = StorageRoot(tmp_path / "root")
    store = CacheStore(root, "t", "proj")
    a = LocalCopy(tmp_path / "a")
    write(a, "x.bin", "xx")
    store.write_back(a)
    assert len(store.clear().files) == 1
    assert store.manifest().files == {}
    assert store.seed(a).deleted == 1 and files(a) == {}


def test_teams_and_projects_are_separate_scopes(tmp_path):
    root = StorageRoot(tmp_path / "root")
    copy = LocalCopy(tmp_path / "red")
    write(copy, "red.txt", "red")
    CacheStore(root, "red", "proj").write_back(copy)
    for team, project in (("blue", "proj"), ("red", "other"), ("red", None), (None, "proj")):
        assert CacheStore(root, team, project).manifest().files == {}


def test_on_a_shared_filesystem_every_node_works_on_one_copy(tmp_path, monkeypatch):
    monkeypatch.setenv(SHARED_CACHE_DIR_ENV, str(tmp_path / "shared"))
    storage = str(tmp_path / "root")
    node_a, node_b = (
        TrainingCacheSeeder(),
        TrainingCacheSeeder(),
    )  # two nodes' seeders, one filesystem
    seeded_a = node_a.seed(storage, "t", "proj")
    seeded_b = node_b.seed(storage, "t", "proj")
    assert seeded_a.shared and seeded_a.project.path == seeded_b.project.path
    Path(seeded_a.project.path, "from-a.txt").write_text("a")
    assert os.listdir(seeded_b.project.path) == ["from-a.txt"]
    assert node_a.write_back(storage, "t", "proj").project.files == 1
    assert not StorageRoot(storage).exists("caches/t/projects/proj/nodes"), "no node preferred"


def test_a_running_jobs_change_survives_another_nodes_newer_write_back(tmp_path):
    """Node N changed x (not yet written back) when M wrote x back: seeding N keeps N's x, and
    N's later write-back, finishing last, wins."""
    root = StorageRoot(tmp_path / "root")
    store = CacheStore(root, None, "proj")
    n, m = LocalCopy(tmp_path / "n"), LocalCopy(tmp_path / "m")
    write(n, "x", "v1")
    store.write_back(n)
    store.seed(m)
    write(n, "x", "n's edit")
    write(m, "x", "m's edit")
    store.write_back(m)
    store.seed(n)
    assert files(n) == {"x": "n's edit"}
    store.write_back(n)
    fresh = LocalCopy(tmp_path / "fresh")
    store.seed(fresh)
    assert files(fresh) == {"x": "n's edit"}


def test_odd_names_travel_and_login_tokens_do_not(root, tmp_path):
    store = CacheStore(root, None, "proj")
    a = LocalCopy(tmp_path / "a")
    for name in ("a[1].txt", "a1.txt", "q?.txt", "star*.txt", "huggingface/hub/model.bin"):
        write(a, name, name)
    write(a, "huggingface/token", "hf_secret_login_token")
    write(a, "huggingface/stored_tokens", "[default]\nhf_token = hf_secret_login_token\n")
    store.write_back(a)
    (a.data / "a[1].txt").unlink()
    assert store.write_back(a).deleted == 1
    fresh = LocalCopy(tmp_path / "fresh")
    store.seed(fresh)
    assert sorted(files(fresh)) == ["a1.txt", "huggingface/hub/model.bin", "q?.txt", "star*.txt"]
    assert "huggingface/token" not in store.manifest().files


def test_seeding_skips_an_object_replaced_under_it(tmp_path):
    """A write-back finishing while a node seeds removes the version it read: no failure, the
    file is fetched at the next seeding."""
    root = StorageRoot(tmp_path / "root")
    store = CacheStore(root, None, "proj")
    a = LocalCopy(tmp_path / "a")
    write(a, "x", "v1")
    write(a, "y", "y1")
    store.write_back(a)
    version = store.manifest().files["x"].version
    root.fs.rm_file(root.path(f"{store.base}/objects/{version}"))
    fresh = LocalCopy(tmp_path / "fresh")
    assert store.seed(fresh).files == 1 and files(fresh) == {"y": "y1"}
    write(a, "x", "v2")
    store.write_back(a)
    assert store.seed(fresh).files == 1 and files(fresh) == {"x": "v2", "y": "y1"}


def test_holders_are_the_live_nodes_that_held_a_copy_newest_first(tmp_path):
    store = CacheStore(StorageRoot(tmp_path / "root"), "t", "proj")
    for node in ("gone", "old", "new"):
        store.mark_holder(node)
    assert store.holders({"old", "new"}) == ["new", "old"]
    assert not store.root.exists(f"{store.base}/nodes/gone.json"), "a dead node's marker goes"

"""The node cache's disk: whole sets or none, a byte budget, least recently used out."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from orchestrator.storage.weight_set_cache import WeightSetCache


def writer(files: dict[str, bytes]):
    def fill(dest: Path) -> None:
        for name, data in files.items():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(data)

    return fill


def test_a_put_set_is_found_again_and_read_only(tmp_path):
    cache = WeightSetCache(tmp_path / "c", budget_bytes=1000)
    put = cache.put("k1", 3, writer({"a/b.bin": b"abc"}), holder="job-1")
    assert (put.path / "a" / "b.bin").read_bytes() == b"abc"
    assert cache.get("k1", holder="job-2") == put.path
    assert cache.get("missing", holder="job-2") is None
    # Nobody may write (root ignores modes, so the modes themselves are checked).
    for path in (put.path, put.path / "a", put.path / "a" / "b.bin"):
        assert path.stat().st_mode & 0o222 == 0, path


def test_least_recently_used_sets_are_evicted_to_fit_the_budget(tmp_path):
    cache = WeightSetCache(tmp_path / "c", budget_bytes=250)
    cache.put("old", 100, writer({"f": b"x" * 100}), holder="j1")
    cache.put("mid", 100, writer({"f": b"x" * 100}), holder="j2")
    cache.release("j1")
    cache.release("j2")
    cache.get("old", holder="j3")  # used again: now "mid" is the least recently used
    cache.release("j3")
    put = cache.put("new", 100, writer({"f": b"x" * 100}), holder="j4")
    assert put.evicted == ["mid"] and not put.over_budget
    assert cache.get("mid", holder="j5") is None
    assert not (tmp_path / "c" / "mid").exists()
    assert cache.get("old", holder="j5") is not None
    assert cache.usage()["used_bytes"] == 200


def test_a_set_in_use_is_never_evicted_unless_its_holder_is_gone(tmp_path):
    cache = WeightSetCache(tmp_path / "c", budget_bytes=150)
    cache.put("busy", 100, writer({"f": b"x" * 100}), holder="running-job")
    put = cache.put("next", 100, writer({"f": b"x" * 100}), holder="other")
    assert put.evicted == [] and put.over_budget  # delivered anyway, over budget, said so
    assert cache.get("busy", holder="running-job") is not None
    cache.release("other")
    put = cache.put("third", 100, writer({"f": b"y" * 100}), holder="j", alive=lambda h: False)
    assert set(put.evicted) == {"busy", "next"}


def test_a_failed_fill_leaves_nothing_behind(tmp_path):
    cache = WeightSetCache(tmp_path / "c", budget_bytes=1000)

    def broken(dest: Path) -> None:
        dest.mkdir(parents=True)
        (dest / "half").write_bytes(b"x")
        raise OSError("source went away")

    with pytest.raises(OSError, match="source went away"):
        cache.put("k", 10, broken, holder="j")
    assert cache.get("k", holder="j") is None
    assert sorted(os.listdir(tmp_path / "c")) == [".lock", "index.json"]


def test_two_caches_sharing_a_directory_keep_one_copy(tmp_path):
    """Simulated nodes on one machine (or a restarted actor) share the directory safely."""
    a, b = WeightSetCache(tmp_path / "c", 1000), WeightSetCache(tmp_path / "c", 1000)
    barrier = threading.Barrier(2)

    def fill(dest: Path) -> None:
        barrier.wait(timeout=10)  # both fill at the same time
        writer({"f": b"same"})(dest)

    results = []
    threads = [
        threading.Thread(target=lambda c=c, h=h: results.append(c.put("k", 4, fill, holder=h)))
        for c, h in ((a, "j1"), (b, "j2"))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert len(results) == 2 and results[0].path == results[1].path
    assert (results[0].path / "f").read_bytes() == b"same"
    assert [p.name for p in (tmp_path / "c").iterdir() if p.name.endswith(".partial")] == []
    assert sorted(a.usage()["sets"]["k"]["holders"]) == ["j1", "j2"]


def test_fills_running_at_once_reserve_their_room(tmp_path):
    """While one set is being filled its bytes count: a second fill cannot count on them."""
    cache = WeightSetCache(tmp_path / "c", budget_bytes=100)
    started, finish = threading.Event(), threading.Event()

    def slow(dest: Path) -> None:
        started.set()
        assert finish.wait(timeout=10)
        writer({"f": b"x" * 60})(dest)

    first = threading.Thread(target=lambda: cache.put("a", 60, slow, holder="j1"))
    first.start()
    assert started.wait(timeout=10)
    assert cache.get("a", holder="j2") is None, "a set being filled is not there yet"
    put = cache.put("b", 60, writer({"f": b"y" * 60}), holder="j2")
    assert put.over_budget and put.evicted == []
    finish.set()
    first.join(timeout=10)
    assert cache.get("a", holder="j3") is not None
    assert cache.usage()["used_bytes"] == 120

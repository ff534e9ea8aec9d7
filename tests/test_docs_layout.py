"""docs/architecture.md's node-local layout, compared with the code that lays a node out: the
rank's directory with `RANK_DIR` (orchestrator/node/node_root.py) and with what a real prepare
and clear leave there, the directories above it with where the node's caches and registers put
themselves. No Ray: the agents' plain parts run in this process."""

from __future__ import annotations

import ast
import hashlib
import re
import tarfile
import tempfile
from pathlib import Path

import pytest

from orchestrator.agents.messages import PrepareRequest
from orchestrator.agents.node_preparer import NodePreparer
from orchestrator.agents.training_cache_seeder import copies_dir
from orchestrator.agents.weight_cache import WeightCache
from orchestrator.node import node_root as node_root_module
from orchestrator.node.image_cache import ImageCache
from orchestrator.node.mounts import place_link
from orchestrator.node.node_root import RANK_DIR, RankDirs, node_root
from orchestrator.spec.checkpoints import DEFAULT_DOWNLOAD_FOLDER
from orchestrator.storage.checkpoints import CheckpointStore
from orchestrator.storage.root import StorageRoot

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "orchestrator"
RANK_LINE = "<node root>/jobs/<job_id>/rank-<n>/"


def layout_block() -> str:
    text = (REPO / "docs" / "architecture.md").read_text()
    start = text.index("\n## Node-local layout\n")
    section = text[start : text.index("\n## ", start + 1)]
    block = section[section.index("```\n") + 4 :]
    return block[: block.index("```")]


def documented_rank_dir() -> list[str]:
    """The entries under the rank's directory: the first word of each line indented by two
    (a description's next lines are indented further)."""
    block = layout_block()
    below = block[block.index(RANK_LINE) + len(RANK_LINE) :]
    return [m.group(1) for m in re.finditer(r"^  (\S+)", below, re.M)]


def documented_top() -> list[str]:
    """The block's unindented entries, each up to the two spaces before its description: the
    directories the node's parts keep."""
    return [m.group(1) for m in re.finditer(r"^(\S.*?)(?: {2,}|$)", layout_block(), re.M)]


def pattern(entry: str) -> re.Pattern[str]:
    """A RANK_DIR name as a regex of a path relative to the rank's directory: `<...>` is one
    segment; a directory's entry also matches the directories leading to it and what is in it."""
    parts = [p for p in entry.split("/") if p]
    segments = [
        "".join("[^/]+" if p.startswith("<") else re.escape(p) for p in re.split(r"(<[^>]+>)", s))
        for s in parts
    ]
    body = segments[0] + "".join(f"(?:/{s}" for s in segments[1:]) + ")?" * (len(segments) - 1)
    return re.compile(body + ("(?:/.+)?" if entry.endswith("/") else ""))


def undeclared(paths: list[str]) -> list[str]:
    patterns = [pattern(name) for name, _ in RANK_DIR]
    return [p for p in paths if not any(pat.fullmatch(p) for pat in patterns)]


def test_architecture_md_lists_a_rank_directory_as_rank_dir_declares():
    declared = [name for name, _ in RANK_DIR]
    documented = documented_rank_dir()
    assert documented == declared, (
        "docs/architecture.md's node-local layout and orchestrator/node/node_root.py's RANK_DIR "
        f"differ: not in the docs: {[p for p in declared if p not in documented]}; "
        f"not in RANK_DIR: {[p for p in documented if p not in declared]}"
        + ("; the same entries in another order" if sorted(documented) == sorted(declared) else "")
    )


def test_the_directories_above_it_are_where_the_node_s_parts_put_them(tmp_path, monkeypatch):
    home, root = tmp_path / "home", tmp_path / "node-root"
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(home))
    monkeypatch.setenv("ORCHESTRATOR_NODE_ROOT", str(root))
    for variable in ("NODE", "TRAINING", "SHARED", "CLUSTER"):  # each cache's own directory
        monkeypatch.delenv(f"ORCHESTRATOR_{variable}_CACHE_DIR", raising=False)
    (tmp_path / "target").mkdir()
    place_link(tmp_path / "link", str(tmp_path / "target"), "mount_location", ("a", "j"),
               lambda _: True)  # fmt: skip
    (register,) = [p for p in root.iterdir()]  # the link register, made by placing a link
    placed = [
        WeightCache().node.directory, ImageCache().directory, copies_dir(), register,
        RankDirs.of("J0B", 7).base,
    ]  # fmt: skip

    def as_documented(path: Path) -> str:
        text = str(path).replace(str(home), "$ORCHESTRATOR_HOME").replace(str(root), "<node root>")
        return text.replace("/J0B/", "/<job_id>/").replace("rank-7", "rank-<n>") + "/"

    assert sorted(map(as_documented, placed)) == sorted(documented_top())


def test_the_node_root_defaults_to_the_temp_dir_as_documented(monkeypatch):
    monkeypatch.delenv("ORCHESTRATOR_NODE_ROOT", raising=False)
    assert node_root() == Path(tempfile.gettempdir()) / "orchestrator"
    text = (REPO / "docs" / "architecture.md").read_text()
    assert "The default is `<tempdir>/orchestrator`" in text


def test_rank_dirs_names_only_declared_paths():
    dirs = RankDirs(Path("/r"))
    named = {
        name: getattr(dirs, name)
        for name, member in vars(RankDirs).items()
        if isinstance(member, property)
    }
    named["set_aside"] = dirs.set_aside(3)
    relative = {name: path.relative_to(dirs.base).as_posix() for name, path in named.items()}
    assert len(relative) >= 10, relative
    assert not undeclared(list(relative.values())), undeclared(list(relative.values()))
    with pytest.raises(ValueError, match=r"not in node_root\.RANK_DIR"):
        node_root_module._declared("logs")


def joined_literals() -> list[tuple[str, str]]:
    """`<x>.base / "name"` and `<x>.job_dir / "name"` wherever node_root's paths are used: a
    name written into a rank's directory by hand, not through RankDirs."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        source = path.read_text()
        if "node_root import" not in source:
            continue
        for node in ast.walk(ast.parse(source)):
            if (
                isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)
                and isinstance(node.left, ast.Attribute) and node.left.attr in ("base", "job_dir")
                and isinstance(node.right, ast.Constant) and isinstance(node.right.value, str)
            ):  # fmt: skip
                found.append((str(path.relative_to(REPO)), node.right.value))
    return found


def test_what_the_package_joins_onto_a_rank_directory_is_declared():
    stray = [(where, name) for where, name in joined_literals() if undeclared([name])]
    assert not stray, f"written into a rank's directory but not in node_root.RANK_DIR: {stray}"


class WatchedRoot(StorageRoot):
    """A local root that notes what the rank's directory holds when each download lands."""

    def __init__(self, url: str, rank_dir: Path) -> None:
        super().__init__(url)
        self.rank_dir, self.seen = rank_dir, set[str]()

    def get_file(self, rel: str, local: Path) -> None:
        super().get_file(rel, local)
        self.seen |= set(listing(self.rank_dir))


def listing(directory: Path) -> list[str]:
    """Every path under `directory`, relative."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*"))


def stored_job(tmp_path: Path, rank_dir: Path) -> tuple[WatchedRoot, PrepareRequest]:
    """A code archive and a checkpoint to load in a local storage root; the prepare request."""
    root = WatchedRoot(str(tmp_path / "storage"), rank_dir)
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text("print('hi')\n")
    tar = tmp_path / "code.tar"
    with tarfile.open(tar, "w") as archive:
        archive.add(code / "train.py", "train.py")
    sha = hashlib.sha256(tar.read_bytes()).hexdigest()
    root.put_file(tar, f"archives/{sha}.tar")
    checkpoint = tmp_path / "checkpoint-1"
    checkpoint.mkdir()
    (checkpoint / "model.bin").write_bytes(b"weights")
    manifest = CheckpointStore(root).upload(checkpoint, "p1", "jearlier", 0)
    request = PrepareRequest(f"archives/{sha}.tar", sha, load=(manifest,),
                             download_folder=DEFAULT_DOWNLOAD_FOLDER)  # fmt: skip
    return root, request


def test_a_prepare_leaves_only_declared_paths_and_a_clear_removes_what_the_docs_say(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("ORCHESTRATOR_NODE_ROOT", str(tmp_path / "node-root"))
    dirs = RankDirs.of("jlayout01", 0)
    root, request = stored_job(tmp_path, dirs.base)
    preparer = NodePreparer(root, dirs, None, ("orchestrator-jlayout01-rank-0", "jlayout01"))
    preparer.prepare(request)

    during = sorted(root.seen)  # the archive's download, then the checkpoint's
    after = listing(dirs.base)
    assert "workspace.tar" in during and "workspace.tar" not in after
    loaded = "loaded_checkpoints/rank-0/checkpoint-1"  # rank-<r>/<name>/, as the docs say
    assert after == [
        "checkpoints", "checkpoints-before.json", "loaded_checkpoints",
        "loaded_checkpoints/rank-0", loaded, f"{loaded}/model.bin",
        "scratch", "workspace", "workspace/train.py",
    ], after  # fmt: skip
    assert not undeclared(during + after), undeclared(during + after)

    (dirs.checkpoints / "checkpoint-9").mkdir()  # one the final flush did not store
    preparer.clear(keep_checkpoints=True)
    assert listing(dirs.base) == ["checkpoints", "checkpoints/checkpoint-9"]
    preparer.clear(keep_checkpoints=False)
    assert not dirs.base.parent.exists()  # rank-0/ and jobs/<job_id>/, both empty then


def test_a_clear_keeps_what_the_docs_say_is_not_deleted(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHESTRATOR_NODE_ROOT", str(tmp_path / "node-root"))
    dirs = RankDirs.of("jlayout02", 0)
    root, request = stored_job(tmp_path, dirs.base)
    preparer = NodePreparer(root, dirs, None, ("orchestrator-jlayout02-rank-0", "jlayout02"))
    preparer.prepare(request)
    (dirs.set_aside(1) / "checkpoint-3").mkdir(parents=True)  # what a retry moved aside
    dirs.failed.write_text("0 1\n")  # what a container's failed command leaves
    dirs.oom.touch()
    preparer.clear(keep_checkpoints=False)
    assert listing(dirs.base) == [
        "set-aside",
        "set-aside/attempt-1",
        "set-aside/attempt-1/checkpoint-3",
    ]

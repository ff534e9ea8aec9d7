"""Packaging a job's code directory: which files go in, and what the nodes get out."""

from __future__ import annotations

import hashlib
import os
import tarfile
from pathlib import Path

import pytest

from orchestrator.client.workspace import (
    MAX_ARCHIVE_BYTES_ENV,
    WorkspacePlan,
    plan_workspace,
    write_archive,
)
from orchestrator.errors import ConfigError, WorkspaceError
from orchestrator.spec.workspace import Workspace


def write(path: Path, text: str = "x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def arcnames(plan: WorkspacePlan) -> set[str]:
    return {f.arcname for f in plan.files}


def extract(plan: WorkspacePlan, tmp_path: Path) -> Path:
    archive = write_archive(plan, tmp_path / "out" / "workspace.tar")
    dest = tmp_path / "extracted"
    with tarfile.open(archive.path) as tar:
        tar.extractall(dest, filter="data")
    return dest


def test_defaults_leave_out_vcs_caches_virtualenvs_logs_and_dotenv(tmp_path: Path) -> None:
    for name in [
        "config.py", "train.py", "pkg/model.py", ".env.example", "run.sh",
        ".git/HEAD", "__pycache__/train.cpython-311.pyc", "pkg/__pycache__/model.pyc",
        "pkg/stale.pyc", ".venv/bin/python", "myenv/lib/site.py", "train.log", "logs/a.log",
        ".env", "pkg/.env", "node_modules/x/index.js", "wandb/run/files.txt",
        "mypkg.egg-info/PKG-INFO", ".pytest_cache/v", ".ipynb_checkpoints/nb.ipynb",
    ]:  # fmt: skip
        write(tmp_path / name)
    write(tmp_path / "myenv" / "pyvenv.cfg", "home = /usr/bin\n")

    plan = plan_workspace(tmp_path)

    assert arcnames(plan) == {"config.py", "train.py", "pkg/model.py", ".env.example", "run.sh"}
    assert plan.root == tmp_path.resolve()
    assert plan.config_relpath == "."
    assert any("myenv/" in note and "virtualenv" in note for note in plan.skipped)


def test_ignored_directories_are_not_walked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path / "train.py")
    write(tmp_path / ".venv" / "lib" / "site-packages" / "torch" / "x.py")
    write(tmp_path / "env2" / "pyvenv.cfg")
    write(tmp_path / "env2" / "lib" / "y.py")
    scanned: list[str] = []
    real_scandir = os.scandir

    def recording_scandir(path: str | Path) -> object:
        scanned.append(str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", recording_scandir)
    plan = plan_workspace(tmp_path)

    assert arcnames(plan) == {"train.py"}
    assert not [p for p in scanned if ".venv" in p or "env2/lib" in p]


def test_truss_ignore_replaces_the_defaults(tmp_path: Path) -> None:
    write(tmp_path / ".truss_ignore", "data/\n*.ckpt\n*.log\n!keep.log\n")
    for name in [
        "train.py", ".git/HEAD", "__pycache__/m.pyc", "data/shard0.bin", "sub/data/x.bin",
        "model.ckpt", "sub/old.ckpt", "debug.log", "keep.log", "data.txt",
    ]:  # fmt: skip
        write(tmp_path / name)

    plan = plan_workspace(tmp_path)

    assert arcnames(plan) == {
        ".truss_ignore", "train.py", ".git/HEAD", "__pycache__/m.pyc", "keep.log", "data.txt",
    }  # fmt: skip


def test_extraction_reproduces_the_tree_with_modes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    contents = {"config.py": "cfg", "run.sh": "#!/bin/sh\necho hi\n", "pkg/deep/m.py": "m = 1"}
    for name, text in contents.items():
        write(src / name, text)
    (src / "run.sh").chmod(0o755)
    (src / "config.py").chmod(0o644)

    dest = extract(plan_workspace(src), tmp_path)

    got = {p.relative_to(dest).as_posix(): p.read_text() for p in dest.rglob("*") if p.is_file()}
    assert got == contents
    assert os.access(dest / "run.sh", os.X_OK)
    assert not os.access(dest / "config.py", os.X_OK)


def test_symlinks_inside_stay_links_outside_files_are_copied_broken_are_noted(
    tmp_path: Path,
) -> None:
    src, outside = tmp_path / "src", tmp_path / "outside"
    write(src / "pkg" / "real.py", "real")
    write(src / ".env", "SECRET=1")
    write(outside / "shared.py", "shared")
    (src / "alias.py").symlink_to("pkg/real.py")
    (src / "pkg_link").symlink_to("pkg", target_is_directory=True)
    (src / "shared.py").symlink_to(outside / "shared.py")
    (src / "data").symlink_to(outside, target_is_directory=True)
    (src / "dangling.py").symlink_to(src / "missing.py")
    (src / "secrets").symlink_to(".env")

    plan = plan_workspace(src)

    links = {f.arcname: f.link_target for f in plan.files if f.link_target}
    assert links == {"alias.py": "pkg/real.py", "pkg_link": "pkg"}
    assert arcnames(plan) == {"pkg/real.py", "alias.py", "pkg_link", "shared.py"}
    notes = "\n".join(plan.skipped)
    assert "dangling.py: broken symlink" in notes
    assert "data:" in notes and "external_dirs" in notes
    assert "secrets:" in notes  # a link must not smuggle in a file the rules leave out

    dest = extract(plan, tmp_path)
    assert (dest / "alias.py").is_symlink() and (dest / "alias.py").read_text() == "real"
    assert (dest / "pkg_link" / "real.py").read_text() == "real"
    assert not (dest / "shared.py").is_symlink()
    assert (dest / "shared.py").read_text() == "shared"


def test_symlink_loop_is_skipped_not_followed(tmp_path: Path) -> None:
    write(tmp_path / "train.py")
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    (tmp_path / "self").symlink_to(".", target_is_directory=True)

    plan = plan_workspace(tmp_path)

    assert arcnames(plan) == {"train.py", "self"}
    assert any(note.startswith("a: broken symlink") for note in plan.skipped)


def test_workspace_root_includes_siblings_of_a_nested_config_dir(tmp_path: Path) -> None:
    write(tmp_path / "shared" / "lib.py")
    config_dir = tmp_path / "jobs" / "train"
    write(config_dir / "config.py")

    plan = plan_workspace(config_dir, Workspace(workspace_root="../.."))

    assert plan.root == tmp_path.resolve()
    assert plan.config_relpath == "jobs/train"
    assert arcnames(plan) == {"shared/lib.py", "jobs/train/config.py"}


def test_config_dir_outside_workspace_root_is_an_error(tmp_path: Path) -> None:
    config_dir = tmp_path / "jobs"
    write(config_dir / "config.py")
    (tmp_path / "other").mkdir()

    with pytest.raises(WorkspaceError) as err:
        plan_workspace(config_dir, Workspace(workspace_root="../other"))

    assert str(config_dir.resolve()) in str(err.value)
    assert str((tmp_path / "other").resolve()) in str(err.value)


def test_exclude_dirs_drops_a_top_level_directory_only(tmp_path: Path) -> None:
    config_dir = tmp_path / "jobs"
    write(config_dir / "config.py")
    write(tmp_path / "data" / "big.bin")
    write(tmp_path / "src" / "data" / "schema.py")

    workspace = Workspace(workspace_root="..", exclude_dirs=["../data", "../nope"])
    plan = plan_workspace(config_dir, workspace)

    assert arcnames(plan) == {"jobs/config.py", "src/data/schema.py"}
    assert any("nope" in note and "does not exist" in note for note in plan.skipped)


def test_exclude_dirs_deeper_than_top_level_is_an_error(tmp_path: Path) -> None:
    write(tmp_path / "src" / "data" / "schema.py")

    with pytest.raises(WorkspaceError, match="direct child"):
        plan_workspace(tmp_path, Workspace(exclude_dirs=["src/data"]))


def test_external_dirs_are_added_by_basename_under_their_own_rules(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write(src / "config.py")
    common = tmp_path / "libs" / "common"
    write(common / "util.py")
    write(common / "__pycache__" / "util.pyc")
    other = tmp_path / "vendor"
    write(other / ".truss_ignore", "*.bin\n")
    write(other / "weights.bin")
    write(other / ".git" / "HEAD")

    workspace = Workspace(external_dirs=["../libs/common", str(other)])
    plan = plan_workspace(src, workspace)

    assert arcnames(plan) == {
        "config.py", "common/util.py", "vendor/.truss_ignore", "vendor/.git/HEAD",
    }  # fmt: skip
    dest = extract(plan, tmp_path)
    assert (dest / "common" / "util.py").is_file()


def test_external_dir_name_collisions_are_errors(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write(src / "common" / "mine.py")
    write(tmp_path / "a" / "common" / "x.py")
    write(tmp_path / "b" / "lib" / "y.py")
    write(tmp_path / "c" / "lib" / "z.py")

    with pytest.raises(WorkspaceError, match="common"):
        plan_workspace(src, Workspace(external_dirs=["../a/common"]))
    with pytest.raises(WorkspaceError, match="lib"):
        plan_workspace(src, Workspace(external_dirs=["../b/lib", "../c/lib"]))
    # Excluding the workspace's own `common/` makes room for the external one.
    plan = plan_workspace(src, Workspace(external_dirs=["../a/common"], exclude_dirs=["common"]))
    assert arcnames(plan) == {"common/x.py"}


def test_missing_or_non_directory_external_dirs_are_errors(tmp_path: Path) -> None:
    write(tmp_path / "src" / "config.py")
    write(tmp_path / "file.txt")

    for entry in ["../missing", "../file.txt"]:
        with pytest.raises(WorkspaceError, match="not a directory"):
            plan_workspace(tmp_path / "src", Workspace(external_dirs=[entry]))


def test_external_dir_inside_the_workspace_is_noted_not_duplicated(tmp_path: Path) -> None:
    write(tmp_path / "config.py")
    write(tmp_path / "pkg" / "m.py")

    plan = plan_workspace(tmp_path, Workspace(external_dirs=["pkg"]))

    assert [f.arcname for f in plan.files] == ["config.py", "pkg/m.py"]
    assert any("inside the workspace" in note for note in plan.skipped)


def test_over_the_size_cap_names_the_largest_entries_and_the_remedy(tmp_path: Path) -> None:
    write(tmp_path / "train.py", "x" * 10)
    write(tmp_path / "data" / "a.bin", "x" * 3000)
    write(tmp_path / "data" / "b.bin", "x" * 3000)
    write(tmp_path / "model.pt", "x" * 2000)

    with pytest.raises(WorkspaceError) as err:
        plan_workspace(tmp_path, max_bytes=4096)

    message = str(err.value)
    assert "7.8 KiB" in message and "4.0 KiB" in message
    assert err.value.problems[:3] == ["data/ 5.9 KiB", "model.pt 2.0 KiB", "train.py 10 B"]
    remedy = err.value.problems[-1]
    assert ".truss_ignore" in remedy and "exclude_dirs" in remedy and "s3://" in remedy


def test_size_cap_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path / "train.py", "x" * 2000)

    monkeypatch.setenv(MAX_ARCHIVE_BYTES_ENV, "1000")
    with pytest.raises(WorkspaceError, match="over the"):
        plan_workspace(tmp_path)
    assert plan_workspace(tmp_path, max_bytes=5000).file_count == 1
    monkeypatch.setenv(MAX_ARCHIVE_BYTES_ENV, "1G")
    with pytest.raises(ConfigError, match=f"{MAX_ARCHIVE_BYTES_ENV} is not a whole number"):
        plan_workspace(tmp_path)


def test_workspace_above_rays_100_mib_limit_archives(tmp_path: Path) -> None:
    size = 150 * 1024**2
    write(tmp_path / "train.py")
    with open(tmp_path / "tokenizer.bin", "wb") as f:
        f.truncate(size)  # sparse: cheap to create

    plan = plan_workspace(tmp_path)
    info = write_archive(plan, tmp_path / "out.tar")

    assert plan.total_bytes > size and info.size_bytes > size
    with tarfile.open(info.path) as tar:
        assert tar.getmember("tokenizer.bin").size == size


def test_archive_is_reproducible_and_its_hash_is_the_files(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for i in range(20):
        write(src / f"pkg{i % 3}" / f"m{i}.py", f"v = {i}")

    plan = plan_workspace(src)
    first = write_archive(plan, tmp_path / "a.tar")
    second = write_archive(plan_workspace(src), tmp_path / "b.tar")

    assert first.sha256 == second.sha256
    assert first.sha256 == hashlib.sha256(first.path.read_bytes()).hexdigest()
    assert first.size_bytes == first.path.stat().st_size and first.file_count == 20
    with tarfile.open(first.path) as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == sorted(arcnames(plan))
    assert {(m.uid, m.gid, m.uname, m.gname) for m in members} == {(0, 0, "", "")}


def test_failed_write_leaves_no_archive_behind(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write(src / "a.py")
    write(src / "b.py")
    plan = plan_workspace(src)
    (src / "b.py").unlink()
    out = tmp_path / "out"

    with pytest.raises(WorkspaceError, match=r"b\.py"):
        write_archive(plan, out / "workspace.tar")

    assert list(out.iterdir()) == []

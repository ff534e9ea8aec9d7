"""Names at the longest a config allows (256 characters), or with '/', Korean and '[/x]' in
them, never crash a verb: an unknown one is said to be unknown, a registered one works. A name is
never made a path segment (a file name holds at most 255 bytes), nor read as rich markup.

The verbs run in this process, through the same `main` as the `orchestrator` command, on a
local storage root: none of them needs a cluster to say a name is unknown.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from orchestrator import definitions as d
from orchestrator.cli.app import main
from orchestrator.spec.base import MAX_NAME_LENGTH, check_display_name
from orchestrator.storage import layout
from orchestrator.storage.job_store import JobNotFound, JobStore
from orchestrator.storage.projects import ProjectStore
from orchestrator.storage.records import ArchiveRef, JobRecord, JobStatus
from orchestrator.storage.root import StorageRoot
from orchestrator.storage.training_cache import CacheStore

LONG = "x" * MAX_NAME_LENGTH
ODD = ("demo/qwen3 [/x] 검색 · " * 20)[:MAX_NAME_LENGTH]
NAMES = {"long": LONG, "odd": ODD}


def test_the_names_are_names_a_config_may_hold() -> None:
    for name in NAMES.values():
        assert len(name) == MAX_NAME_LENGTH and check_display_name(name) == name
    assert len(ODD.encode()) > 255, "longer than a file name may be, in bytes too"


def add_job(root: StorageRoot, project: str, job_id: str) -> str:
    """A registered project with one job (CREATED) and an empty cache; its id."""
    project_id = ProjectStore(root).ensure(project).id
    spec = d.TrainingProject(name=project, job=d.TrainingJob(image=d.Image(base_image="x")))
    archive = ArchiveRef(path="archives/x.tar", sha256="x", size_bytes=1, file_count=1,
                         config_dir=".")  # fmt: skip
    record = JobRecord(job_id=job_id, project=project, project_id=project_id,
                       created_at=time.time(), spec=spec, archive=archive,
                       storage_root=root.url)  # fmt: skip
    JobStore(root).create(record, JobStatus.new(job_id))
    CacheStore(root, None, project_id).root.write_json(
        f"caches/_default/projects/{project_id}/manifest.json", {"files": {}}
    )
    return project_id


@pytest.fixture
def storage_root(tmp_path: Path) -> str:
    """A root where projects/, jobs/ and caches/ exist: a path under any of them with a segment
    over 255 bytes fails with 'File name too long' (under a missing directory, with not found)."""
    root = StorageRoot(tmp_path / "storage")
    add_job(root, "demo", "jdemo00000")
    return root.url


def run_verb(args: list[str], capsys: pytest.CaptureFixture[str], monkeypatch) -> tuple[int, str]:
    """`orchestrator ARGS` in this process: its exit code and output (stdout and stderr), with
    the whitespace taken out, as rich wraps long lines where it likes. A traceback raises."""
    monkeypatch.setattr(sys, "argv", ["orchestrator", *args])
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    else:
        code = 0
    out = capsys.readouterr()
    return code, "".join((out.out + out.err).split())


# (arguments, the message that must end it, its exit code); N is the name.
UNKNOWN = [
    (["view", "--project", "N"], "no jobs in project {N!r} yet", 0),
    (["view", "--job-id", "N"], "no job {N!r} in", 1),
    (["logs", "--project", "N"], "no jobs yet in project {N!r}", 1),
    (["logs", "--job-id", "N"], "no job {N!r} in", 1),
    (["stop", "--project", "N"], "no jobs yet in project {N!r}", 1),
    (["stop", "--job-id", "N"], "no job {N!r} in", 1),
    (["metrics", "--once", "--project", "N"], "no jobs yet in project {N!r}", 1),
    (["metrics", "--once", "--job-id", "N"], "no job {N!r} in", 1),
    (["update", "--job-id", "N", "--priority", "1"], "no job {N!r} in", 1),
    (["recreate", "--project", "N"], "no jobs yet in project {N!r}", 1),
    (["recreate", "--job-id", "N"], "no job {N!r} in", 1),
    (["isession", "--job-id", "N"], "no job {N!r} in", 1),
    (["shell", "--job-id", "N"], "no job {N!r} in", 1),
    (["deploy_checkpoints", "--job-id", "N", "--dry-run", "--non-interactive"],
     "no job {N!r} in", 1),
    (["download", "--project", "N"], "no jobs yet in project {N!r}", 1),
    (["download", "--job-id", "N"], "no job {N!r} in", 1),
    (["cache", "summarize", "N"], "no project named {N!r} in", 1),
    (["cache", "delete", "N", "--yes"], "no project named {N!r} in", 1),
    (["cache", "summarize", "demo", "--team", "N"], "no team named {N!r} in", 1),
    (["checkpoints", "list", "--project", "N"], "no checkpoints in project {N!r}", 0),
    (["checkpoints", "list", "--job-id", "N"], "no job {N!r} in", 1),
    (["checkpoints", "download", "--project", "N"], "no jobs yet in project {N!r}", 1),
    (["checkpoints", "download", "--job-id", "N"], "no job {N!r} in", 1),
]  # fmt: skip


@pytest.mark.parametrize("kind", NAMES)
@pytest.mark.parametrize(
    ("args", "said", "code"), UNKNOWN, ids=[" ".join(a) for a, _, _ in UNKNOWN]
)
def test_an_unknown_name_at_the_longest_is_said_to_be_unknown(
    args, said, code, kind, storage_root, tmp_path, capsys, monkeypatch
) -> None:
    name = NAMES[kind]
    monkeypatch.chdir(tmp_path)  # `download` writes here if it ever gets that far
    argv = [name if a == "N" else a for a in args] + ["--storage-root", storage_root]
    exit_code, out = run_verb(argv, capsys, monkeypatch)
    assert "".join(said.format(N=name).split()) in out, out
    assert exit_code == code


WORKS = [
    (["view"], "jodd000000"),
    (["view", "--project", "N"], "jodd000000"),
    (["view", "--job-id", "jodd000000"], "demo/qwen3 [/x] 검색"),
    (["logs", "--project", "N"], "jodd000000"),
    (["metrics", "--once", "--project", "N"], "demo/qwen3 [/x] 검색"),
    (["checkpoints", "list", "--project", "N"], "no checkpoints in project {N!r}"),
    (["cache", "summarize", "N"], "the training cache of project {N!r} is empty"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "shown"), WORKS, ids=[" ".join(a) for a, _ in WORKS])
def test_a_project_named_so_works(args, shown, storage_root, capsys, monkeypatch) -> None:
    """Shown as written ('[/x]' is no markup to end); a table may cut the name short."""
    add_job(StorageRoot(storage_root), ODD, "jodd000000")
    argv = [ODD if a == "N" else a for a in args] + ["--storage-root", storage_root]
    exit_code, out = run_verb(argv, capsys, monkeypatch)
    assert exit_code == 0, out
    assert "".join(shown.format(N=ODD).split()) in out, out


def test_stores_never_make_a_path_of_a_name(tmp_path: Path) -> None:
    root = StorageRoot(tmp_path / "storage")
    add_job(root, "demo", "jdemo00000")
    projects = ProjectStore(root)
    for name in NAMES.values():
        assert not layout.is_segment(name)
        assert projects.get(name) is None and projects.resolve(name) is None
        with pytest.raises(JobNotFound, match="no job"):
            JobStore(root).record(name)
        with pytest.raises(JobNotFound, match="no job"):
            JobStore(root).status(name)
    # A name from before ids becomes its project's id only if it could have been a path.
    assert projects.ensure("old-proj", legacy=True).id == "old-proj"
    registered = projects.ensure(LONG, legacy=True)
    assert registered.id != LONG and layout.is_segment(registered.id)
    assert projects.resolve(LONG) == registered

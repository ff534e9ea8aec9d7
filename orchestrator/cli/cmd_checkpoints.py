"""`orchestrator checkpoints list|download|urls`: uploaded checkpoints, off the storage root."""

from __future__ import annotations

import csv
import enum
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from orchestrator.cli.jobs_common import pick_job
from orchestrator.cli.options import JobId, SortOrder, StorageRootOption
from orchestrator.cli.render import OutputFormat, console, human_bytes, print_json, when
from orchestrator.client.api import latest_job, list_jobs
from orchestrator.client.jobs import JobHandle
from orchestrator.errors import OrchestratorError
from orchestrator.storage.checkpoints import Manifest

checkpoints_app = typer.Typer(
    help="List and download the checkpoints jobs uploaded.", no_args_is_help=True
)
# Notices and progress go to stderr where stdout must stay machine-readable (JSON, a path).
_stderr = Console(stderr=True, highlight=False)


LatestOf = Annotated[
    str | None, typer.Option("--project", help="Without --job-id: this project's most recent job")
]
CheckpointName = Annotated[
    str | None, typer.Option("--name", help="Checkpoint name; default: the newest")
]
Rank = Annotated[
    int | None,
    typer.Option("--rank", help="Node rank; default: 0 if it has the checkpoint, else the lowest"),
]


class ListFormat(str, enum.Enum):
    text = "text"
    json = "json"
    csv = "csv"


class SortKey(str, enum.Enum):
    created = "created"
    size = "size"
    name = "name"


@checkpoints_app.command("list")
def list_checkpoints(
    job_id: JobId = None,
    project: Annotated[
        str | None,
        typer.Option("--project", help="Without --job-id: every checkpoint of this project's jobs"),
    ] = None,
    storage_root: StorageRootOption = None,
    sort: Annotated[SortKey, typer.Option("--sort")] = SortKey.created,
    order: Annotated[SortOrder, typer.Option("--order")] = SortOrder.asc,
    output: Annotated[ListFormat, typer.Option("-o", "--output")] = ListFormat.text,
) -> None:
    """List one job's checkpoints (default: the most recent job's) or a whole project's."""
    if project and not job_id:
        jobs = list_jobs(project, storage_root=storage_root)
        found = sorted(
            (m for j in jobs for m in j.checkpoints()), key=lambda m: (m.created_at, m.node_rank)
        )
        scope = f"project {project!r}"
    else:
        job = _pick_job(job_id, project, storage_root, notice_on_stderr=output != ListFormat.text)
        found = job.checkpoints()
        scope = f"job {job.id}"
    found = _sorted(found, sort, order)
    if output is ListFormat.json:
        print_json([_row(m) for m in found])
        return
    if output is ListFormat.csv:
        writer = csv.DictWriter(sys.stdout, fieldnames=_ROW_FIELDS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(_row(m) for m in found)
        return
    if not found:
        console.print(f"no checkpoints in {scope}", markup=False)
        return
    table = Table(title=f"checkpoints of {escape(scope)}")
    # never cut short or wrapped: they are what one copies into `download`
    table.add_column("checkpoint", no_wrap=True, min_width=max(len(m.name) for m in found))
    table.add_column("job id", no_wrap=True, min_width=max(len(m.job_id) for m in found))
    for column in ("rank", "type", "size", "files", "created"):
        table.add_column(
            column,
            justify="right" if column in ("rank", "size", "files") else "left",
            no_wrap=column == "type",  # "full, INCOMPLETE" must stay readable
        )
    for m in found:
        table.add_row(m.name, m.job_id, str(m.node_rank), _type(m), human_bytes(m.size_bytes),
                      str(len(m.files)), when(m.created_at))  # fmt: skip
    console.print(table)


@checkpoints_app.command("download")
def download(
    job_id: JobId = None,
    project: LatestOf = None,
    name: CheckpointName = None,
    rank: Rank = None,
    target_directory: Annotated[
        Path | None,
        typer.Option("--target-directory", help="Default: ./<job_id>-checkpoints"),
    ] = None,
    storage_root: StorageRootOption = None,
) -> None:
    """Download one checkpoint into TARGET_DIRECTORY/<name>/ and print where it went."""
    job = _pick_job(job_id, project, storage_root, notice_on_stderr=True)
    manifest = job.checkpoint(name, rank)
    if not manifest.complete:
        warning = f"warning: {manifest.key} is incomplete: {manifest.incomplete_reason}"
        _stderr.print(warning, style="yellow", markup=False)
    dest = (target_directory or Path(f"{job.id}-checkpoints")) / manifest.name
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise OrchestratorError(
            f"{dest} already exists and is not empty: remove it or pick another --target-directory"
        )
    created = _first_missing(dest)
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
               TransferSpeedColumn(), TimeRemainingColumn())  # fmt: skip
    try:
        with Progress(*columns, console=_stderr) as progress:
            task = progress.add_task(
                f"{manifest.name} (rank {manifest.node_rank})", total=manifest.size_bytes
            )
            job.download_checkpoint(manifest, dest, progress=lambda n: progress.advance(task, n))
    except (OSError, KeyboardInterrupt) as e:
        shutil.rmtree(created or dest, ignore_errors=True)
        if created is None:
            dest.mkdir()  # it was there, empty, before
        if isinstance(e, KeyboardInterrupt):
            raise
        raise OrchestratorError(f"download of {manifest.key} failed, nothing kept: {e}") from e
    print(dest.resolve())


@checkpoints_app.command("urls")
def urls(
    job_id: JobId = None,
    project: LatestOf = None,
    name: CheckpointName = None,
    rank: Rank = None,
    expires: Annotated[
        int, typer.Option("--expires", min=1, help="Seconds the URLs stay valid")
    ] = 3600,
    storage_root: StorageRootOption = None,
    output: Annotated[OutputFormat, typer.Option("-o", "--output")] = OutputFormat.text,
) -> None:
    """Time-limited URLs for one checkpoint's files (a storage root on S3 or GCS)."""
    job = _pick_job(job_id, project, storage_root, notice_on_stderr=True)
    manifest = job.checkpoint(name, rank)
    signed = job.checkpoint_urls(manifest.name, manifest.node_rank, expires)
    expires_at = time.time() + expires
    rows = [
        {"path": f.path, "size_bytes": f.size, "sha256": f.sha256, "url": url,
         "expires_at": expires_at}
        for f, url in signed
    ]  # fmt: skip
    if output is OutputFormat.json:
        print_json({"checkpoint": _row(manifest), "files": rows})
        return
    _stderr.print(f"{manifest.key}: {len(rows)} file(s), URLs valid until {when(expires_at)}")
    for row in rows:  # one per line, whole: what one pastes into curl
        print(f"{row['path']}\t{row['url']}")


def _pick_job(
    job_id: str | None, project: str | None, storage_root: str | None, *, notice_on_stderr: bool
) -> JobHandle:
    if job_id or not notice_on_stderr:
        job = pick_job(job_id, project, storage_root)
    else:
        job = latest_job(project, storage_root=storage_root)
        _stderr.print(f"[dim]no --job-id given: using the most recent job, {job.id}[/dim]")
    if project and project not in (job.project, job.project_id):
        raise OrchestratorError(f"job {job.id} belongs to project {job.project!r}, not {project!r}")
    return job


def _first_missing(dest: Path) -> Path | None:
    """The outermost directory a download into `dest` creates: what to remove if it fails."""
    missing = None
    for p in (dest, *dest.parents):
        if p.exists():
            break
        missing = p
    return missing


def _sorted(manifests: list[Manifest], sort: SortKey, order: SortOrder) -> list[Manifest]:
    keys = {
        SortKey.created: lambda m: (m.created_at, m.node_rank),
        SortKey.size: lambda m: (m.size_bytes, m.created_at),
        SortKey.name: lambda m: (_natural(m.name), m.job_id, m.node_rank),
    }
    return sorted(manifests, key=keys[sort], reverse=order is SortOrder.desc)


def _natural(name: str) -> list[tuple[int, int | str]]:
    """`checkpoint-20` before `checkpoint-100`."""
    return [(0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", name) if p]


def _type(m: Manifest) -> str:
    kind = m.checkpoint_type
    if kind == "lora" and m.lora_rank is not None:
        kind = f"lora (r={m.lora_rank})"
    return kind if m.complete else f"{kind}, INCOMPLETE"


_ROW_FIELDS = ("name", "job_id", "node_rank", "checkpoint_type", "lora_rank", "size_bytes",
               "file_count", "created_at", "complete", "incomplete_reason")  # fmt: skip


def _row(m: Manifest) -> dict:
    return {
        "name": m.name,
        "job_id": m.job_id,
        "node_rank": m.node_rank,
        "checkpoint_type": m.checkpoint_type,
        "lora_rank": m.lora_rank,
        "size_bytes": m.size_bytes,
        "file_count": len(m.files),
        "created_at": m.created_at,
        "complete": m.complete,
        "incomplete_reason": m.incomplete_reason,
    }

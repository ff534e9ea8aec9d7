"""`orchestrator metrics`: what a job's ranks use (CPU, memory, GPUs, disk, network, checkpoint
uploads), live on a terminal until the job ends, or once as text, JSON, CSV or an HTML report."""

from __future__ import annotations

import csv
import enum
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.columns import Columns
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from orchestrator.cli.jobs_common import pick_job
from orchestrator.cli.options import JobId, Project, StorageRootOption
from orchestrator.cli.render import console, print_json
from orchestrator.client.api import latest_job
from orchestrator.client.jobs import JobHandle
from orchestrator.client.metrics import JobMetrics
from orchestrator.client.metrics_text import (
    Lines,
    ReportTable,
    job_lines,
    no_samples,
    rank_lines,
    rank_title,
    report_tables,
)

_stderr = Console(stderr=True, highlight=False)  # notices, where stdout is JSON, CSV or a path


class MetricsFormat(str, enum.Enum):
    text = "text"
    json = "json"
    csv = "csv"


_HTML_HELP = "Write an HTML report (summary and plots; works offline) here and print its path"
LIVE_REPORTS = 8  # a run's rounds in the live view, which a tall view would cut off


def metrics(
    job_id: JobId = None,
    project: Project = None,
    storage_root: StorageRootOption = None,
    output: Annotated[MetricsFormat, typer.Option("-o", "--output")] = MetricsFormat.text,
    html: Annotated[Path | None, typer.Option("--html", help=_HTML_HELP)] = None,
    refresh: Annotated[
        float, typer.Option("--refresh", min=0.1, help="Seconds between updates of the live view")
    ] = 5.0,
    once: Annotated[
        bool, typer.Option("--once", help="Print the current view once, even on a terminal")
    ] = False,
) -> None:
    """A job's resource use per rank and node, and a Ray Train job's reports; on a terminal, a
    live view until the job ends."""
    quiet = output is not MetricsFormat.text or html is not None
    job = _pick(job_id, project, storage_root, notice_on_stderr=quiet)
    m = job.metrics()
    if html is not None:
        from orchestrator.client.metrics_plot import write_report  # plotly only for reports

        print(write_report(m, html))
    elif output is MetricsFormat.json:
        print_json(m.to_json())
    elif output is MetricsFormat.csv:
        writer = csv.DictWriter(sys.stdout, fieldnames=m.columns(), lineterminator="\n")
        writer.writeheader()
        writer.writerows(m.rows())
    elif once or not console.is_terminal or m.state.is_terminal:
        console.print(_view(m))
    else:
        _live(job, m, refresh)


def _live(job: JobHandle, m: JobMetrics, refresh: float) -> None:
    """Redraw every `refresh` s on the alternate screen (as `top` does: a view taller than the
    terminal is cut, never scrolled into copies), then print the last view whole when the job
    ends or on Ctrl-C."""
    try:
        with Live(_view(m, LIVE_REPORTS), console=console, screen=True,
                  auto_refresh=False) as live:  # fmt: skip
            while not m.state.is_terminal:
                time.sleep(refresh)
                m = job.metrics()
                live.update(_view(m, LIVE_REPORTS), refresh=True)
    except KeyboardInterrupt:
        pass
    console.print(_view(m))


def _view(m: JobMetrics, reports: int | None = None) -> RenderableType:
    job = Panel(_table(job_lines(m)), title=f"job {m.job_id} · {escape(m.project)}", expand=False)
    tables = report_tables(m) if reports is None else report_tables(m, reports)
    trained = [_reports(t) for t in tables]
    if why := no_samples(m):
        return Group(job, Text(why), *trained)
    ranks = [
        Panel(
            _table(rank_lines(r, m.read_at, m.rank_uploads.get(r.rank))),
            title=rank_title(r),
            expand=False,
        )
        for r in m.ranks
    ]
    return Group(job, Columns(ranks), *trained)


def _reports(t: ReportTable) -> Panel:
    """A run's rounds, a column per metric (rank 0's), then what the rows leave out."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in t.columns:
        table.add_column(column, justify="left" if column == "checkpoint" else "right")
    for row in t.rows:
        table.add_row(*(Text(cell) for cell in row))
    notes = [Text(note, style="dim") for note in t.notes]
    return Panel(Group(table, *notes), title=escape(t.title), expand=False)


def _table(lines: Lines) -> Table:
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    for label, value in lines:
        table.add_row(Text(label), Text(value))
    return table


def _pick(
    job_id: str | None, project: str | None, storage_root: str | None, *, notice_on_stderr: bool
) -> JobHandle:
    if job_id or not notice_on_stderr:
        return pick_job(job_id, project, storage_root)
    job = latest_job(project, storage_root=storage_root)
    _stderr.print(f"[dim]no --job-id given: using the most recent job, {job.id}[/dim]")
    return job

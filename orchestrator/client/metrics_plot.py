"""A job's metrics as a plotly figure (inline in Jupyter) and as one self-contained HTML report.

Panels share the time axis; a panel with nothing to draw (GPUs on a CPU job, uploads where no
rank reports them) is left out rather than drawn as empty axes. A Ray Train job's reports are a
figure of their own (`reports_figure`), each numeric metric over the report index.
"""

from __future__ import annotations

import datetime as dt
import html
import math
from dataclasses import dataclass, field
from pathlib import Path

import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from orchestrator.client.metrics import JobMetrics
from orchestrator.client.metrics_text import job_lines, no_samples, rank_title, run_title
from orchestrator.storage.metrics import RankMetrics

GiB = 1024**3
MiB = 1024**2
PANEL_HEIGHT_PX = 240
COLOURS = qualitative.Plotly  # one per rank, in every panel
DASHES = ("solid", "dot", "dashdot", "longdash", "longdashdot")  # a rank's GPUs, dirs, ...
MAX_REPORT_PANELS = 16  # numeric metrics drawn, by name; -o json has every one


@dataclass
class _Panel:
    title: str
    traces: list[go.Scatter] = field(default_factory=list)
    counts: bool = False  # whole numbers: no ticks at 0.2, 0.4, ...


def figure(metrics: JobMetrics) -> go.Figure:
    """Every panel that has data, one row each, sharing the time axis; a legend group per rank."""
    panels = [p for p in _panels(metrics) if p.traces]
    title = _title(metrics)
    if not panels:
        fig = go.Figure()
        fig.add_annotation(text=no_samples(metrics) or "nothing to plot", showarrow=False,
                           x=0.5, y=0.5, xref="paper", yref="paper", font={"size": 16})  # fmt: skip
        fig.update_xaxes(visible=False)
        fig.update_yaxes(visible=False)
        return fig.update_layout(title=title, height=300, template="plotly_white")
    fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=0.04,
                        subplot_titles=[p.title for p in panels])  # fmt: skip
    for row, panel in enumerate(panels, start=1):
        for trace in panel.traces:
            fig.add_trace(trace, row=row, col=1)
        if panel.counts:
            highest = max((y for t in panel.traces for y in t.y if y is not None), default=0)
            fig.update_yaxes(tick0=0, dtick=max(1, math.ceil(highest / 5)), row=row, col=1)
    fig.update_layout(
        title=title,
        height=PANEL_HEIGHT_PX * len(panels) + 120,
        template="plotly_white",
        hovermode="x unified",
        legend={"groupclick": "toggleitem", "tracegroupgap": 12},
        margin={"t": 90},
    )
    fig.update_yaxes(rangemode="tozero")
    return fig


def write_report(metrics: JobMetrics, path: Path | str) -> Path:
    """One HTML file that works offline (plotly.js inlined): a title, a summary table, the plots."""
    path = Path(path)
    fig = figure(metrics).update_layout(title=None, margin={"t": 40})  # the page's <h1> says it
    plots = fig.to_html(full_html=False, include_plotlyjs=True, config={"displaylogo": False})
    if (reports := reports_figure(metrics)) is not None:
        plots += "\n<h2>Ray Train reports</h2>\n" + reports.to_html(
            full_html=False, include_plotlyjs=False, config={"displaylogo": False}
        )
    rows = "\n".join(
        f"<tr><th>{html.escape(label)}</th><td>{html.escape(value)}</td></tr>"
        for label, value in job_lines(metrics)
    )
    notes: list[str] = []
    if why := no_samples(metrics):
        notes.append(why)
    elif not metrics.gpu_indexes:
        notes.append("no GPUs: no rank holds one, so there are no GPU panels")
    page = _PAGE.format(
        title=html.escape(_title(metrics)),
        read_at=dt.datetime.fromtimestamp(metrics.read_at).strftime("%Y-%m-%d %H:%M:%S"),
        rows=rows,
        notes="".join(f'<p class="note">{html.escape(n)}</p>' for n in notes),
        plots=plots,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


def reports_figure(metrics: JobMetrics) -> go.Figure | None:
    """Each numeric metric of the job's Ray Train reports over the report index, one panel a
    metric: rank 0's line per run (each `fit`), dotted lines for the workers whose values
    differ. None when the job stored no reports with a number in them."""
    runs = [run for run in metrics.train_reports if run.reports]
    names = sorted({k for run in runs for r in run.reports
                    for m in (r.metrics, *r.workers.values())
                    for k, v in m.items() if isinstance(v, int | float)})  # fmt: skip
    if not names:
        return None
    names = names[:MAX_REPORT_PANELS]
    fig = make_subplots(rows=len(names), cols=1, shared_xaxes=True, vertical_spacing=0.04,
                        subplot_titles=names)  # fmt: skip
    for row, name in enumerate(names, start=1):
        for i, run in enumerate(runs):
            colour, label = COLOURS[i % len(COLOURS)], run_title(run).split(" · ", 1)[1]
            index = [r.index for r in run.reports]
            lines = {"rank 0": [_number(r.metrics.get(name)) for r in run.reports]}
            for worker in sorted({w for r in run.reports for w in r.workers}):
                values = [_number(r.workers.get(worker, r.metrics).get(name)) for r in run.reports]
                if values != lines["rank 0"]:
                    lines[f"worker {worker}"] = values
            for n, (who, values) in enumerate(lines.items()):
                fig.add_trace(go.Scatter(
                    x=index, y=values, name=f"{name}, {who}", mode="lines+markers",
                    line={"color": colour, "dash": _dash(n)}, legendgroup=label,
                    legendgrouptitle_text=label, showlegend=True,
                    hovertemplate=f"{label}, {who}, {name}: %{{y:.4g}} at report %{{x}}"
                                  "<extra></extra>",
                ), row=row, col=1)  # fmt: skip
    fig.update_xaxes(title_text="report", row=len(names), col=1)
    return fig.update_layout(height=PANEL_HEIGHT_PX * len(names) + 80, template="plotly_white",
                             hovermode="x unified", margin={"t": 40})  # fmt: skip


def _number(value: object) -> float | None:
    return value if isinstance(value, int | float) else None  # text (NaN, a phase): a gap


def _title(m: JobMetrics) -> str:
    return f"job {m.job_id} · {m.project} · {m.state.value}"


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
table.summary {{ border-collapse: collapse; margin-bottom: 1em; }}
table.summary th {{ text-align: left; padding: 2px 1.5em 2px 0; font-weight: 600; }}
table.summary td {{ padding: 2px 0; }}
p.note {{ color: #555; font-style: italic; }}
</style>
</head>
<body>
<h1>{title}</h1>
<p class="note">read at {read_at}</p>
<table class="summary">
{rows}
</table>
{notes}
{plots}
</body>
</html>
"""


def _panels(m: JobMetrics) -> list[_Panel]:
    cpu, memory = _Panel("CPU cores"), _Panel("memory (GiB)")
    gpu_busy, gpu_memory = _Panel("GPU utilisation (%)"), _Panel("GPU memory used (GiB)")
    disk, net = _Panel("disk (GiB)"), _Panel("network (MiB/s)")
    backlog = _Panel("checkpoints waiting to upload", counts=True)
    for i, r in enumerate(m.ranks):
        if not r.samples:
            continue
        line, samples = _Tracer(r, COLOURS[i % len(COLOURS)]), r.samples
        cpu.traces.append(line("CPU cores", [s.cpu_cores for s in samples], "cores"))
        if r.cpu_request:
            cpu.traces.append(line("CPU request", [r.cpu_request] * len(samples), "cores", "dash"))
        memory.traces.append(line("memory", [s.memory_bytes / GiB for s in samples], "GiB"))
        if r.memory_request_bytes:
            request = [r.memory_request_bytes / GiB] * len(samples)
            memory.traces.append(line("memory request", request, "GiB", "dash"))
        for n, index in enumerate(sorted({g.index for s in samples for g in s.gpus})):
            gpus = [next((g for g in s.gpus if g.index == index), None) for s in samples]
            busy = [g.utilization_pct if g else None for g in gpus]
            used = [g.memory_used_bytes / GiB if g else None for g in gpus]
            gpu_busy.traces.append(line(f"GPU {index} busy", busy, "%", _dash(n)))
            gpu_memory.traces.append(line(f"GPU {index} memory", used, "GiB", _dash(n)))
        dirs = [d for d in m.disk_dirs if any(d in s.disk_bytes for s in samples)]
        for n, d in enumerate(dirs):
            sizes = [s.disk_bytes[d] / GiB if d in s.disk_bytes else None for s in samples]
            disk.traces.append(line(f"disk {d}", sizes, "GiB", _dash(n)))
        net.traces.append(line("sent", [s.net_sent_bytes_per_s / MiB for s in samples], "MiB/s"))
        received = [s.net_recv_bytes_per_s / MiB for s in samples]
        net.traces.append(line("received", received, "MiB/s", "dot"))
        if any(s.uploads is not None for s in samples):
            waiting = [s.uploads.waiting if s.uploads else None for s in samples]
            backlog.traces.append(line("checkpoints waiting", waiting, "", shape="hv"))
    return [cpu, memory, gpu_busy, gpu_memory, disk, net, backlog]


def _dash(n: int) -> str:
    return DASHES[n % len(DASHES)]


class _Tracer:
    """Makes one rank's lines: its colour, its legend group (titled with the rank and host)."""

    def __init__(self, rank: RankMetrics, colour: str) -> None:
        self.rank = rank
        self.colour = colour
        self.times = [dt.datetime.fromtimestamp(s.at) for s in rank.samples]

    def __call__(
        self,
        name: str,
        values: list[float | None],
        unit: str,
        dash: str = "solid",
        shape: str = "linear",
    ) -> go.Scatter:
        r = self.rank
        return go.Scatter(
            x=self.times,
            y=values,
            name=name,
            mode="lines",
            line={"color": self.colour, "dash": dash, "shape": shape,
                  "width": 1.5 if dash == "dash" else 2},
            legendgroup=f"rank {r.rank}",
            legendgrouptitle_text=rank_title(r),
            hovertemplate=f"rank {r.rank} {name}: %{{y:.3g}} {unit}<extra></extra>",
        )  # fmt: skip

"""A job's metrics in words, as (label, value) lines: the CLI's live view and the HTML report's
summary say the same things the same way."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.client.metrics import JobMetrics, UploadTotals
from orchestrator.sizes import human_bytes
from orchestrator.storage.metrics import RankMetrics
from orchestrator.storage.train_reports import TrainReport, TrainRun, Value

Lines = list[tuple[str, str]]
REPORTS_SHOWN = 20  # the latest rounds of a run in the text view; -o json has every one


def no_samples(metrics: JobMetrics) -> str | None:
    """Why there is nothing to show yet, or None when some rank stored samples."""
    if metrics.has_samples:
        return None
    if metrics.state.is_terminal:
        return "no samples were stored"
    return "no samples yet: the job's ranks have not started"


def rank_title(rank: RankMetrics) -> str:
    """`rank 0 · gpu-node-1 (node 3f2a9c81d0b4)`"""
    title = f"rank {rank.rank}" + (f" · {rank.hostname}" if rank.hostname else "")
    return title + (f" (node {rank.node_id[:12]})" if rank.node_id else "")


def job_lines(metrics: JobMetrics) -> Lines:
    """The job as a whole: its state, the time in each, weights delivery, uploads, freshness."""
    lines: Lines = [("state", metrics.state.value)]
    lines += [(f"time in {state}", duration(s)) for state, s in metrics.time_in_state.items()]
    for w in metrics.weights:
        how = "node cache hit" if w.tier == "node" else f"copied from the {w.tier}"
        copied = f", {human_bytes(w.bytes_copied)}" if w.bytes_copied else ""
        lines.append((f"weights, rank {w.rank}",
                      f"{w.source}: {how} in {w.seconds:.2f} s{copied}"))  # fmt: skip
    uploads = _uploads(metrics.uploads) if metrics.uploads else "none reported"
    lines.append(("checkpoint uploads", uploads))
    latest = metrics.latest_sample_at
    lines.append(("latest sample", "none" if latest is None else _ago(metrics.read_at - latest)))
    return lines


def rank_lines(rank: RankMetrics, now: float, ended: UploadTotals | None = None) -> Lines:
    """One rank's latest sample, measured against what the job asked for; `ended`: its
    uploads as the store holds them once the job has ended (its last sample may be older)."""
    if not rank.samples:
        return [("samples", "none yet")]
    s = rank.samples[-1]
    cpu = f"{s.cpu_cores:.2f} cores"
    if rank.cpu_request:
        cpu += f" of {rank.cpu_request:g} requested ({s.cpu_cores / rank.cpu_request:.0%})"
    cores = [x.cpu_cores for x in rank.samples]
    cpu += f"; peak {max(cores):.2f}, mean {sum(cores) / len(cores):.2f}"
    memory = human_bytes(s.memory_bytes)
    if rank.memory_request_bytes:
        share = s.memory_bytes / rank.memory_request_bytes
        memory += f" of {human_bytes(rank.memory_request_bytes)} requested ({share:.0%})"
    memory += f"; peak {human_bytes(max(x.memory_bytes for x in rank.samples))}"
    lines: Lines = [("CPU", cpu), ("memory", memory), ("processes", str(s.processes))]
    for g in s.gpus:
        name = rank.gpu_names.get(g.index)
        lines.append((
            f"GPU {g.index}",
            (f"{name}: " if name else "") + f"{g.utilization_pct:.0f}% busy, "
            f"{human_bytes(g.memory_used_bytes)} of {human_bytes(g.memory_total_bytes)} memory",
        ))  # fmt: skip
    if not s.gpus:
        lines.append(("GPUs", "none"))
    lines.append(("disk", _disk(s.disk_bytes, s.disk_free_bytes, s.disk_total_bytes)))
    lines.append(("network", f"sent {human_bytes(s.net_sent_bytes_per_s)}/s, "
                             f"received {human_bytes(s.net_recv_bytes_per_s)}/s"))  # fmt: skip
    if totals := ended or UploadTotals.of([s.uploads] if s.uploads else []):
        lines.append(("checkpoint uploads", _uploads(totals)))
    lines.append(("latest sample", _ago(now - s.at)))
    return lines


def duration(seconds: float) -> str:
    """`4.2 s`, `45 s`, `3 min 05 s`, `2 h 07 min`."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"


def _ago(seconds: float) -> str:
    return f"{duration(max(0.0, seconds))} ago"


def _disk(dirs: dict[str, int], free: int | None, total: int | None) -> str:
    text = ", ".join(f"{d} {human_bytes(n)}" for d, n in dirs.items()) or "not measured yet"
    if free is not None:
        text += f"; {human_bytes(free)} free" + (f" of {human_bytes(total)}" if total else "")
    return text


def _uploads(u: UploadTotals) -> str:
    waiting = "none waiting"
    if u.waiting:
        waiting = f"{u.waiting} waiting ({human_bytes(u.waiting_bytes)}"
        if u.oldest_waiting_s is not None:
            waiting += f", oldest for {duration(u.oldest_waiting_s)}"
        waiting += ")"
    if u.stored is not None:  # the job has ended: what the store holds, not the last sample
        stored = f"{u.stored} stored"
        if u.stored:
            stored += f" ({human_bytes(u.stored_bytes or 0)})"
        return f"{waiting}, {stored}"
    uploaded = f"{u.uploaded} uploaded"
    if u.uploaded:
        uploaded += f" ({human_bytes(u.uploaded_bytes)}"
        if u.mean_upload_s is not None:
            uploaded += f", {duration(u.mean_upload_s)} each on average"
        uploaded += ")"
    return f"{waiting}, {uploaded}"


@dataclass(frozen=True)
class ReportTable:
    """A Ray Train run's latest rounds as rows: the round's index, rank 0's metrics (sorted by
    name), its checkpoint; `notes` say what the rows leave out."""

    title: str
    columns: list[str]
    rows: list[list[str]]
    notes: list[str]


def report_tables(metrics: JobMetrics, last: int = REPORTS_SHOWN) -> list[ReportTable]:
    """One table per run (each `fit` of the job), its `last` rounds."""
    return [_report_table(run, last) for run in metrics.train_reports if run.reports]


def run_title(run: TrainRun) -> str:
    """`Ray Train reports · run demo, attempt 0`"""
    return f"Ray Train reports · run {run.run_name or run.run_id[:12]}, attempt {run.attempt}"


def _report_table(run: TrainRun, last: int) -> ReportTable:
    shown = run.reports[-last:]
    names = sorted({k for r in shown for k in r.metrics})
    rows = [
        [str(r.index), *(_value(r.metrics.get(k)) for k in names), r.checkpoint or "-"]
        for r in shown
    ]
    notes = []
    if earlier := len(run.reports) - len(shown):
        notes.append(f"{earlier} earlier report(s) not shown: -o json and --html have every one")
    if differing := next((r for r in reversed(shown) if r.workers), None):
        notes.append(_differences(differing))
    return ReportTable(run_title(run), ["report", *names, "checkpoint"], rows, notes)


def _differences(report: TrainReport) -> str:
    """`report 2: worker 1 differs: phase=b; worker 2 differs: ...` (what differs from rank 0)"""
    parts = []
    for worker, metrics in sorted(report.workers.items()):
        changed = [f"{k}={_value(v)}" for k, v in sorted(metrics.items())
                   if report.metrics.get(k) != v]  # fmt: skip
        changed += [f"no {k}" for k in sorted(report.metrics) if k not in metrics]
        parts.append(f"worker {worker} differs: {', '.join(changed)}")
    return f"report {report.index}: " + "; ".join(parts)


def _value(value: Value | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)

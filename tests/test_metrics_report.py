"""`orchestrator metrics`, `job.metrics()` and `job.plot_metrics()` as a user meets them.

No Ray: a 2-rank job's samples (rank 0 with 2 GPUs, rank 1 on CPUs) are written straight into a
storage root with `write_rank_metrics`, as the node agents would, beside its record and status.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import os
import sys
import time

import pexpect
import pytest
from test_cli_checkpoints import cli, make_record

from orchestrator.client.api import get_job
from orchestrator.client.metrics import time_in_states
from orchestrator.client.metrics_plot import write_report
from orchestrator.client.metrics_text import job_lines
from orchestrator.lifecycle import JobState
from orchestrator.storage.checkpoints import Manifest, manifest_path
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.metrics import (
    GpuSample,
    MetricsSample,
    RankMetrics,
    UploadStats,
    write_rank_metrics,
)
from orchestrator.storage.records import (
    JobStatus,
    NodeDelivery,
    NodeInfo,
    StatusEvent,
    WeightsStatus,
)
from orchestrator.storage.root import StorageRoot

GiB = 1024**3
MiB = 1024**2
JOB = "job-metrics"
# Seconds spent in each state before RUNNING began (RUNNING counts up to now).
CREATED_S, DEPLOYING_S, RUNNING_FOR_S = 10.0, 15.0, 375.0
RANK0_SAMPLES, RANK1_SAMPLES = 6, 4
LEAVE_ALTERNATE_SCREEN = "\x1b[?1049l"


def _status(job_id: str, states: list[tuple[JobState, float]], **updates) -> JobStatus:
    """A status whose history entered each state at the given time."""
    history = [StatusEvent(state=s, at=at) for s, at in states]
    return JobStatus(job_id=job_id, state=states[-1][0], history=history, **updates)


def _rank0(now: float) -> RankMetrics:
    metrics = RankMetrics(
        job_id=JOB,
        rank=0,
        node_id="a1b2c3d4e5f6a7b8",
        hostname="gpu-node-a",
        memory_request_bytes=32 * GiB,
        cpu_request=8,
        gpu_names={0: "NVIDIA H100", 1: "NVIDIA H100"},
    )
    uploads = UploadStats(
        waiting=1, waiting_bytes=2 * GiB, oldest_waiting_s=40.0,
        uploaded=2, uploaded_bytes=4 * GiB, upload_seconds=30.0,
    )  # fmt: skip
    for k in range(RANK0_SAMPLES):
        gpus = [
            GpuSample(index=i, utilization_pct=10.0 * k + i, memory_used_bytes=(20 + k) * GiB,
                      memory_total_bytes=80 * GiB)
            for i in (0, 1)
        ]  # fmt: skip
        sample = MetricsSample(
            at=now - 3 - 5 * (RANK0_SAMPLES - 1 - k),
            cpu_cores=2.0 + 0.5 * k,  # the last: 4.50 cores of 8
            memory_bytes=(7 + k) * GiB,  # the last: 12 GiB of 32 (38%)
            processes=5,
            gpus=gpus,
            disk_bytes={"workspace": 5 * 1024**2, "checkpoints": k * GiB},
            disk_free_bytes=400 * GiB,
            disk_total_bytes=500 * GiB,
            net_sent_bytes_per_s=2.0 * 1024**2,
            net_recv_bytes_per_s=30.0 * 1024**2,
            uploads=uploads,
        )
        metrics.add(sample)
    return metrics


def _rank1(now: float) -> RankMetrics:
    metrics = RankMetrics(
        job_id=JOB,
        rank=1,
        node_id="f0e1d2c3b4a59687",
        hostname="cpu-node-b",
        memory_request_bytes=32 * GiB,
        cpu_request=8,
    )
    uploads = UploadStats(waiting=0, uploaded=3, uploaded_bytes=6 * GiB, upload_seconds=15.0)
    for k in range(RANK1_SAMPLES):
        sample = MetricsSample(
            at=now - 4 - 5 * (RANK1_SAMPLES - 1 - k),
            cpu_cores=6.25,
            memory_bytes=3 * GiB,
            processes=3,
            disk_bytes={"workspace": 5 * 1024**2, "scratch": GiB},
            disk_free_bytes=100 * GiB,
            uploads=uploads,
        )
        metrics.add(sample)
    return metrics


def write_job(root: StorageRoot, now: float) -> None:
    """The 2-rank job, RUNNING for RUNNING_FOR_S, its weights delivered to both nodes."""
    started = now - RUNNING_FOR_S - DEPLOYING_S - CREATED_S
    weights = WeightsStatus(source="hf://acme/llama-small", mount_location="/app/weights",
                            nodes=[NodeDelivery(rank=0, tier="mirror", seconds=12.5,
                                                bytes_copied=3 * GiB),
                                   NodeDelivery(rank=1, tier="node", seconds=0.25)])  # fmt: skip
    nodes = [
        NodeInfo(rank=0, node_id="a1b2c3d4e5f6a7b8", ip="10.0.0.1", hostname="gpu-node-a"),
        NodeInfo(rank=1, node_id="f0e1d2c3b4a59687", ip="10.0.0.2", hostname="cpu-node-b"),
    ]
    status = _status(JOB, [
        (JobState.CREATED, started),
        (JobState.DEPLOYING, started + CREATED_S),
        (JobState.RUNNING, started + CREATED_S + DEPLOYING_S),
    ], weights=[weights], nodes=nodes)  # fmt: skip
    JobStore(root).create(make_record(JOB, "vision", started), status)
    write_rank_metrics(root, _rank0(now))
    write_rank_metrics(root, _rank1(now))


@pytest.fixture(scope="module")
def root_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The 2-rank job, plus a running job and an ended one that stored no samples."""
    root = StorageRoot(tmp_path_factory.mktemp("metrics") / "storage")
    now = time.time()
    write_job(root, now)
    store = JobStore(root)
    running = _status("job-waiting", [(JobState.CREATED, now - 60), (JobState.DEPLOYING, now - 30)])
    ended = _status("job-ended", [(JobState.CREATED, now - 60), (JobState.DEPLOYING, now - 50),
                                  (JobState.DEPLOY_FAILED, now - 40)])  # fmt: skip
    store.create(make_record("job-waiting", "vision", now - 60), running)
    store.create(make_record("job-ended", "vision", now - 59), ended)
    return root.url


def test_json_carries_every_rank_sample_and_the_job_totals(root_url):
    result = cli("metrics", "--job-id", JOB, "--storage-root", root_url, "-o", "json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert (data["job_id"], data["project"], data["state"]) == (JOB, "vision", "RUNNING")
    ranks = {r["rank"]: r for r in data["ranks"]}
    assert sorted(ranks) == [0, 1]
    assert len(ranks[0]["samples"]) == RANK0_SAMPLES
    assert len(ranks[1]["samples"]) == RANK1_SAMPLES
    assert ranks[0]["hostname"] == "gpu-node-a"
    assert [g["index"] for g in ranks[0]["samples"][-1]["gpus"]] == [0, 1]
    assert ranks[0]["samples"][-1]["cpu_cores"] == 4.5
    assert ranks[1]["samples"][-1].get("gpus", []) == []

    # uploads: summed over both ranks' latest samples; the mean is (30 s + 15 s) / 5 uploads
    assert data["uploads"] == {
        "waiting": 1, "waiting_bytes": 2 * GiB, "oldest_waiting_s": 40.0,
        "uploaded": 5, "uploaded_bytes": 10 * GiB, "mean_upload_s": 9.0,
        "stored": None, "stored_bytes": None,  # counted from the store once the job has ended
    }  # fmt: skip
    assert [(w["rank"], w["tier"], w["bytes_copied"]) for w in data["weights"]] == [
        (0, "mirror", 3 * GiB), (1, "node", 0)
    ]  # fmt: skip
    spent = data["time_in_state"]
    assert list(spent) == ["CREATED", "DEPLOYING", "RUNNING"]
    assert spent["CREATED"] == pytest.approx(CREATED_S)
    assert spent["DEPLOYING"] == pytest.approx(DEPLOYING_S)
    assert RUNNING_FOR_S <= spent["RUNNING"] < RUNNING_FOR_S + 60  # up to now


def test_csv_has_one_row_per_sample_per_rank_and_the_same_columns_for_all(root_url):
    result = cli("metrics", "--job-id", JOB, "--storage-root", root_url, "-o", "csv")
    assert result.returncode == 0, result.stderr
    reader = csv.DictReader(io.StringIO(result.stdout))
    rows = list(reader)
    assert [r["rank"] for r in rows] == ["0"] * RANK0_SAMPLES + ["1"] * RANK1_SAMPLES
    columns = reader.fieldnames or []
    expected = {
        "at", "cpu_cores", "memory_bytes", "memory_request_bytes", "processes",
        "disk_free_bytes", "net_sent_bytes_per_s", "checkpoints_waiting",
        "gpu0_utilization_pct", "gpu1_utilization_pct", "gpu1_memory_used_bytes",
        "disk_workspace_bytes", "disk_checkpoints_bytes", "disk_scratch_bytes",
    }  # fmt: skip
    assert expected <= set(columns)
    rank0 = [r for r in rows if r["rank"] == "0"]
    assert [float(r["gpu1_utilization_pct"]) for r in rank0] == [10.0 * k + 1 for k in range(6)]
    assert rank0[-1]["memory_bytes"] == str(12 * GiB)
    assert rank0[-1]["hostname"] == "gpu-node-a"
    rank1 = [r for r in rows if r["rank"] == "1"]
    assert all(r["gpu0_utilization_pct"] == "" for r in rank1)  # no GPUs: empty, not missing
    assert all(r["disk_checkpoints_bytes"] == "" for r in rank1)
    assert rank1[-1]["disk_scratch_bytes"] == str(GiB)
    times = [dt.datetime.fromisoformat(r["at"]) for r in rank0]
    assert times == sorted(times) and times[-1].tzinfo is not None
    assert abs(time.time() - times[-1].timestamp()) < RUNNING_FOR_S


def test_text_once_shows_each_rank_against_its_request_and_the_time_in_running(root_url):
    result = cli("metrics", "--job-id", JOB, "--storage-root", root_url, "--once")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "rank 0 · gpu-node-a" in text and "rank 1 · cpu-node-b" in text
    assert "4.50 cores of 8 requested (56%); peak 4.50, mean 3.25" in text
    assert "12.0 GiB of 32.0 GiB requested (38%); peak 12.0 GiB" in text
    assert "3.0 GiB of 32.0 GiB requested (9%)" in text  # rank 1's
    assert "NVIDIA H100: 51% busy" in text  # GPU 1's latest sample
    assert "time in RUNNING" in text and "6 min" in text
    assert "hf://acme/llama-small: copied from the mirror in 12.50 s, 3.0 GiB" in text
    assert "1 waiting (2.0 GiB, oldest for 40 s), 5 uploaded (10.0 GiB" in text
    assert "checkpoints 5.0 GiB" in text
    assert "received 30.0 MiB/s" in text


def test_live_view_redraws_until_the_job_ends_then_leaves_the_final_view(tmp_path):
    root = StorageRoot(tmp_path / "storage")
    write_job(root, time.time())
    child = pexpect.spawn(
        sys.executable, ["-m", "orchestrator", "metrics", "--job-id", JOB, "--storage-root",
                         root.url, "--refresh", "0.2"],
        encoding="utf-8", dimensions=(60, 200), timeout=30, env=_terminal_env(),
    )  # fmt: skip
    try:
        child.expect("6.25 cores of 8 requested")  # rank 1's latest sample
        rank1 = _rank1(time.time())
        rank1.add(rank1.samples[-1].model_copy(update={"at": time.time(), "cpu_cores": 7.75}))
        write_rank_metrics(root, rank1)
        child.expect("7.75 cores of 8 requested")  # redrawn with the new sample
        assert child.isalive()
        store = JobStore(root)
        store.put_status(store.status(JOB).moved_to(JobState.COMPLETED, "all commands exited 0"))
        child.expect(pexpect.EOF)  # it ends by itself
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    # Off the alternate screen, the last view is printed whole: it stays in the terminal.
    assert LEAVE_ALTERNATE_SCREEN in child.before
    final = child.before.rsplit(LEAVE_ALTERNATE_SCREEN, 1)[-1]
    assert "COMPLETED" in final and "time in RUNNING" in final
    assert "gpu-node-a" in final and "7.75 cores" in final


def _terminal_env() -> dict[str, str]:
    """Ours, without COLUMNS and LINES: the pseudo-terminal's own size is the one to follow."""
    return {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}


def test_job_handle_metrics_and_plot_have_every_rank(root_url):
    job = get_job(JOB, storage_root=root_url)
    metrics = job.metrics()
    assert [r.rank for r in metrics.ranks] == [0, 1]
    assert metrics.gpu_indexes == [0, 1]
    assert len(metrics.rows()) == RANK0_SAMPLES + RANK1_SAMPLES

    fig = job.plot_metrics()
    by_rank: dict[str, set[str]] = {}
    for trace in fig.data:
        by_rank.setdefault(trace.legendgroup, set()).add(trace.name)
        assert len(trace.x) == len(trace.y) > 0
    assert set(by_rank) == {"rank 0", "rank 1"}
    assert {"CPU cores", "memory", "memory request", "sent", "received"} <= by_rank["rank 1"]
    assert {"GPU 0 busy", "GPU 1 busy", "GPU 1 memory"} <= by_rank["rank 0"]
    assert not any(name.startswith("GPU") for name in by_rank["rank 1"])
    request = next(t for t in fig.data if t.legendgroup == "rank 0" and t.name == "memory request")
    assert request.line.dash == "dash" and set(request.y) == {32.0}
    titles = [a.text for a in fig.layout.annotations]
    assert "GPU utilisation (%)" in titles and "checkpoints waiting to upload" in titles


def test_an_ended_job_says_what_the_store_holds_not_what_its_last_sample_saw(tmp_path):
    """mnist's last sample came before its final uploads (1 uploaded): once the job has ended,
    the panel, the JSON and the HTML report count the 4 checkpoints the store holds."""
    root = StorageRoot(tmp_path / "storage")
    now = time.time()
    store = JobStore(root)
    store.create(make_record("mnist-job", "mnist", now - 60), _status("mnist-job", [
        (JobState.CREATED, now - 60), (JobState.DEPLOYING, now - 50), (JobState.RUNNING, now - 40)
    ]))  # fmt: skip
    last = UploadStats(waiting=1, waiting_bytes=256 * MiB, uploaded=1, uploaded_bytes=256 * MiB,
                       upload_seconds=2.0)  # fmt: skip
    rank = RankMetrics(job_id="mnist-job", rank=0, hostname="gpu-node-a")
    rank.add(MetricsSample(at=now - 5, cpu_cores=1.0, memory_bytes=GiB, processes=2, uploads=last))
    write_rank_metrics(root, rank)
    for n in range(4):
        manifest = Manifest(project="mnist", job_id="mnist-job", node_rank=0, name=f"epoch-{n}",
                            files=[], size_bytes=256 * MiB, created_at=now - 30 + n)  # fmt: skip
        root.write_bytes(manifest_path("mnist", "mnist-job", 0, manifest.name),
                         manifest.model_dump_json().encode())  # fmt: skip

    running = dict(job_lines(get_job("mnist-job", storage_root=root.url).metrics()))
    assert running["checkpoint uploads"] == (
        "1 waiting (256.0 MiB), 1 uploaded (256.0 MiB, 2.0 s each on average)"
    )  # while it runs: the live figures, stored or not
    store.put_status(store.status("mnist-job").moved_to(JobState.COMPLETED, "exited 0"))

    text = cli("metrics", "--job-id", "mnist-job", "--storage-root", root.url, "--once").stdout
    # The job's panel and rank 0's both: neither says what the last sample saw waiting.
    assert text.count("checkpoint uploads  none waiting, 4 stored (1.0 GiB)") == 2, text
    assert "1 waiting" not in text
    as_json = json.loads(cli("metrics", "--job-id", "mnist-job", "--storage-root", root.url,
                             "-o", "json").stdout)  # fmt: skip
    uploads = as_json["uploads"]
    assert (uploads["waiting"], uploads["stored"], uploads["stored_bytes"]) == (0, 4, GiB)
    assert uploads["uploaded"] == 1  # what the last sample saw, kept as it was
    report = write_report(
        get_job("mnist-job", storage_root=root.url).metrics(), tmp_path / "r.html"
    )
    assert "<td>none waiting, 4 stored (1.0 GiB)</td>" in report.read_text()


def test_a_cpu_job_has_no_gpu_panels(tmp_path):
    root = StorageRoot(tmp_path / "storage")
    now = time.time()
    JobStore(root).create(make_record(JOB, "cpu-only", now), _status(JOB, [
        (JobState.CREATED, now - 30), (JobState.DEPLOYING, now - 20), (JobState.RUNNING, now - 10)
    ]))  # fmt: skip
    write_rank_metrics(root, _rank1(now))
    fig = get_job(JOB, storage_root=root.url).plot_metrics()
    titles = [a.text for a in fig.layout.annotations]
    assert "CPU cores" in titles
    assert not any("GPU" in t for t in titles)


def test_a_job_without_samples_says_so(root_url, tmp_path):
    waiting = cli("metrics", "--job-id", "job-waiting", "--storage-root", root_url)
    assert waiting.returncode == 0, waiting.stderr
    assert "no samples yet: the job's ranks have not started" in waiting.stdout
    assert "DEPLOYING" in waiting.stdout
    ended = cli("metrics", "--job-id", "job-ended", "--storage-root", root_url)
    assert ended.returncode == 0, ended.stderr
    assert "no samples were stored" in ended.stdout
    as_json = json.loads(cli("metrics", "--job-id", "job-ended", "--storage-root", root_url,
                             "-o", "json").stdout)  # fmt: skip
    assert as_json["ranks"] == [] and as_json["state"] == "DEPLOY_FAILED"
    assert as_json["uploads"] is None  # no rank reported an uploader: not "0 uploaded"
    as_csv = cli("metrics", "--job-id", "job-ended", "--storage-root", root_url, "-o", "csv")
    assert as_csv.stdout.splitlines()[0].startswith("rank,node_id,hostname,at,")
    assert len(as_csv.stdout.splitlines()) == 1
    fig = get_job("job-waiting", storage_root=root_url).plot_metrics()
    assert [a.text for a in fig.layout.annotations] == [
        "no samples yet: the job's ranks have not started"
    ]
    report = tmp_path / "ended.html"
    cli("metrics", "--job-id", "job-ended", "--storage-root", root_url, "--html", report)
    assert '<p class="note">no samples were stored</p>' in report.read_text()


def test_html_report_is_written_where_asked_and_inlines_plotly(root_url, tmp_path):
    target = tmp_path / "report.html"
    result = cli("metrics", "--job-id", JOB, "--storage-root", root_url, "--html", target)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(target)
    page = target.read_text()
    assert "<script src=" not in page  # plotly.js is in the page, not fetched
    assert "Plotly.newPlot" in page
    assert f"job {JOB} · vision · RUNNING" in page


def test_time_in_each_state_sums_a_retry_and_counts_an_ended_job_as_over():
    events = [(JobState.CREATED, 0), (JobState.DEPLOYING, 5), (JobState.RUNNING, 10),
              (JobState.PENDING, 110), (JobState.DEPLOYING, 130), (JobState.RUNNING, 140),
              (JobState.COMPLETED, 200)]  # fmt: skip
    history = [StatusEvent(state=s, at=at) for s, at in events]
    assert time_in_states(history, now=10_000) == {
        "CREATED": 5, "DEPLOYING": 15, "RUNNING": 160, "PENDING": 20, "COMPLETED": 0
    }  # fmt: skip
    assert time_in_states(history[:-1], now=1_000)["RUNNING"] == 100 + 860


def test_without_job_id_json_stays_parseable(root_url):
    result = cli("metrics", "--project", "vision", "--storage-root", root_url, "-o", "json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["job_id"] == "job-ended"  # the most recent of the project
    assert "using the most recent job, job-ended" in result.stderr

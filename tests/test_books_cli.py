"""`orchestrator capacity price` and `orchestrator usage` over a local storage root holding jobs
as controllers record them (no Ray): what an operator sets and reads, in each output."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cli_checkpoints import make_record

from orchestrator.books.cost import rates
from orchestrator.books.usage import job_usage
from orchestrator.cli.cmd_usage import moment
from orchestrator.errors import ConfigError
from orchestrator.lifecycle import JobState
from orchestrator.storage import audit
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.prices import Prices, read_prices
from orchestrator.storage.records import Attempt, Hold, JobStatus, StatusEvent
from orchestrator.storage.root import StorageRoot


def cli(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args, "--storage-root", str(root)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "250"},
    )  # fmt: skip


def store_job(store: JobStore, job_id: str, team: str, pushed: float, hours: float,
              lost_s: float = 0.0) -> None:  # fmt: skip
    """A job of `team` that waited 60 s, held 2 nodes x 4 CPUs x 2 H100 for `hours`, and (with
    `lost_s`) lost its node `lost_s` after its last checkpoint."""
    record = make_record(job_id, f"proj-{team}", pushed).model_copy(update={"team": team})
    since, until = pushed + 60, pushed + 60 + hours * 3600
    bundle = {"CPU": 4.0, "memory": 8 * 2**30, "GPU:H100": 2.0}
    attempts = [Attempt(number=0, started_at=since + 5, ended_at=until - 1,
                        cause="node_lost" if lost_s else None,
                        checkpoint_at=until - 1 - lost_s if lost_s else None)]  # fmt: skip
    status = JobStatus(
        job_id=job_id, state=JobState.COMPLETED,
        history=[StatusEvent(state=JobState.CREATED, at=pushed),
                 StatusEvent(state=JobState.COMPLETED, at=until - 0.5)],
        holds=[Hold(since=since, until=until, bundle=bundle, nodes=2,
                    prices=rates(Prices(gpu={"H100": 2.0}, cpu_hour=0.05)))],
        attempts=attempts,
    )  # fmt: skip
    store.create(record, status)


@pytest.fixture
def books_root(tmp_path) -> Path:
    root = tmp_path / "storage"
    store = JobStore(StorageRoot(str(root)))
    day = time.time() - 3 * 86400
    store_job(store, "jvision01", "vision", day, hours=1.0, lost_s=600)
    store_job(store, "jvision02", "vision", day + 86400, hours=2.0)
    store_job(store, "jnlp00001", "nlp", day + 2 * 86400, hours=0.5)
    return root


def test_prices_are_set_shown_changed_in_part_and_audited(tmp_path):
    root = tmp_path / "storage"
    done = cli(root, "capacity", "price", "--gpu", "h100=2.49", "--gpu", "A100=1.29",
               "--cpu-hour", "0.04", "--currency", "EUR")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "H100 2.49/GPU-hour" in done.stdout and "(EUR)" in done.stdout
    done = cli(root, "capacity", "price", "--memory-gib-hour", "0.005", "-o", "json")
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["gpu"] == {"H100": 2.49, "A100": 1.29}  # kept: only memory was given
    assert (shown["cpu_hour"], shown["memory_gib_hour"], shown["currency"]) == (0.04, 0.005, "EUR")
    stored = read_prices(StorageRoot(str(root)))
    assert rates(stored)["memory"] == pytest.approx(0.005 / 2**30)
    events = [e for e in audit.read(StorageRoot(str(root))) if e.verb == "capacity price"]
    assert len(events) == 2 and all(e.result == "ok" for e in events)
    assert "memory 0.005/GiB-hour" in events[-1].detail


@pytest.mark.parametrize("args, says", [
    (["--gpu", "H100=cheap"], "--gpu 'H100=cheap': write TYPE=PRICE"),
    (["--gpu", "Z900=1"], "'Z900' is not an accelerator type"),
    (["--cpu-hour", "-1"], "Invalid value for '--cpu-hour'"),
])  # fmt: skip
def test_a_bad_price_is_refused_naming_it_and_nothing_changes(tmp_path, args, says):
    root = tmp_path / "storage"
    done = cli(root, "capacity", "price", *args)
    assert done.returncode != 0
    assert says in done.stdout + done.stderr
    assert read_prices(StorageRoot(str(root))).empty


def test_usage_per_team_in_json_matches_each_jobs_books(books_root):
    done = cli(books_root, "usage", "--team", "vision", "-o", "json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert [j["job_id"] for j in out["jobs"]] == ["jvision01", "jvision02"]
    team = out["teams"]["vision"]
    assert team["jobs"] == 2
    assert team["usage"]["gpu_s"] == {"H100": pytest.approx(4 * 3 * 3600)}  # 2 nodes x 2, 3 h
    hourly = 2 * (2 * 2.0 + 4 * 0.05)
    assert team["usage"]["cost"] == pytest.approx(3 * hourly)
    assert team["lost"]["held_s"] == pytest.approx(600)
    assert team["lost"]["cost"] == pytest.approx(hourly * 600 / 3600)
    assert team["waiting_s"] == pytest.approx(120)
    store = JobStore(StorageRoot(str(books_root)))
    direct = job_usage(store.record("jvision01"), store.status("jvision01"), time.time())
    assert out["jobs"][0]["usage"] == direct.usage.model_dump()


def test_usage_in_a_window_counts_only_what_fell_in_it(books_root):
    """The last job alone, from its push on; by a relative --since of 1 day ago."""
    done = cli(books_root, "usage", "--since", "30h", "-o", "csv")
    assert done.returncode == 0, done.stderr
    rows = list(csv.DictReader(io.StringIO(done.stdout)))
    assert [r["job_id"] for r in rows] == ["jnlp00001"]
    assert float(rows[0]["gpu_hours"]) == pytest.approx(2.0)  # 4 GPUs x 0.5 h
    assert rows[0]["gpu_types"] == "H100=2.0000" and rows[0]["unpriced"] == ""


def test_usage_as_a_table_and_in_view(books_root):
    done = cli(books_root, "usage")
    assert done.returncode == 0, done.stderr
    assert "usage by job" in done.stdout and "usage by team" in done.stdout
    assert "jvision01" in done.stdout and "nlp" in done.stdout
    view = cli(books_root, "view", "--job-id", "jvision01")
    assert view.returncode == 0, view.stderr
    assert "GPU-hours 4.00 (H100 4.00)" in view.stdout
    assert "lost GPU-hours 0.67 (H100 0.67)" in view.stdout


def test_moment_reads_dates_times_and_durations_ago():
    assert moment("--since", "2026-12-01") == pytest.approx(
        time.mktime((2026, 12, 1, 0, 0, 0, 0, 0, -1))
    )
    assert moment("--since", "24h", now=100_000.0) == 100_000.0 - 86400
    assert moment("--until", None) is None
    with pytest.raises(ConfigError, match="--since 'yesterday': give a date"):
        moment("--since", "yesterday")


def test_push_says_what_the_job_costs_an_hour_at_the_clusters_prices(books_root, capsys):
    """`push` and `recreate` announce the job with its hourly cost (nothing when no prices are
    set); a GPU type without a price is named, not counted as free."""
    from orchestrator.cli.jobs_common import announce
    from orchestrator.cli.render import OutputFormat
    from orchestrator.client.jobs import JobHandle
    from orchestrator.spec.training import Compute

    store = JobStore(StorageRoot(str(books_root)))
    record = store.record("jvision01")
    job = JobHandle(store, record.model_copy(update={"spec": record.spec.model_copy(update={
        "job": record.spec.job.model_copy(update={
            "compute": Compute(node_count=2, cpu_count=4, memory="8Gi", accelerator="H100:2")})
    })}))  # fmt: skip
    announce(job, "pushed job jvision01", OutputFormat.text)
    assert "cost:" not in capsys.readouterr().out  # no prices set
    cli(books_root, "capacity", "price", "--gpu", "A100=1.0", "--cpu-hour", "0.05")
    announce(job, "pushed job jvision01", OutputFormat.text)
    said = capsys.readouterr().out
    assert (
        "cost: costs 0.40 USD an hour at the cluster's prices (no price for H100: not counted)"
    ) in " ".join(said.split())  # as wrapped at any width
    cli(books_root, "capacity", "price", "--gpu", "H100=2.0")
    assert job.cost_per_hour() == "costs 8.40 USD an hour at the cluster's prices"


def test_push_dry_run_says_the_hourly_cost_from_the_storage_roots_prices(tmp_path):
    mnist = Path(__file__).parent.parent / "recipes" / "mnist-pytorch" / "config.py"
    root = tmp_path / "storage"
    unset = subprocess.run(
        [sys.executable, "-m", "orchestrator", "push", str(mnist), "--dry-run",
         "--storage-root", str(root)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "250"},
    )  # fmt: skip
    assert unset.returncode == 0, unset.stderr
    assert "cost: no prices set (orchestrator capacity price)" in unset.stdout
    assert cli(root, "capacity", "price", "--cpu-hour", "1.5").returncode == 0
    done = cli(root, "push", str(mnist), "--dry-run", "--node-count", "2", "-o", "json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)["summary"]
    cpus = summary["per_node"]["cpu"]
    assert summary["cost_per_hour"] == (
        f"costs {2 * float(cpus) * 1.5:.2f} USD an hour at the cluster's prices"
    )
    assert not (root / "jobs").exists()  # nothing submitted


def test_a_dry_run_whose_storage_root_is_out_of_reach_says_so_at_once(tmp_path):
    """Offline (an S3 endpoint nothing answers on): the dry run gives up on the prices within
    seconds and says so, rather than riding out a 30-minute outage as a job would."""
    from conftest import free_port

    mnist = Path(__file__).parent.parent / "recipes" / "mnist-pytorch" / "config.py"
    env = {
        **os.environ,
        "COLUMNS": "250",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}",
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "x",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "push", str(mnist), "--dry-run",
         "--storage-root", "s3://nobody-home"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "cost: unknown: the cluster's prices could not be read" in done.stdout, done.stdout
    assert time.monotonic() - began < 60

"""The Ray dashboard as a user sees our jobs in it: a real Chromium on the embedded cluster's
Jobs page, with one job running and one waiting in our queue. Plus what the Ray job carries
(metadata, entrypoint), checked without a browser."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from browser import ARTIFACTS, chromium
from conftest import eventually, make_job
from ray.job_submission import JobSubmissionClient

from orchestrator import definitions as d
from orchestrator.client.api import push
from orchestrator.client.submit import controller_entrypoint, runs_comment
from orchestrator.lifecycle import JobState
from orchestrator.storage.records import ArchiveRef, JobRecord
from orchestrator.storage.root import StorageRoot

GATED = (
    "python -c \"import pathlib,time\nwhile not pathlib.Path('{gate}').exists(): time.sleep(0.2)\""
)


def sweep_job(directory: Path, name: str, command: str) -> Path:
    """A job of project dash-demo, team vision, that needs every CPU of the embedded cluster."""
    return make_job(
        directory,
        f"""
        from truss_train import definitions as d
        project = d.TrainingProject(
            name="dash-demo", team_name="vision",
            job=d.TrainingJob(
                name={name!r}, image=d.Image(base_image="python:3.11"),
                compute=d.Compute(cpu_count={os.cpu_count()}, memory="128Mi"),
                runtime=d.Runtime(start_commands=[{command!r}]),
            ),
        )
        """,
    )


def columns(row) -> dict[str, str]:
    """A row of the dashboard's jobs table, by its header's names."""
    table = row.locator("xpath=ancestor::table[1]")
    names = [h.inner_text().strip() for h in table.locator("thead th").all()]
    cells = [c.inner_text().strip() for c in row.locator("td").all()]
    return dict(zip(names, cells, strict=True))


def test_the_jobs_page_names_a_running_job_and_shows_no_queued_one(tmp_path, ray_cluster):
    root = str(tmp_path / "storage")
    gate = tmp_path / "gate"
    running = push(sweep_job(tmp_path / "a", "sweep-lr-1", GATED.format(gate=gate)),
                   storage_root=root)  # fmt: skip
    queued = push(sweep_job(tmp_path / "b", "sweep-lr-2", "echo ran"), storage_root=root)
    try:
        eventually(lambda: running.status() == JobState.RUNNING, "the first job to run", 90)
        eventually(lambda: queued.status() == JobState.PENDING, "the second to wait", 30)
        client = JobSubmissionClient(ray_cluster.dashboard_url)
        info = client.get_job_info(running.id)
        assert info.metadata["job_name"] == "dash-demo/sweep-lr-1"
        assert info.metadata["orchestrator_team"] == "vision"
        # Waiting in our queue is not a Ray job: nothing the dashboard would call RUNNING.
        assert queued.id not in {j.submission_id for j in client.list_jobs()}

        with chromium() as browser:
            context = browser.new_context(viewport={"width": 1600, "height": 900})
            # What the dashboard keeps once a person has pasted the cluster's token into it.
            token = Path(ray_cluster.token_file).read_text()
            context.add_cookies([{"name": "ray-authentication-token", "value": token,
                                  "url": ray_cluster.dashboard_url}])  # fmt: skip
            page = context.new_page()
            page.goto(f"{ray_cluster.dashboard_url}/#/jobs")
            row = page.locator("tbody tr", has_text=running.id)
            row.wait_for(timeout=30_000)
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=ARTIFACTS / "dashboard-jobs.png", full_page=True)
            shown = columns(row)
            assert shown["Name"] == "dash-demo/sweep-lr-1"
            assert shown["Submission ID"] == running.id
            assert shown["Status"] == "RUNNING"
            # What the user's job runs comes first, before the column cuts it.
            assert shown["Entrypoint"].startswith(": 'dash-demo/sweep-lr-1: python -c "), shown
            assert page.locator("tbody tr", has_text="sweep-lr-2").count() == 0
            # The Name filter finds it by project, and drops it for another name.
            name_filter = page.get_by_label("Name", exact=True)
            name_filter.fill("dash-demo/")
            assert row.is_visible()
            name_filter.fill("dash-demo/sweep-lr-9")
            row.wait_for(state="detached", timeout=10_000)

            # `view`'s link opens the job's own page.
            assert running.dashboard_url == f"{ray_cluster.dashboard_url}/#/jobs/{running.id}"
            page.goto(running.dashboard_url)
            page.get_by_text("Submission ID").first.wait_for(timeout=30_000)
            body = page.inner_text("body")
            assert running.id in body and "RUNNING" in body
            page.screenshot(path=ARTIFACTS / "dashboard-job.png", full_page=True)
    finally:
        gate.touch()
        queued.stop(timeout=60)
    assert running.wait(timeout=60) == JobState.COMPLETED


def record(name: str | None, commands: list[str]) -> JobRecord:
    spec = d.TrainingProject(
        name="p", job=d.TrainingJob(name=name, image=d.Image(base_image="x"),
                                    runtime=d.Runtime(start_commands=commands)),
    )  # fmt: skip
    archive = ArchiveRef(path="a.tar", sha256="x", size_bytes=1, file_count=1, config_dir=".")
    return JobRecord(job_id="jabc", project="p", job_name=name, created_at=time.time(),
                     spec=spec, archive=archive, storage_root="r")  # fmt: skip


@pytest.mark.parametrize(
    ("name", "commands", "comment"),
    [
        ("n", ["python train.py", "echo done"], "p/n: python train.py && echo done"),
        (None, ["python -c 'a\nb'\n"], "p/jabc: python -c 'a b'"),
    ],
)
def test_the_entrypoint_says_what_the_job_runs_on_one_line(name, commands, comment):
    assert runs_comment(record(name, commands)) == comment


def test_a_long_start_command_is_cut_in_the_entrypoint():
    comment = runs_comment(record("n", ["x" * 1000]))
    assert len(comment) == 300 and comment.endswith("...") and "\n" not in comment


def test_the_entrypoint_runs_the_controller_and_nothing_of_the_words_shown(tmp_path, monkeypatch):
    """What is shown is quoted for the shell that runs the entrypoint: never run, never expanded."""
    marker = tmp_path / "ran"
    commands = [f"echo $(touch {marker}) `touch {marker}` \"$HOME\" 'it''s' ; touch {marker}"]
    monkeypatch.setenv("ORCHESTRATOR_PYTHON", "echo")  # the controller's interpreter, as echo
    entrypoint = controller_entrypoint(
        "j1", StorageRoot(tmp_path / "root"), SimpleNamespace(embedded=True),
        runs_comment(record("n", commands)),
    )  # fmt: skip
    shell = subprocess.run(["/bin/sh", "-c", entrypoint], capture_output=True, text=True)
    assert shell.returncode == 0, shell.stderr
    assert shell.stdout.startswith("-m orchestrator.controller --job-id j1 --storage-root ")
    assert not marker.exists()

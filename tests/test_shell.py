"""`orchestrator shell`: an interactive shell on a real PTY (through Ray Client), and one command
(through the Job API), inside a running job."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pexpect
import psutil
import pytest
from conftest import NODE_SECRET_NAME, NODE_SECRET_VALUE, attach, eventually, make_job

from orchestrator.client.api import push
from orchestrator.client.audit import events
from orchestrator.lifecycle import JobState

pytestmark = pytest.mark.usefixtures("ray_cluster")

CONFIG = f"""
from orchestrator import definitions as d
project = d.TrainingProject(
    name="shell",
    job=d.TrainingJob(
        image=d.Image(base_image="python:3.11"),
        compute=d.Compute(memory="512Mi"),
        runtime=d.Runtime(
            start_commands=["python train.py"],
            environment_variables={{"API_TOKEN": d.SecretReference(name="{NODE_SECRET_NAME}"),
                                    "LR": "0.1"}},
            checkpointing_config=d.CheckpointingConfig(enabled=True),
        ),
    ),
)
"""

TRAIN = """
import os, pathlib, time
(pathlib.Path(os.environ["BT_CHECKPOINT_DIR"]) / "note.txt").write_text("written by the job")
print("up", flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def running_job(ray_cluster, tmp_path_factory):
    """One job for the module: it writes a file into its checkpoint dir and waits to be stopped."""
    tmp = tmp_path_factory.mktemp("shell")
    storage_root = str(tmp / "storage")
    job = push(make_job(tmp / "job", CONFIG, {"train.py": TRAIN}), storage_root=storage_root)
    eventually(
        lambda: any(line.endswith("] up") for line in job.logs()), "the job's first line", 60
    )
    yield job, storage_root
    if not job.status().is_terminal:
        job.stop()


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_an_interactive_shell_is_a_real_terminal_in_the_job(running_job):
    job, storage_root = running_job
    terminal = attach(job, storage_root)
    terminal.sendline("tty; stty size; echo lr=$LR token=$API_TOKEN; pwd")
    terminal.expect(r"/dev/pts/\d+")
    terminal.expect_exact("33 101")  # the laptop's window size
    terminal.expect_exact("lr=0.1 token=*****")  # resolved on the node, masked on the way out
    terminal.expect_exact(job.details().nodes[0].working_dir)
    terminal.expect_exact("orch> ")

    terminal.setwinsize(40, 120)  # the window is resized: the shell's programs see the new size
    deadline = time.monotonic() + 30
    while True:
        terminal.sendline("stty size")
        if terminal.expect_exact(["40 120", "33 101"]) == 0:
            break
        assert time.monotonic() < deadline, "the new window size never reached the node"

    # Ctrl-C interrupts the foreground program, not the shell.
    terminal.sendline("echo started-$((2+3)); sleep 300; echo not-interrupted")
    terminal.expect_exact("started-5")
    terminal.sendcontrol("c")
    terminal.expect_exact("orch> ", timeout=30)
    terminal.sendline("echo rc=$?")
    terminal.expect_exact("rc=130")

    # A background job left behind does not keep the session open, nor outlive it.
    terminal.sendline("sleep 1000 & echo bg=$!")
    terminal.expect(r"bg=(\d+)")
    background = int(terminal.match.group(1))
    terminal.sendline("exit 7")
    terminal.expect(pexpect.EOF)
    terminal.close()
    assert terminal.exitstatus == 7
    eventually(lambda: gone(background), "the shell's background job to end", 30)
    output = terminal.logfile_read.getvalue().decode(errors="replace")
    assert "\nnot-interrupted" not in output  # (the echoed command line has it)
    assert NODE_SECRET_VALUE not in output


def test_a_shell_whose_client_is_gone_ends_with_everything_it_started(running_job):
    job, storage_root = running_job
    terminal = attach(job, storage_root, ORCHESTRATOR_TERMINAL_LOST_S="3")
    terminal.sendline("sleep 1000 & echo pids=$!,$$")
    terminal.expect(r"pids=(\d+),(\d+)")
    pids = [int(pid) for pid in terminal.match.groups()]
    assert all(psutil.pid_exists(pid) for pid in pids)
    terminal.kill(signal.SIGKILL)  # the laptop vanishes without a word
    terminal.close()

    eventually(lambda: all(gone(pid) for pid in pids), "the abandoned shell to end", 30)
    assert not job.status().is_terminal  # the job itself runs on


def shell(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchestrator", "shell", *args],
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_a_command_runs_in_the_job_with_its_files_and_environment(running_job):
    """Runs last: it stops the module's job."""
    job, storage_root = running_job
    try:
        command = ("cat $BT_CHECKPOINT_DIR/note.txt; echo; echo lr=$LR token=$API_TOKEN; pwd; "
                   "exit 3")  # fmt: skip
        result = shell("--job-id", job.id, "--storage-root", storage_root, "--", command)
        assert result.returncode == 3, result.stderr
        lines = result.stdout.splitlines()
        assert lines[0] == "written by the job"
        assert lines[1] == "lr=0.1 token=*****"  # resolved on the node, masked on the way out
        assert lines[2] == job.details().nodes[0].working_dir
        assert NODE_SECRET_VALUE not in result.stdout + result.stderr

        missing = shell("--job-id", job.id, "--rank", "3", "--storage-root", storage_root,
                        "--", "true")  # fmt: skip
        assert missing.returncode == 1 and "has no rank 3" in missing.stderr
        slow = shell("--job-id", job.id, "--timeout", "1", "--storage-root", storage_root,
                     "--", "echo started; sleep 30")  # fmt: skip
        assert slow.returncode == 124 and slow.stdout == "started\n"  # killed, as timeout(1)
    finally:
        assert job.stop() == JobState.STOPPED
    ended = shell("--job-id", job.id, "--storage-root", storage_root, "--", "true")
    assert ended.returncode == 1 and "has ended (STOPPED)" in ended.stderr

    # The audit trail: the push, each command (not its text), the stop; nothing for the refused
    # shell into the ended job, which changed nothing.
    trail = [
        (e.verb, e.result.split(":")[0], e.detail)
        for e in events(job=job.id, storage_root=storage_root)
        if e.detail is None or "terminal" not in e.detail
    ]
    assert trail == [
        ("push", "ok", None), ("shell", "ok", "command, rank 0, exit 3"),
        ("shell", "failed", "command, rank 3"), ("shell", "ok", "command, rank 0, exit 124"),
        ("stop", "ok", "ended STOPPED"),
    ], trail  # fmt: skip
    stored = "".join(p.read_text() for p in Path(storage_root, "audit").rglob("*.json"))
    assert "note.txt" not in stored and NODE_SECRET_VALUE not in stored

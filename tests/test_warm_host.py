"""The warm controller host and its stand-in, without Ray: what a controller forked from the host
sees and how it ends must be what a cold start would give it, through Ray's `ray job stop`
(SIGTERM, then SIGKILL of the entrypoint's process group) as through a normal end; and with no
host, or a command it does not take, the stand-in runs the command cold."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest
from conftest import eventually

from orchestrator.scheduler import warm_host
from orchestrator.scheduler.warm_host import STAND_IN

PROBE = """
import os, signal, sys, time
from pathlib import Path
out = Path(os.environ["PROBE_DIR"])
(out / "pid").write_text(str(os.getpid()))
print("probe", sys.argv[1:], os.getcwd(), os.environ["PROBE_VALUE"], flush=True)
def flush(signum, _frame):
    print("flushed on", signum, flush=True)
    sys.exit(3)
signal.signal(signal.SIGTERM, flush)
if sys.argv[1] == "wait":
    (out / "waiting").write_text("")
    time.sleep(60)
if sys.argv[1] == "abort":
    os.abort()
sys.exit(int(sys.argv[2]))
"""


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    """A package `warm_probe` whose __main__ acts as a controller would."""
    package = tmp_path / "lib" / "warm_probe"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(PROBE)
    return package.parent


@pytest.fixture
def host(probe: Path):
    """A host that forks `python -m warm_probe`; stopped (by its handle) at the end."""
    address = f"@orchestrator-test-{uuid.uuid4().hex[:12]}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(probe), *sys.path])}
    process = subprocess.Popen([sys.executable, "-m", warm_host.__name__, address, "warm_probe"],
                               env=env, stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert process.stderr is not None
    assert "ready" in process.stderr.readline()
    yield address, process
    process.terminate()
    process.wait(10)


def stand_in(address: str, tmp_path: Path, *args: str, command: list[str] | None = None,
             **popen) -> subprocess.Popen:  # fmt: skip
    """The admitted job's entrypoint as the launcher writes it, started as Ray starts one."""
    command = command or [sys.executable, "-m", "warm_probe", *args]
    env = {**os.environ, "PROBE_DIR": str(tmp_path), "PROBE_VALUE": "from-the-job",
           "PYTHONPATH": str(tmp_path / "lib")}  # fmt: skip
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return subprocess.Popen(
        [sys.executable, "-S", str(STAND_IN), address, "--", *command], env=env, cwd=work,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        **popen,
    )  # fmt: skip


def forked_by(host: subprocess.Popen, tmp_path: Path) -> bool:
    pid = int((tmp_path / "pid").read_text())
    return psutil.Process(pid).ppid() == host.pid


def test_a_forked_controller_gets_the_jobs_output_environment_and_directory_and_its_code(
    host, tmp_path
):
    address, process = host
    run = stand_in(address, tmp_path, "exit", "7")
    out, _ = run.communicate(timeout=30)
    assert run.returncode == 7
    assert out.strip() == f"probe ['exit', '7'] {tmp_path / 'work'} from-the-job"
    pid = int((tmp_path / "pid").read_text())
    assert pid not in (run.pid, process.pid) and not psutil.pid_exists(pid)


def test_ray_job_stop_reaches_the_forked_controller_and_its_kill_ends_it(host, tmp_path):
    address, process = host
    # SIGTERM to the entrypoint's group: relayed, the controller flushes and ends with its code.
    run = stand_in(address, tmp_path, "wait")
    eventually(lambda: (tmp_path / "waiting").exists(), "the probe to wait", 30)
    assert forked_by(process, tmp_path)  # warm: a child of the host, not of the stand-in
    os.killpg(run.pid, signal.SIGTERM)
    out, _ = run.communicate(timeout=30)
    assert "flushed on 15" in out and run.returncode == 3

    # SIGKILL of the group (Ray's stop after its grace): the controller dies with its stand-in.
    (tmp_path / "waiting").unlink()
    run = stand_in(address, tmp_path, "wait")
    eventually(lambda: (tmp_path / "waiting").exists(), "the probe to wait", 30)
    pid = int((tmp_path / "pid").read_text())
    os.killpg(run.pid, signal.SIGKILL)
    run.wait(10)
    eventually(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie",
               "the forked controller to die with its stand-in", 10)  # fmt: skip


def test_the_interpreter_under_another_name_of_the_same_environment_runs_warm(host, tmp_path):
    """Ray's workers may run `python3` where the job names `python`: one venv, one interpreter."""
    address, process = host
    here = Path(sys.executable)
    other = next(p for p in sorted(here.parent.glob("python*"))
                 if p.name != here.name and p.resolve() == here.resolve())  # fmt: skip
    run = stand_in(address, tmp_path, "wait", command=[str(other), "-m", "warm_probe", "wait"])
    eventually(lambda: (tmp_path / "waiting").exists(), "the probe to wait", 30)
    assert forked_by(process, tmp_path)
    os.killpg(run.pid, signal.SIGTERM)
    assert run.wait(30) == 3


def test_a_controller_that_dies_of_a_signal_takes_its_stand_in_with_it(host, tmp_path):
    address, _ = host
    run = stand_in(address, tmp_path, "abort")
    run.communicate(timeout=30)
    assert run.returncode == -signal.SIGABRT


def test_without_a_host_or_for_another_command_the_stand_in_runs_it_cold(host, tmp_path):
    address, _ = host
    other = [sys.executable, "-c", "import os; print('cold', os.getppid())"]
    run = stand_in(address, tmp_path, command=other)
    out, _ = run.communicate(timeout=30)
    assert run.returncode == 0 and out.split() == ["cold", str(os.getpid())]  # exec'd in place

    run = stand_in("@orchestrator-test-nobody-listens", tmp_path, "exit", "0")
    out, _ = run.communicate(timeout=30)
    assert run.returncode == 0 and out.startswith("probe ['exit', '0']")
    assert int((tmp_path / "pid").read_text()) == run.pid  # exec'd in place, not forked


def test_the_host_ends_with_the_service_that_started_it_and_its_controllers_run_on(probe, tmp_path):
    """The service's process dies (Ray restarts it): its host goes, a running controller stays."""
    address = f"@orchestrator-test-{uuid.uuid4().hex[:12]}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(probe), *sys.path])}
    log = tmp_path / "host.log"
    service = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; "
         "subprocess.Popen(sys.argv[2:], stderr=open(sys.argv[1], 'w')); time.sleep(300)",
         str(log), sys.executable, "-m", warm_host.__name__, address, "warm_probe"],
        env=env,
    )  # fmt: skip
    try:
        eventually(lambda: log.exists() and "ready" in log.read_text(), "the host to listen", 30)
        host = psutil.Process(service.pid).children()[0]
        run = stand_in(address, tmp_path, "wait")
        eventually(lambda: (tmp_path / "waiting").exists(), "the probe to wait", 60)
        controller = psutil.Process(int((tmp_path / "pid").read_text()))
        assert controller.ppid() == host.pid
        service.kill()
        service.wait(10)
        eventually(lambda: not host.is_running() or host.status() == "zombie",
                   "the host to end with its service", 10)  # fmt: skip
        assert controller.is_running() and run.poll() is None
        os.killpg(run.pid, signal.SIGTERM)
        run.communicate(timeout=30)
        eventually(lambda: not controller.is_running() or controller.status() == "zombie",
                   "the controller to end", 10)  # fmt: skip
    finally:
        if service.poll() is None:
            service.kill()
            service.wait(10)

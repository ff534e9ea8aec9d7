"""The warm controller host and its stand-in, without Ray: what a controller forked from the host
sees and how it ends must be what a cold start would give it, through Ray's `ray job stop`
(SIGTERM, then SIGKILL of the entrypoint's process group) as through a normal end; and with no
host, or one that does not take it, the process goes on as a cold controller.

The probe is a package whose `__main__` starts as the controller's does (`hand_over_or_return`),
so these tests run the real hand-over, not a copy of it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest
from conftest import eventually, make_job, simulated_cluster
from ray.job_submission import JobSubmissionClient

from orchestrator import settings
from orchestrator.client.api import push
from orchestrator.lifecycle import JobState
from orchestrator.scheduler import warm_host, warm_start

PROBE = """
from orchestrator.scheduler.warm_start import hand_over_or_return
hand_over_or_return(__spec__.parent)
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
    """Packages `warm_probe` and `other_probe` whose __main__ act as a controller would."""
    for name in ("warm_probe", "other_probe"):
        package = tmp_path / "lib" / name
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "__main__.py").write_text(PROBE)
    return tmp_path / "lib"


def a_cluster() -> str:
    """A made-up cluster's GCS address (the host's socket is named by its port)."""
    return f"127.0.0.1:{uuid.uuid4().int % 50000 + 10000}"


def host_command(gcs: str) -> list[str]:
    """The host of that cluster, forking `python -m warm_probe`."""
    return [sys.executable, "-m", warm_host.__name__, warm_start.address_for(gcs), "warm_probe"]


def with_probe(probe: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(probe), *sys.path])}


@pytest.fixture
def host(probe: Path):
    """A host for a made-up cluster; stopped (by its handle) at the end."""
    gcs = a_cluster()
    process = subprocess.Popen(host_command(gcs), env=with_probe(probe), stderr=subprocess.PIPE,
                               text=True)  # fmt: skip
    assert process.stderr is not None
    assert "ready" in process.stderr.readline()
    yield gcs, process
    process.terminate()
    process.wait(10)


def entrypoint(gcs: str, tmp_path: Path, *args: str, module: str = "warm_probe",
               python: str = sys.executable) -> subprocess.Popen:  # fmt: skip
    """`python -m <module> ARGS`, started as Ray's job supervisor starts an entrypoint."""
    env = {**with_probe(tmp_path / "lib"), "PROBE_DIR": str(tmp_path), "RAY_ADDRESS": gcs,
           "PROBE_VALUE": "from-the-job"}  # fmt: skip
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return subprocess.Popen(
        [python, "-m", module, *args], env=env, cwd=work, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip


def probe_pid(tmp_path: Path) -> int:
    return int((tmp_path / "pid").read_text())


def gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"


def test_a_forked_controller_gets_the_jobs_output_environment_and_directory_and_its_code(
    host, tmp_path
):
    gcs, process = host
    run = entrypoint(gcs, tmp_path, "exit", "7")
    out, _ = run.communicate(timeout=30)
    assert run.returncode == 7
    assert out.strip() == f"probe ['exit', '7'] {tmp_path / 'work'} from-the-job"
    assert probe_pid(tmp_path) not in (run.pid, process.pid)  # forked: another process
    eventually(lambda: gone(probe_pid(tmp_path)), "the controller's process to end", 10)


def test_ray_job_stop_reaches_the_forked_controller_and_its_kill_ends_it(host, tmp_path):
    gcs, process = host
    # SIGTERM to the entrypoint's group: relayed, the controller flushes and ends with its code.
    run = entrypoint(gcs, tmp_path, "wait")
    eventually(lambda: (tmp_path / "waiting").exists(), "the probe to wait", 30)
    assert psutil.Process(probe_pid(tmp_path)).ppid() == process.pid  # forked by the host
    os.killpg(run.pid, signal.SIGTERM)
    out, _ = run.communicate(timeout=30)
    assert "flushed on 15" in out and run.returncode == 3

    # SIGKILL of the group (Ray's stop after its grace): the controller dies with its stand-in.
    (tmp_path / "waiting").unlink()
    run = entrypoint(gcs, tmp_path, "wait")
    eventually(lambda: (tmp_path / "waiting").exists(), "the probe to wait", 30)
    pid = probe_pid(tmp_path)
    assert pid != run.pid
    os.killpg(run.pid, signal.SIGKILL)
    run.wait(10)
    eventually(lambda: gone(pid), "the forked controller to die with its stand-in", 10)


def test_the_interpreter_under_another_name_of_the_same_environment_runs_warm(host, tmp_path):
    """Ray's workers may run `python3` where the job names `python`: one venv, one interpreter."""
    gcs, process = host
    here = Path(sys.executable)
    other = next(p for p in sorted(here.parent.glob("python*"))
                 if p.name != here.name and p.resolve() == here.resolve())  # fmt: skip
    run = entrypoint(gcs, tmp_path, "wait", python=str(other))
    eventually(lambda: (tmp_path / "waiting").exists(), "the probe to wait", 30)
    assert psutil.Process(probe_pid(tmp_path)).ppid() == process.pid
    os.killpg(run.pid, signal.SIGTERM)
    assert run.wait(30) == 3


def test_a_controller_that_dies_of_a_signal_takes_its_stand_in_with_it(host, tmp_path):
    gcs, _ = host
    run = entrypoint(gcs, tmp_path, "abort")
    run.communicate(timeout=30)
    assert run.returncode == -signal.SIGABRT


def test_without_a_host_or_for_another_module_the_process_goes_on_cold(host, tmp_path):
    gcs, _ = host
    for where, module in ((gcs, "other_probe"), (a_cluster(), "warm_probe")):  # one at a time
        run = entrypoint(where, tmp_path, "exit", "0", module=module)
        out, _ = run.communicate(timeout=30)
        assert run.returncode == 0 and out.startswith("probe ['exit', '0']")
        assert probe_pid(tmp_path) == run.pid  # in its own process


def test_the_host_ends_with_the_service_that_started_it_and_its_controllers_run_on(probe, tmp_path):
    """The service's process dies (Ray restarts it): its host goes, a running controller stays."""
    gcs, log = a_cluster(), tmp_path / "host.log"
    service = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; "
         "subprocess.Popen(sys.argv[2:], stderr=open(sys.argv[1], 'w')); time.sleep(300)",
         str(log), *host_command(gcs)],
        env=with_probe(probe),
    )  # fmt: skip
    try:
        eventually(lambda: log.exists() and "ready" in log.read_text(), "the host to listen", 30)
        host = psutil.Process(service.pid).children()[0]
        run = entrypoint(gcs, tmp_path, "wait")
        eventually(lambda: (tmp_path / "waiting").exists(), "the probe to wait", 60)
        controller = psutil.Process(probe_pid(tmp_path))
        assert controller.ppid() == host.pid
        service.kill()
        service.wait(10)
        eventually(lambda: gone(host.pid), "the host to end with its service", 10)
        assert controller.is_running() and run.poll() is None
        os.killpg(run.pid, signal.SIGTERM)
        run.communicate(timeout=30)
        eventually(lambda: gone(controller.pid), "the controller to end", 10)
    finally:
        if service.poll() is None:
            service.kill()
            service.wait(10)


# --- on a Ray cluster ---------------------------------------------------------------------------

WAIT = (
    "python -c \"import pathlib, time\nwhile not pathlib.Path('{gate}').exists(): time.sleep(0.1)\""
)


def one_node_job(directory: Path, command: str) -> Path:
    return make_job(directory, f"""
        from truss_train import definitions as d
        project = d.TrainingProject(name="warm", job=d.TrainingJob(
            image=d.Image(base_image="python:3.11"),
            compute=d.Compute(node_count=1, cpu_count=1, memory="128Mi"),
            runtime=d.Runtime(start_commands=[{command!r}]),
        ))
        """)  # fmt: skip


@pytest.fixture
def warm_cluster(orchestrator_home, monkeypatch):
    """A cluster whose head runs warm controllers (ORCHESTRATOR_WARM_CONTROLLERS in the
    environment its processes start with), each its own Ray job (the warm host forks those)."""
    monkeypatch.setenv(settings.WARM_CONTROLLERS.name, "1")
    monkeypatch.setenv(settings.CONTROLLERS.name, "ray-job")
    cluster, address = simulated_cluster()
    try:
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        yield address
    finally:
        cluster.shutdown()


@pytest.mark.cluster  # warm_cluster starts a Ray cluster of its own
def test_a_controller_started_through_the_queue_runs_forked_and_stops_as_a_cold_one(
    warm_cluster, tmp_path
):
    address, root = warm_cluster, str(tmp_path / "storage")
    first = push(one_node_job(tmp_path / "first", "echo first"), address=address,
                 storage_root=root)  # fmt: skip
    assert first.wait(timeout=120) == JobState.COMPLETED  # cold: it starts the queue service
    gate = tmp_path / "gate"
    job = push(one_node_job(tmp_path / "second", WAIT.format(gate=gate)), address=address,
               storage_root=root)  # fmt: skip
    try:
        eventually(lambda: job.status() == JobState.RUNNING, "the second job to run", 60)
        info = JobSubmissionClient(address).get_job_info(job.id)
        # As cold: what the job runs, then the controller's command, exec'd by Ray's shell.
        shown, command = info.entrypoint.split("; exec ")
        assert shown.startswith(": 'warm/")
        assert command.split()[1:3] == ["-m", "orchestrator.controller"]
        controller = psutil.Process(int(info.driver_info.pid))
        assert "orchestrator.scheduler.warm_host" in controller.parent().cmdline()
        assert job.stop(timeout=60) == JobState.STOPPED  # `ray job stop`: relayed, recorded
        assert any("STOPPED" in line for line in job.logs())
        eventually(lambda: gone(controller.pid), "the controller's process to end", 30)
    finally:
        gate.touch()

"""`orchestrator shell -- CMD` in a rank's container, with real podman and no Ray: the node's
shell service (agents/job_shell_service.py) against a container started as the node starts a
rank's commands (podman.run_argv, the environment on stdin)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import images
import pytest
from conftest import eventually

from orchestrator.agents.job_shell_service import JobShellService
from orchestrator.node import podman
from orchestrator.node.rank_runtime import InContainer
from orchestrator.node.secrets import SecretMasker

# The main command waits for /tmp/go inside, then ends, and the container with it (--rm).
WAITS_FOR_GO = "while [ ! -e /tmp/go ]; do sleep 0.01; done"


@pytest.fixture
def rank_container(tmp_path: Path) -> Iterator[tuple[podman.Container, subprocess.Popen]]:
    if shutil.which("podman") is None or not Path("/bin/busybox").exists():
        pytest.fail("podman or /bin/busybox missing: run tests/install-system.sh")
    image = images.busybox_image(tmp_path / "image")
    node = tmp_path / "node"
    node.mkdir()
    container = podman.Container(
        name=f"orchestrator-shell-test-{uuid.uuid4().hex[:8]}", image=image,
        status_file=str(node / "failed"), binds=((str(node), str(node)),),
    )  # fmt: skip
    main = subprocess.Popen(
        podman.run_argv(container, str(node), (WAITS_FOR_GO,)), stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    main.stdin.write(podman.environment_script({"GREETING": "hello"}))
    main.stdin.close()
    try:
        eventually(lambda: podman.exists(container.name, "container"), "the container", 60)
        yield container, main
    finally:
        subprocess.run(podman.remove_argv(container.name), capture_output=True, timeout=60)
        main.wait(timeout=60)


def _service(container: podman.Container) -> JobShellService:
    service = JobShellService(rank=0)
    node = str(Path(container.status_file).parent)
    service.commands_started({"GREETING": "hello"}, node, SecretMasker([]), InContainer(container))
    return service


def _podman_losing_the_race(directory: Path) -> str:
    """A PATH whose `podman` runs the real one, then, for an exec, fails as podman does when
    the container ends while it collects the exec's exit code (seen 2 times in 25 on this
    machine, once in CI): the command ran, podman says the container went away."""
    real = shutil.which("podman")
    wrapper = directory / "podman"
    wrapper.write_text(f"""#!/bin/sh
"{real}" "$@"
code=$?
for arg in "$@"; do
    if [ "$arg" = exec ]; then
        echo "Error: container has already been removed" >&2
        exit 255
    fi
done
exit $code
""")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return f"{directory}:{os.environ['PATH']}"


def test_a_command_that_ends_the_container_reports_its_own_exit_code(
    rank_container, tmp_path, monkeypatch
):
    """`touch /tmp/go` ends the job's loop, so the container ends as the command does; podman
    can then fail the exec. The command ran and succeeded: that is what the user gets."""
    container, main = rank_container
    service = _service(container)
    monkeypatch.setenv("PATH", _podman_losing_the_race(tmp_path))
    result = service.exec("touch /tmp/go", timeout_s=60)
    assert result.exit_code == 0, result.output
    assert main.wait(timeout=60) == 0  # the job's command saw the file and ended
    assert list(Path(container.status_file).parent.glob("shell-*")) == []  # nothing left


def test_a_command_reports_its_exit_code_and_output_in_the_job_environment(rank_container):
    container, _ = rank_container
    service = _service(container)
    result = service.exec('echo "$GREETING from $(hostname)"; exit 3', timeout_s=60)
    assert (result.exit_code, result.output.split()[:2]) == (3, ["hello", "from"])


def test_a_command_killed_with_the_container_is_not_reported_a_success(rank_container):
    """The command ends the job's loop and goes on: the container's end kills it, so it has
    no exit code of its own; podman's (not 0) is reported, and promptly."""
    container, main = rank_container
    service = _service(container)
    started = time.monotonic()
    result = service.exec("touch /tmp/go; sleep 30; echo never", timeout_s=60)
    assert result.exit_code != 0 and "never" not in result.output
    assert time.monotonic() - started < 25
    assert main.wait(timeout=60) == 0

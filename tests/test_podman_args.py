"""The podman command lines and the environment a container's shell sources (node/podman.py),
without podman: what reaches a command line, and what the shell makes of any value."""

from __future__ import annotations

import subprocess

import pytest

from orchestrator.node import podman

UNTIDY = ["it's", 'say "hi"', "$HOME `id` $(id)", "two\nlines", "", "trailing\\", "ünï"]


@pytest.mark.parametrize("value", UNTIDY)
def test_a_value_reaches_the_command_exactly_and_nothing_in_it_runs(value, tmp_path):
    script = podman.environment_script({"X": value, "BT_NODE_RANK": "0"})
    shell = subprocess.run(
        ["/bin/sh", "-c", '. /dev/stdin && exec /bin/sh -c "$1"', "orchestrator",
         'printf %s "$X"'],
        input=script, capture_output=True, cwd=tmp_path,
    )  # fmt: skip
    assert shell.returncode == 0, shell.stderr
    assert shell.stdout.decode() == value


def test_the_command_line_names_the_image_limits_and_binds_but_no_value(monkeypatch):
    monkeypatch.setenv("ORCHESTRATOR_PODMAN_ARGS", "--runtime runc")
    container = podman.Container(
        name="orchestrator-j1-rank-0", image="pytorch/pytorch:2.7.1", status_file="/n/j1/failed",
        binds=(("/n/j1", "/n/j1"), ("/cache/set", "/models/base")), read_only=("/models/base",),
        memory_bytes=2 << 30, cpus=4,
    )  # fmt: skip
    argv = podman.run_argv(container, "/n/j1/workspace", ("pip install x", "python train.py"))
    assert argv[:4] == ["podman", "--runtime", "runc", "run"]
    joined = " ".join(argv)
    for part in ("--network host", "--init", "--memory 2147483648", "--cpus 4",
                 "--volume /n/j1:/n/j1:rw", "--volume /cache/set:/models/base:ro",
                 "--workdir /n/j1/workspace", "--name orchestrator-j1-rank-0"):  # fmt: skip
        assert part in joined
    assert argv[-2:] == ["pip install x", "python train.py"]
    assert not any(a.startswith(("-e", "--env")) for a in argv)  # the environment goes by stdin


def test_the_container_shell_runs_commands_in_order_and_names_the_one_that_failed(tmp_path):
    entry = podman.run_argv(
        podman.Container(name="n", image="i", status_file=str(tmp_path / "failed")), "/", ()
    )[-5:-1]  # /bin/sh -c ENTRY orchestrator, without podman
    status = str(tmp_path / "failed")
    shell = subprocess.run(
        [*entry, status, "echo one", "exit 7", "echo never"],
        input=b"", capture_output=True, cwd=tmp_path,
    )  # fmt: skip
    assert shell.returncode == 7 and shell.stdout == b"one\n"
    assert podman.failed_command(status) == (1, 0)  # no memory kill (or no cgroup) here


def test_a_shell_command_past_its_timeout_is_found_even_if_it_started_after(tmp_path):
    """podman can start the command after a short timeout has expired: its pid, written late,
    is waited for, so what ends it is still known (else it would run on in the container)."""
    import threading

    shell = podman.ShellCommand(["podman", "exec"], "orchestrator-j1-rank-0", False,
                                tmp_path / "shell.pid", tmp_path / "shell.exit")  # fmt: skip
    threading.Timer(0.5, lambda: shell.pid_file.write_text("42\n")).start()
    argv = podman.end_shell_argv(shell, wait_s=5)
    assert argv is not None and argv[-1] == "42" and "orchestrator-j1-rank-0" in argv
    never = podman.ShellCommand(["podman", "exec"], "n", False, tmp_path / "never.pid",
                                tmp_path / "never.exit")  # fmt: skip
    assert podman.end_shell_argv(never, wait_s=0.2) is None  # it never ran: nothing to end
    own = podman.ShellCommand(["podman", "run"], "n-shell-1", True, tmp_path / "own.pid",
                              tmp_path / "own.exit")  # fmt: skip
    assert podman.end_shell_argv(own)[-1] == "n-shell-1"  # its own container: removed


@pytest.mark.parametrize("command, code", [("echo out; exit 3", 3), ("echo out", 0),
                                           ("echo out; kill -KILL $$", 137)])  # fmt: skip
def test_a_shell_command_leaves_its_exit_code_where_podman_cannot_lose_it(command, code, tmp_path):
    """The shell command's wrapper (here without podman) writes the command's pid, then its
    exit code, into files the node reads: podman's own code can be an error of its own when the
    container ends as the command does (test_container_shell.py)."""
    shell = podman.ShellCommand([], "n", False, tmp_path / "s.pid", tmp_path / "s.exit")
    argv = podman.shell_wrapper(command, shell.pid_file, shell.exit_file)
    ran = subprocess.run(argv, input=podman.environment_script({"X": "1"}), capture_output=True)
    assert ran.returncode == code and ran.stdout == b"out\n"
    assert int(shell.pid_file.read_text()) > 1
    assert shell.exit_code(podman_code=255) == code  # podman said the container went away
    shell.forget()
    assert shell.exit_code(podman_code=255) == 255  # no file: podman's code is all there is
    assert not shell.pid_file.exists()


def test_a_shell_command_whose_exit_file_cannot_be_written_says_nothing_of_it(tmp_path):
    """The command removed the node's directory (or it is read-only): its code still comes
    back as its shell's, and its output holds nothing of ours."""
    gone = tmp_path / "gone"
    argv = podman.shell_wrapper("echo out; exit 3", tmp_path / "s.pid", gone / "s.exit")
    ran = subprocess.run(argv, input=b"", capture_output=True)
    assert (ran.returncode, ran.stdout, ran.stderr) == (3, b"out\n", b"")

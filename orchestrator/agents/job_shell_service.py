"""`orchestrator shell` on a node: one command, or a terminal, run as the job's commands run.

Both get the environment (secrets included), the directory and the masker the job's commands
started with on this node, so what a user types sees what the training sees, and output never
shows a secret's value.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

from orchestrator.agents.messages import ShellResult
from orchestrator.node import podman
from orchestrator.node.secrets import SecretMasker
from orchestrator.node.terminal import Terminals

SHELL_TIMEOUT_EXIT = 124  # as timeout(1)
SHELL_OUTPUT_BYTES = 8 * 2**20  # the end of a longer output is kept


class JobShellService:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._job: tuple[dict[str, str], str, SecretMasker] | None = None
        self._container: podman.Container | None = None
        self.terminals = Terminals()

    def commands_started(
        self, env: dict[str, str], cwd: str, mask: SecretMasker,
        container: podman.Container | None = None,
    ) -> None:  # fmt: skip
        """What the job's commands run with, from now on what every shell runs with; in their
        container where they run in one (or, once it ended, a new one like it)."""
        self._job = (env, cwd, mask)
        self._container = container

    def _started(self) -> tuple[dict[str, str], str, SecretMasker]:
        if self._job is None:
            raise RuntimeError(f"the job's commands have not started on rank {self.rank} yet")
        return self._job

    def exec(self, command: str, timeout_s: float) -> ShellResult:
        """Run one shell command; its exit code (124 when it ran past `timeout_s`) and output,
        secrets masked."""
        env, cwd, mask = self._started()
        script: bytes | None = None  # in the rank's container: its environment on stdin
        shell: podman.ShellCommand | None = None
        if self._container is not None:
            script = podman.environment_script(env)
            shell = podman.exec_argv(self._container, cwd, command)
            process = subprocess.Popen(
                shell.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                stdin=subprocess.PIPE, start_new_session=True,
            )  # fmt: skip
        else:
            process = subprocess.Popen(
                ["/bin/sh", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        try:
            out, _ = process.communicate(input=script, timeout=timeout_s)
            code = process.returncode if shell is None else shell.exit_code(process.returncode)
        except subprocess.TimeoutExpired:
            # In a container, what the command started is not the podman client's: end it there.
            if shell is not None and (end := podman.end_shell_argv(shell)) is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    subprocess.run(end, capture_output=True, timeout=30)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            out, _ = process.communicate()
            code = SHELL_TIMEOUT_EXIT
        finally:
            if shell is not None:
                shell.forget()
        text = out[-SHELL_OUTPUT_BYTES:].decode(errors="replace")
        return ShellResult(code, "".join(map(mask, text.splitlines(keepends=True))))

    def open_terminal(self, rows: int, cols: int, term: str, lost_after_s: float) -> str:
        """Start a shell on a PTY; its terminal id."""
        env, cwd, mask = self._started()
        return self.terminals.open(
            env=env, cwd=cwd, masker=mask, rows=rows, cols=cols, term=term,
            lost_after_s=lost_after_s, container=self._container,
        )  # fmt: skip

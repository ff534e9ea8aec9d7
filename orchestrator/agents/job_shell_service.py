"""`orchestrator shell` on a node: one command, or a terminal, run as the job's commands run.

Both get the environment (secrets included), the directory, the masker and the runtime (the
host, or the rank's container: node/rank_runtime.py) the job's commands started with on this
node, so what a user types sees what the training sees, and output never shows a secret's value.
"""

from __future__ import annotations

from orchestrator.agents.messages import ShellResult
from orchestrator.node.rank_runtime import ON_HOST, RankRuntime
from orchestrator.node.secrets import SecretMasker
from orchestrator.node.terminal import Terminals

SHELL_OUTPUT_BYTES = 8 * 2**20  # the end of a longer output is kept


class JobShellService:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._job: tuple[dict[str, str], str, SecretMasker] | None = None
        self._runtime: RankRuntime = ON_HOST
        self.terminals = Terminals()

    def commands_started(
        self, env: dict[str, str], cwd: str, mask: SecretMasker, runtime: RankRuntime = ON_HOST
    ) -> None:
        """What the job's commands run with, from now on what every shell runs with; in their
        container where they run in one (or, once it ended, a new one like it)."""
        self._job = (env, cwd, mask)
        self._runtime = runtime

    def _started(self) -> tuple[dict[str, str], str, SecretMasker]:
        if self._job is None:
            raise RuntimeError(f"the job's commands have not started on rank {self.rank} yet")
        return self._job

    def exec(self, command: str, timeout_s: float) -> ShellResult:
        """Run one shell command; its exit code (124 when it ran past `timeout_s`) and output,
        secrets masked."""
        env, cwd, mask = self._started()
        code, out = self._runtime.exec(command, env, cwd, timeout_s)
        text = out[-SHELL_OUTPUT_BYTES:].decode(errors="replace")
        return ShellResult(code, "".join(map(mask, text.splitlines(keepends=True))))

    def open_terminal(self, rows: int, cols: int, term: str, lost_after_s: float) -> str:
        """Start a shell on a PTY; its terminal id."""
        env, cwd, mask = self._started()
        return self.terminals.open(
            shell=self._runtime.terminal(env, cwd, term), masker=mask, rows=rows, cols=cols,
            lost_after_s=lost_after_s,
        )  # fmt: skip

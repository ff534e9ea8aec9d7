"""Interactive shells in a running job: a pseudo-terminal on the node, driven through Ray.

The node agent owns them. A shell runs in the job's working directory with the job's environment
(secrets resolved on the node), on a real PTY, so editors, job control and Ctrl-C behave as over
SSH. Its output is masked before it leaves the node. A client that stops reading for
`lost_after_s` (a closed laptop, a killed CLI) loses its terminal: the shell and every process of
its session end, as they do when the job's nodes are cleaned up.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import select
import shutil
import signal
import struct
import subprocess
import termios
import threading
import time
import uuid
from typing import TYPE_CHECKING, Protocol

import psutil

from orchestrator.node.secrets import SecretMasker, StreamMasker

if TYPE_CHECKING:
    from orchestrator.node.podman import Container

READ_CHUNK_BYTES = 64 * 1024
READ_LIMIT_BYTES = 1 * 2**20  # per read call: a flood of output comes back in pieces
HANGUP_GRACE_S = 2.0


class TerminalEnded(Exception):
    """The terminal is gone: its shell exited and was read to the end, or it was closed
    (internal: the client's relay shows its last line as why the shell ended)."""


class TerminalShell(Protocol):
    """Where a terminal's shell runs (node/rank_runtime.py chooses): `HostShell` or
    `ContainerShell`."""

    def start(self, child_end: int) -> subprocess.Popen:
        """The shell, on the PTY's other end (`child_end`), leading its own session."""
        ...

    def hang_up(self) -> None:
        """End what the shell left where the terminal's own hang-up of its session on this
        node cannot reach."""
        ...


class Terminal:
    """One shell on a PTY whose master end this process holds."""

    def __init__(
        self, shell: TerminalShell, masker: SecretMasker, rows: int, cols: int, lost_after_s: float
    ) -> None:
        master, child_end = os.openpty()
        _set_size(master, rows, cols)
        self.shell = shell
        try:
            self.process = shell.start(child_end)
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(child_end)
        self.fd = master
        self.lost_after_s = lost_after_s
        self.last_seen = time.monotonic()
        self._mask = StreamMasker(masker)
        self._read_lock = threading.Lock()
        self._closed = False

    def read(self, wait_s: float) -> tuple[bytes, int | None]:
        """What the shell wrote (masked), waiting up to `wait_s` for something; and its exit
        code once it has exited and everything it wrote was read."""
        self.last_seen = time.monotonic()
        with self._read_lock:
            if self._closed:
                raise TerminalEnded("the terminal was closed")
            chunks, size, ended = [], 0, False
            ready, _, _ = select.select([self.fd], [], [], wait_s)
            while ready and size < READ_LIMIT_BYTES:
                try:
                    data = os.read(self.fd, READ_CHUNK_BYTES)
                except OSError as e:  # EIO: every process holding the PTY's other end is gone
                    if e.errno != errno.EIO:
                        raise
                    data = b""
                if not data:
                    ended = True
                    break
                chunks.append(data)
                size += len(data)
                ready, _, _ = select.select([self.fd], [], [], 0)
            # The shell exited but a background job still holds the PTY: no EIO will come.
            ended = ended or (not chunks and self.process.poll() is not None)
            out = self._mask.feed(b"".join(chunks), final=ended)
            if not ended:
                return out, None
            code = self.process.wait()
            self._hang_up()  # what the shell left running goes with it, as over SSH
            self._release()
            return out, (code if code >= 0 else 128 - code)

    def write(self, data: bytes) -> None:
        self.last_seen = time.monotonic()
        view = memoryview(data)
        while view:
            written = os.write(self.fd, view)
            view = view[written:]

    def resize(self, rows: int, cols: int) -> None:
        """The kernel tells the shell's foreground programs (SIGWINCH), as a terminal would."""
        _set_size(self.fd, rows, cols)

    @property
    def lost(self) -> bool:
        return time.monotonic() - self.last_seen > self.lost_after_s

    def close(self) -> None:
        """Hang up: SIGHUP to every process of the shell's session, SIGKILL what is left."""
        with self._read_lock:
            if self._closed:
                return
            self._hang_up()
            self.process.wait()
            self._release()

    def _hang_up(self) -> None:
        self.shell.hang_up()  # the shell's session in its container first, if it has one
        members = _session_members(self.process.pid)
        for process in members:
            with contextlib.suppress(psutil.Error):
                process.send_signal(signal.SIGHUP)
        _, alive = psutil.wait_procs(members, timeout=HANGUP_GRACE_S)
        for process in alive:
            with contextlib.suppress(psutil.Error):
                process.kill()
        psutil.wait_procs(alive, timeout=HANGUP_GRACE_S)

    def _release(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            os.close(self.fd)


class Terminals:
    """A node agent's open terminals, and the watch that ends those whose client is gone."""

    def __init__(self) -> None:
        self._open: dict[str, Terminal] = {}
        self._lock = threading.Lock()
        self._watch: threading.Thread | None = None

    def open(self, **kwargs) -> str:
        terminal = Terminal(**kwargs)
        terminal_id = uuid.uuid4().hex[:12]
        with self._lock:
            self._open[terminal_id] = terminal
            if self._watch is None:
                self._watch = threading.Thread(target=self._close_lost, daemon=True)
                self._watch.start()
        return terminal_id

    def get(self, terminal_id: str) -> Terminal:
        with self._lock:
            terminal = self._open.get(terminal_id)
        if terminal is None:
            raise TerminalEnded(f"terminal {terminal_id} has ended")
        return terminal

    def read(self, terminal_id: str, wait_s: float) -> tuple[bytes, int | None]:
        out, code = self.get(terminal_id).read(wait_s)
        if code is not None:
            self._forget(terminal_id)
        return out, code

    def close(self, terminal_id: str) -> None:
        terminal = self._forget(terminal_id)
        if terminal is not None:
            terminal.close()

    def close_all(self) -> None:
        with self._lock:
            ids = list(self._open)
        for terminal_id in ids:
            self.close(terminal_id)

    def _forget(self, terminal_id: str) -> Terminal | None:
        with self._lock:
            return self._open.pop(terminal_id, None)

    def _close_lost(self) -> None:
        while True:
            time.sleep(1.0)
            with self._lock:
                lost = [tid for tid, terminal in self._open.items() if terminal.lost]
            for terminal_id in lost:
                self.close(terminal_id)


class HostShell:
    """A terminal's shell in the node's environment, as the job's commands run: the job's
    directory and environment, the PTY its controlling terminal; the environment's SHELL, else
    bash, else sh."""

    def __init__(self, env: dict[str, str], cwd: str, term: str) -> None:
        self.env, self.cwd, self.term = env, cwd, term

    def start(self, child_end: int) -> subprocess.Popen:
        shell = _shell(self.env)
        return subprocess.Popen(
            [shell, "-i"], stdin=child_end, stdout=child_end, stderr=child_end, cwd=self.cwd,
            env={**self.env, "TERM": self.term or "xterm-256color", "SHELL": shell},
            start_new_session=True,  # the shell leads a session: its PTY is its own
            preexec_fn=_take_controlling_terminal,
        )  # fmt: skip

    def hang_up(self) -> None:
        """Nothing: the terminal hangs up the shell's session itself."""


class ContainerShell:
    """A terminal's shell in the rank's container (`podman exec -it`): the job's environment
    goes in on a pipe (fd 3 inside), never on a command line; the shell says its pid inside on
    another (fd 4), which its hang-up needs, as podman's client ending leaves it running."""

    def __init__(self, container: Container, env: dict[str, str], cwd: str, term: str) -> None:
        self.container, self.env, self.cwd, self.term = container, env, cwd, term
        self.name = container.name  # the container the shell runs in, once started
        self.pid: str | None = None

    def start(self, child_end: int) -> subprocess.Popen:
        from orchestrator.node import podman

        env_read, env_write = os.pipe()
        pid_read, pid_write = os.pipe()
        # Above 3 and 4, so the child's dup2 onto them never overwrites the other.
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (env_read, pid_write)]
        for fd in (env_read, pid_write):
            os.close(fd)

        def child() -> None:
            _take_controlling_terminal()
            os.dup2(high[0], 3)  # dup2's copy is inheritable; the originals close on exec
            os.dup2(high[1], 4)

        try:
            argv, self.name = podman.terminal_argv(
                self.container, self.cwd, self.term or "xterm-256color"
            )
            process = subprocess.Popen(
                argv, stdin=child_end, stdout=child_end, stderr=child_end, start_new_session=True,
                preexec_fn=child, pass_fds=(3, 4),
            )  # fmt: skip
        except BaseException:
            os.close(env_write)
            os.close(pid_read)
            raise
        finally:
            for fd in high:
                os.close(fd)
        threading.Thread(target=_write_all, args=(env_write, podman.environment_script(self.env)),
                         daemon=True).start()  # fmt: skip
        with os.fdopen(pid_read, "rb") as said:
            ready, _, _ = select.select([said], [], [], 30)
            line = said.readline().strip() if ready else b""
        self.pid = line.decode() if line.isdigit() else None
        return process

    def hang_up(self) -> None:
        """SIGHUP to every process of the shell's session in the container, SIGKILL to what is
        left after HANGUP_GRACE_S."""
        from orchestrator.node import podman

        if self.pid is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):  # podman hung: the host's part
                subprocess.run(podman.hang_up_argv(self.name, self.pid, HANGUP_GRACE_S),
                               capture_output=True, timeout=30)  # fmt: skip


def _write_all(fd: int, data: bytes) -> None:
    with contextlib.suppress(OSError), os.fdopen(fd, "wb") as pipe:
        pipe.write(data)


def _shell(env: dict[str, str]) -> str:
    for candidate in (env.get("SHELL", ""), "/bin/bash", "/bin/sh"):
        if candidate and shutil.which(candidate, path=env.get("PATH")):
            return candidate
    return "/bin/sh"


# A Ray worker ignores or blocks some of these, and a child inherits both across exec: a shell
# started as is would run programs that Ctrl-C cannot interrupt.
_TERMINAL_SIGNALS = (
    signal.SIGINT, signal.SIGQUIT, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU,
    signal.SIGHUP, signal.SIGTERM, signal.SIGCHLD, signal.SIGWINCH,
)  # fmt: skip


def _take_controlling_terminal() -> None:
    """In the child, after setsid: its stdin (the PTY) becomes its controlling terminal, and the
    terminal's signals act as they do in a login shell, so Ctrl-C and job control work."""
    for number in _TERMINAL_SIGNALS:
        signal.signal(number, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _set_size(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", max(rows, 1), max(cols, 1), 0, 0))


def _session_members(session_id: int) -> list[psutil.Process]:
    """Every process of the session the shell leads (background jobs and their children too)."""
    members = []
    for process in psutil.process_iter():
        with contextlib.suppress(OSError, psutil.Error):
            if os.getsid(process.pid) == session_id:
                members.append(process)
    return members

"""Runs a rank's start commands, one after another, and stops them: the part of a node agent a
container runner would replace.

Each command runs through `/bin/sh -c` as the leader of its own process group, under a guard
that kills the group if the agent dies without stopping it. Output is read as it comes (not
line by line), split into lines and progress updates, masked, and yielded in items small
enough to stay out of Ray's object store.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

from orchestrator.agents.messages import CommandsEnded, OutputLines
from orchestrator.node.output_splitter import OutputSplitter
from orchestrator.node.secrets import SecretMasker

# Runs each command as the leader of its process group. If the agent dies without stopping it
# (a killed worker, a lost node), the guard notices its parent is gone and kills the group, so
# no training process is orphaned. It ignores SIGTERM itself, so a stop reaches the command and
# the guard reports the command's own exit code.
_GUARD = """
import os, signal, subprocess, sys
agent = int(sys.argv[1])
signal.signal(signal.SIGTERM, signal.SIG_IGN)
restore = lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL)  # noqa: E731
child = subprocess.Popen(sys.argv[2:], preexec_fn=restore)
while True:
    try:
        child.wait(timeout=0.5)
        break
    except subprocess.TimeoutExpired:
        if os.getppid() != agent:
            os.killpg(0, signal.SIGKILL)
sys.exit(child.returncode if child.returncode >= 0 else 128 - child.returncode)
"""
LAST_LINES = 50
READ_BYTES = 64 * 1024  # one read of a command's output
READ_QUEUE_CHUNKS = 64  # reads waiting to be forwarded (4 MiB), after which the command waits
# Characters per stream item: under Ray's 100 KiB inline limit, so output never goes through the
# object store; the controller takes at most STREAM_BACKLOG items unread before the agent waits.
BATCH_CHARS = 64 * 1024
STREAM_BACKLOG = 16


class CommandRunner:
    """One rank's commands: run in order, stopping at the first that fails, or when stopped."""

    def __init__(self, tag: Callable[[str, bool], str]) -> None:
        self._tag = tag  # a line as the job's log shows it (rank, time)
        self._process: subprocess.Popen[bytes] | None = None
        self.stopping = threading.Event()

    def pid(self) -> int | None:
        """The running command's process (group) id, None between commands."""
        proc = self._process
        return proc.pid if proc is not None and proc.poll() is None else None

    def run(
        self, commands: tuple[str, ...], env: dict[str, str], cwd: str, mask: SecretMasker,
        before_end: Callable[[], None] = lambda: None,
    ) -> Iterator[OutputLines | CommandsEnded]:  # fmt: skip
        """OutputLines as output arrives, then one CommandsEnded; `before_end` runs just before
        it (what the ending must not race, such as the rank's last resource sample)."""
        last_lines: deque[str] = deque(maxlen=LAST_LINES)
        for command in commands:
            if self.stopping.is_set():
                break
            # Bounded: a command that writes faster than its output is forwarded waits on its
            # pipe, as it would on a slow terminal, instead of growing this process.
            chunks: queue.Queue[bytes | None] = queue.Queue(maxsize=READ_QUEUE_CHUNKS)
            self._process = subprocess.Popen(
                [*_guarded(), "/bin/sh", "-c", command],
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group, so stop reaches every child
            )
            reader = threading.Thread(target=_pump, args=(self._process, chunks), daemon=True)
            reader.start()
            output = OutputSplitter(mask)
            done = False
            while not done:
                batch = _drain(chunks)
                if batch and batch[-1] is None:
                    done = True
                    batch.pop()
                now = time.monotonic()
                pieces = [p for data in batch for p in output.feed(data, now)] or output.tick(now)
                if done:
                    pieces += output.close()
                last_lines.extend(p.text for p in pieces)
                yield from _items([self._tag(p.text, p.progress) for p in pieces])
            code = self._process.wait()
            if code != 0:
                before_end()
                yield CommandsEnded(
                    exit_code=code, command=command, last_lines=list(last_lines),
                    stopped=self.stopping.is_set(), ended_at=time.time(),
                )  # fmt: skip
                return
        before_end()
        yield CommandsEnded(
            exit_code=0, last_lines=list(last_lines), stopped=self.stopping.is_set(),
            ended_at=time.time(),
        )  # fmt: skip

    def stop(self, grace_s: float = 10.0) -> bool:
        """SIGTERM the running command's process group, SIGKILL what is left after `grace_s`.

        The whole group gets the grace, not only the shell: a trainer that saves a checkpoint
        on SIGTERM outlives the `sh -c` that started it, which SIGTERM ends at once.
        """
        self.stopping.set()
        proc = self._process
        if proc is None or proc.poll() is not None:
            return False
        _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (proc.poll() is None or _group_alive(proc.pid)):
            time.sleep(0.05)
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()
        return True


def _guarded() -> list[str]:
    return [sys.executable, "-I", "-S", "-c", _GUARD, str(os.getpid())]


def _pump(proc: subprocess.Popen[bytes], chunks: queue.Queue[bytes | None]) -> None:
    """The command's output as it comes, not line by line: a progress bar or a prompt without a
    newline is read at once (node/output_splitter.py decides what to forward)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    while data := os.read(fd, READ_BYTES):
        chunks.put(data)
    chunks.put(None)


def _items(lines: list[str]) -> Iterator[OutputLines]:
    """`lines` in order, in items of at most BATCH_CHARS characters; a longer line in pieces,
    each but its last alone in an item that `continues`."""
    batch: list[str] = []
    size = 0
    for line in lines:
        if batch and size + len(line) > BATCH_CHARS:
            yield OutputLines(batch)
            batch, size = [], 0
        while len(line) > BATCH_CHARS:
            yield OutputLines([line[:BATCH_CHARS]], continues=True)
            line = line[BATCH_CHARS:]
        batch.append(line)
        size += len(line)
    if batch:
        yield OutputLines(batch)


def _drain(chunks: queue.Queue[bytes | None], wait: float = 0.1, most: int = 16) -> list:
    """Block for the first chunk (up to `wait`), then take what else is ready, up to `most`
    (1 MiB: what a loop holds at once, several copies of it being made)."""
    try:
        batch = [chunks.get(timeout=wait)]
    except queue.Empty:
        return []
    while batch[-1] is not None and len(batch) < most:
        try:
            batch.append(chunks.get_nowait())
        except queue.Empty:
            break
    return batch


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)

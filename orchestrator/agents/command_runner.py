"""Runs a rank's start commands, one after another, and stops them.

The rank's runtime (node/rank_runtime.py) starts the processes that run them: each command
through `/bin/sh -c` on the host, or all of them in a container of the job's image. Each leads
its own process group, under a guard that kills the group (and removes the container) if the
agent dies without stopping it. Output is read as it comes (not line by line), split into lines
and progress updates, masked, and yielded in items small enough to stay out of Ray's object
store.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator

from orchestrator.agents.messages import CommandsEnded, OutputLines
from orchestrator.node.output_splitter import OutputSplitter
from orchestrator.node.rank_runtime import ON_HOST, RankRuntime
from orchestrator.node.secrets import SecretMasker

# Runs each command as the leader of its process group. If the agent dies without stopping it
# (a killed worker, a lost node), the guard notices its parent is gone and kills the group, so
# no training process is orphaned. It ignores SIGTERM itself, so a stop reaches the command and
# the guard reports the command's own exit code.
# Ray SIGKILLs an exiting worker's direct children (`ray.kill`, its owner gone): the guard is
# one, so it forks a watcher, its own child, that ends the group when the guard dies without
# saying it is done (end of file on a pipe only the guard writes).
# A container lives outside the group (podman's conmon holds it): the guard removes it first,
# with the command the rank's runtime gives in $ORCHESTRATOR_GUARD_CLEANUP.
_GUARD = """
import json, os, signal, subprocess, sys
agent = int(sys.argv[1])
cleanup = json.loads(os.environ.pop("ORCHESTRATOR_GUARD_CLEANUP", "null"))
signal.signal(signal.SIGTERM, signal.SIG_IGN)
def end_group():
    if cleanup:
        subprocess.run(cleanup, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.killpg(0, signal.SIGKILL)
done_r, done_w = os.pipe()
if os.fork() == 0:
    os.close(done_w)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    if not os.read(done_r, 1):
        end_group()
    os._exit(0)
os.close(done_r)
restore = lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL)  # noqa: E731
child = subprocess.Popen(sys.argv[2:], preexec_fn=restore)
while True:
    try:
        child.wait(timeout=0.5)
        break
    except subprocess.TimeoutExpired:
        if os.getppid() != agent:
            end_group()
os.write(done_w, b"d")
sys.exit(child.returncode if child.returncode >= 0 else 128 - child.returncode)
"""
LAST_LINES = 50
READ_BYTES = 64 * 1024  # one read of a command's output
READ_QUEUE_CHUNKS = 64  # reads waiting to be forwarded (4 MiB), after which the command waits
# Characters per stream item: under Ray's 100 KiB inline limit, so output never goes through the
# object store; the controller takes at most STREAM_BACKLOG items unread before the agent waits.
BATCH_CHARS = 64 * 1024
STREAM_BACKLOG = 16


# How a rank's commands failed: the exit code, the command, and why where it is known.
Failed = tuple[int, str, str | None]


class CommandRunner:
    """One rank's commands: run in order, stopping at the first that fails, or when stopped;
    where the rank's runtime runs them (node/rank_runtime.py)."""

    def __init__(self, tag: Callable[[str, bool], str]) -> None:
        self._tag = tag  # a line as the job's log shows it (rank, time)
        self._process: subprocess.Popen[bytes] | None = None
        self._runtime: RankRuntime = ON_HOST
        self.stopping = threading.Event()

    def pid(self) -> int | None:
        """The process whose descendants are the running commands (what the rank's metrics
        count): the command's own (its group's leader), or the init of their container; None
        between commands."""
        proc = self._process
        if proc is None or proc.poll() is not None:
            return None
        return self._runtime.pid(proc)

    def run(
        self, commands: tuple[str, ...], env: dict[str, str], cwd: str, mask: SecretMasker,
        before_end: Callable[[], None] = lambda: None, runtime: RankRuntime = ON_HOST,
    ) -> Iterator[OutputLines | CommandsEnded]:  # fmt: skip
        """OutputLines as output arrives, then one CommandsEnded; `before_end` runs just before
        it (what the ending must not race, such as the rank's last resource sample). `env` is
        all the commands see (`runtime.environment`)."""
        last_lines: deque[str] = deque(maxlen=LAST_LINES)
        self._runtime = runtime
        failed = yield from self._run(commands, env, cwd, mask, last_lines)
        before_end()
        code, command, why = failed or (0, None, None)
        yield CommandsEnded(
            exit_code=code, command=command, last_lines=list(last_lines),
            stopped=self.stopping.is_set(), ended_at=time.time(), why=why,
        )  # fmt: skip

    def _run(
        self, commands: tuple[str, ...], env: dict[str, str], cwd: str, mask: SecretMasker,
        last_lines: deque[str],
    ) -> Generator[OutputLines, None, Failed | None]:  # fmt: skip
        """Each process the runtime runs the commands in, one after another, under the guard;
        the first failure's code, command, and why where it is known."""
        runtime = self._runtime
        for batch in runtime.batches(commands):
            if self.stopping.is_set():
                break
            yield from _items([self._tag(line, False) for line in runtime.opening()])
            self._process = runtime.start(batch, env, cwd, _guarded())
            if code := (yield from self._stream(self._process, mask, last_lines)):
                return (code, *runtime.failure(batch, code))
        return None

    def _stream(
        self, process: subprocess.Popen[bytes], mask: SecretMasker, last_lines: deque[str]
    ) -> Generator[OutputLines, None, int]:
        """The process's output as it comes, until it ends; its exit code."""
        # Bounded: a command that writes faster than its output is forwarded waits on its
        # pipe, as it would on a slow terminal, instead of growing this process.
        chunks: queue.Queue[bytes | None] = queue.Queue(maxsize=READ_QUEUE_CHUNKS)
        reader = threading.Thread(target=_pump, args=(process, chunks), daemon=True)
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
        return process.wait()

    def stop(self, grace_s: float = 10.0) -> bool:
        """SIGTERM every process of the running command, SIGKILL what is left after `grace_s`
        (node/rank_runtime.py `RankRuntime.stop`); whether one was running."""
        self.stopping.set()
        proc = self._process
        if proc is None or proc.poll() is not None:
            return False
        self._runtime.stop(proc, grace_s)
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

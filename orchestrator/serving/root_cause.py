"""Why an engine failed, in one line: found in the replica process's own output.

vLLM runs its engine in child processes (`EngineCore`, its `Worker`s) that write to the replica's
stdout and stderr, which Ray sends to the worker's log files (`worker-*.out`, `worker-*.err`).
When a child fails, the replica itself only gets `EngineDeadError: ... See stack trace (above)
for the root cause`; the root cause is the first exception line the children wrote. The replica
notes where its output files end before it starts the engine (`ProcessOutput.mark`) and reads
what was written after that when the engine fails (no Ray, no vLLM here: tests give it text).
"""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# vLLM's prefix on a child's lines, then its log format: "(Worker pid=12) ERROR 12-02 03:13:39
# [multiproc_executor.py:1063] ".
_CHILD = re.compile(r"^\([\w.:-]+ pid=\d+\)\s?")
_LOG = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d [\d:.]+ \[[^\]]*\]\s?")
# An exception line of a traceback: a (dotted) name ending in Error or Exception at the start
# of the line, then its message; a traceback's frame lines are indented.
_EXCEPTION = re.compile(r"^((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception))(?::\s*(.*))?$")
# Exceptions that only point at another: the root cause is elsewhere in the output.
_POINTERS = ("EngineDeadError", "EngineGenerateError")
_POINTER_TEXT = ("root cause above", "(above) for the root cause", "above for the root cause")
_PYDANTIC_TAIL = re.compile(r"\s*\[type=\w+, input_value=.*$")  # "[type=..., input_value=...]"
_LINE_LIMIT = 600
_READ_LIMIT = 1 << 20  # the last MiB written since the mark: a traceback is near the end


def root_cause(*outputs: str) -> str | None:
    """The first exception line in `outputs` (a process's stdout, then its stderr) that is not
    only a pointer to another; a pointer if that is all there is; None if there is no
    exception line. Its module path is dropped: `RuntimeError: ...`."""
    found = [line for text in outputs for line in exception_lines(text)]
    return next((line for line in found if not is_pointer(line)), found[0] if found else None)


def exception_lines(text: str) -> list[str]:
    """Each exception line of the tracebacks in `text`, in order, without prefixes."""
    lines = []
    for raw in text.splitlines():
        line = _LOG.sub("", _CHILD.sub("", _ANSI.sub("", raw)), count=1).rstrip()
        if match := _EXCEPTION.match(line):
            name = match.group(1).rsplit(".", 1)[-1]
            lines.append(f"{name}: {match.group(2)}" if match.group(2) else name)
    return lines


def why(e: BaseException, output: ProcessOutput | None, wait_s: float = 5.0) -> str:
    """`e` in one line, or, where `e` only points at a root cause written elsewhere (vLLM's
    `EngineDeadError`), that root cause as `output` has it."""
    line = error_line(e)
    if output is None or not is_pointer(line):
        return line
    return output.root_cause(wait_s) or line


def is_pointer(line: str) -> bool:
    """Whether an exception line only says that the root cause is elsewhere."""
    return line.partition(":")[0] in _POINTERS or any(p in line for p in _POINTER_TEXT)


def error_line(e: BaseException, secrets: Iterable[str] = ()) -> str:
    """`Name: message` of `e`, its message's lines joined into one (a pydantic error's reason is
    on its second line) without pydantic's input echo and links, each of `secrets` in it masked
    as `***`; at most 600 characters."""
    lines = [_PYDANTIC_TAIL.sub("", ln).strip() for ln in str(e).splitlines()]
    text = " ".join(ln for ln in lines if ln and not ln.startswith("For further information"))
    for secret in sorted(filter(None, secrets), key=len, reverse=True):
        text = text.replace(secret, "***")
    if len(text) > _LINE_LIMIT:
        text = text[: _LINE_LIMIT - 3] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


@dataclass(frozen=True)
class ProcessOutput:
    """Where this process's stdout and stderr files ended when it was marked (files only: a
    terminal or a pipe is left out)."""

    ends: tuple[tuple[Path, int], ...]

    @classmethod
    def mark(cls) -> ProcessOutput:
        ends = []
        for fd in (1, 2):
            try:
                st = os.fstat(fd)
                if stat.S_ISREG(st.st_mode):
                    ends.append((Path(os.readlink(f"/proc/self/fd/{fd}")), st.st_size))
            except OSError:  # closed, or no /proc (not Linux)
                continue
        return cls(tuple(ends))

    def since(self) -> list[str]:
        """What each file got after the mark (its last MiB)."""
        texts = []
        for path, end in self.ends:
            try:
                with path.open("rb") as f:
                    size = f.seek(0, os.SEEK_END)
                    f.seek(max(end, size - _READ_LIMIT))
                    texts.append(f.read().decode("utf-8", "replace"))
            except OSError:
                continue
        return texts

    def root_cause(self, wait_s: float = 5.0) -> str | None:
        """The root cause written since the mark, waiting up to `wait_s` for it: a child writes
        its traceback as it fails, which may be just after the replica learns of it."""
        deadline = time.monotonic() + wait_s
        while True:
            found = root_cause(*self.since())
            if (found and not is_pointer(found)) or time.monotonic() > deadline:
                return found
            time.sleep(0.2)

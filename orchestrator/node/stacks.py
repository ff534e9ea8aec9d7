"""A rank's Python stacks, now: `py-spy dump` (all threads, native frames where it can) of every
process its commands run as, in one text.

The processes are the descendants of the rank's root (`CommandRunner.pid`: the command's guard
on the host, a container's init in a container: podman's processes are the host's too, and
py-spy reads a containerised process through /proc). Each is dumped at once in a thread of its
own, so a rank's stacks take about as long as its slowest process. A process that is not Python
(the shell, a `torchrun` launcher's children are) is named without a stack. Where ptrace is
refused, the text says so (`REFUSED`): the caller says it once and acts on the silence anyway.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

REFUSED = "py-spy could not attach"  # the text of a process ptrace was refused for
DUMP_TIMEOUT_S = 4.0  # per process: the rank's stacks are wanted within 5 s
MAX_PROCESSES = 64


def py_spy() -> str | None:
    """The py-spy beside this interpreter (the project's own environment), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def rank_stacks(root_pid: int | None, timeout_s: float = DUMP_TIMEOUT_S) -> str:
    """Every Python stack of the processes under `root_pid`, headed by when they were taken."""
    head = f"stacks taken {time.strftime('%Y-%m-%d %H:%M:%S %Z')} by py-spy dump"
    if root_pid is None:
        return f"{head}\nno command is running on this rank\n"
    spy = py_spy()
    if spy is None:
        return f"{head}\npy-spy is not installed on this node (pip install py-spy)\n"
    processes = _processes(root_pid)
    if not processes:
        return f"{head}\nno process runs under {root_pid}\n"
    with ThreadPoolExecutor(max_workers=min(len(processes), 16)) as pool:
        dumps = list(pool.map(lambda p: _dump(spy, p, timeout_s), processes))
    return "\n".join([head, *dumps])


def _processes(root_pid: int) -> list[psutil.Process]:
    """What runs under `root_pid` (the guard's own fork, which has its command line, left out)."""
    try:
        root = psutil.Process(root_pid)
        line = root.cmdline()
        found = []
        for p in root.children(recursive=True):
            try:
                if p.ppid() == root_pid and p.cmdline() == line:
                    continue
            except psutil.Error:
                continue
            found.append(p)
        return found[:MAX_PROCESSES]
    except psutil.Error:
        return []


def _dump(spy: str, process: psutil.Process, timeout_s: float) -> str:
    try:
        name = " ".join(process.cmdline())[:300]
    except psutil.Error:
        name = "?"
    output = _run([spy, "dump", "--pid", str(process.pid), "--native"], timeout_s)
    if output[0] != 0 and "python version" not in output[1].lower():
        output = _run([spy, "dump", "--pid", str(process.pid)], timeout_s)  # no native frames
    code, text = output
    if code == 0:
        return text.rstrip() + "\n"
    low = text.lower()
    if "python version" in low or "python interpreter" in low:
        return f"Process {process.pid}: {name}\n    (not a Python process)\n"
    if "permission" in low or "operation not permitted" in low:
        why = f"{REFUSED} (ptrace refused): {text.strip().splitlines()[0]}"
        return f"Process {process.pid}: {name}\n    ({why})\n"
    last = text.strip().splitlines()[:1] or ["no output"]
    return f"Process {process.pid}: {name}\n    (py-spy failed: {last[0]})\n"


def _run(argv: list[str], timeout_s: float) -> tuple[int, str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return 1, f"py-spy took more than {timeout_s:g} s"
    except OSError as e:
        return 1, str(e)
    return done.returncode, done.stdout if done.returncode == 0 else done.stderr + done.stdout

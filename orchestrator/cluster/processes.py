"""The embedded cluster's processes and dashboard seen from outside: whether the recorded
`ray start` is still the one we started, whether its dashboard answers, and ending it with its
whole family.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request

import psutil

POLL_INTERVAL_S = 0.1
# Our requests to the dashboard go straight to loopback, whatever HTTP(S)_PROXY says.
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def recorded_process(state: dict[str, object]) -> psutil.Process | None:
    """The recorded `ray start` process if it still runs (and its pid was not reused)."""
    try:
        process = psutil.Process(int(state["pid"]))  # type: ignore[call-overload]
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        create_time = state.get("create_time")
        if isinstance(create_time, (int, float)) and abs(process.create_time() - create_time) > 1:
            return None
        return process
    except (KeyError, TypeError, ValueError, psutil.Error):
        return None


def get_json(url: str, timeout: float = 2, token: str | None = None) -> object | None:
    """The decoded JSON body of a 2xx answer, or None if there was no such answer. `token`:
    the cluster's (Ray's token authentication), sent as a bearer token."""
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with _HTTP.open(request, timeout=timeout) as response:
            if not 200 <= response.status < 300:
                return None
            return json.loads(response.read() or b"null")
    except (urllib.error.URLError, OSError, ValueError):
        return None


def answers(url: str, token: str | None = None) -> bool:
    return get_json(url, token=token) is not None


def has_a_node(url: str, token: str | None = None) -> bool:
    body = get_json(url, token=token)
    try:
        return bool(body["data"]["summary"])  # type: ignore[index]
    except (KeyError, TypeError):
        return False


def dashboard_answers(dashboard_url: str, token: str | None = None) -> bool:
    return answers(dashboard_url + "/api/version", token)


def terminate(
    process: psutil.Process, timeout: float, handle: subprocess.Popen[bytes] | None
) -> None:
    """SIGTERM `ray start --block` (it tears its processes down); SIGKILL what is left after."""
    try:
        pgid = os.getpgid(process.pid)
    except OSError:
        pgid = None
    members = _family(process, pgid)
    with contextlib.suppress(psutil.Error):
        process.terminate()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if handle is not None:
            handle.poll()  # reap our own child so it does not linger as a zombie
        if not any_alive(members):
            return
        time.sleep(POLL_INTERVAL_S)
    if pgid is not None and pgid != os.getpgrp():
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)
    for member in members:
        with contextlib.suppress(psutil.Error):
            member.kill()
    if handle is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            handle.wait(timeout=5)
    psutil.wait_procs(members, timeout=5)


def _family(process: psutil.Process, pgid: int | None) -> list[psutil.Process]:
    """The process, its descendants, and the rest of its process group."""
    family = {process.pid: process}
    with contextlib.suppress(psutil.Error):
        family.update((child.pid, child) for child in process.children(recursive=True))
    if pgid is not None:
        for candidate in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if candidate.pid not in family and os.getpgid(candidate.pid) == pgid:
                    family[candidate.pid] = candidate
    return list(family.values())


def any_alive(processes: list[psutil.Process]) -> bool:
    """Whether one of them runs (an ended child not reaped yet, a zombie, does not)."""
    for p in processes:
        with contextlib.suppress(psutil.Error):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                return True
    return False

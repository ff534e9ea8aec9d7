"""The controller host's reading of the stops Ray's dashboard accepted (`ray job stop` of a hosted
job): only accepted stops, each once, none from before the host, across a log rotation."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from orchestrator.controller.ray_stops import follow_stops, stops_in


def access(job_id: str, status: int = 200, method: str = "POST", what: str = "stop") -> str:
    """A line as Ray 2.60's dashboard writes it (seen in a session's dashboard.log)."""
    return (f"2026-11-28 14:47:15,600\tINFO web_log.py:229 -- 127.0.0.1 [28/Nov/2026:14:47:14 "
            f"+0000] '{method} /api/jobs/{job_id}/{what} HTTP/1.1' {status} 18 bytes 934 us "
            "'-' 'python-requests/2.34.2'\n")  # fmt: skip


def test_only_a_stop_the_dashboard_accepted_is_one():
    assert stops_in(access("jicggzao0i")) == "jicggzao0i"
    assert stops_in(access("raysubmit_Xy12")) == "raysubmit_Xy12"
    assert stops_in(access("jicggzao0i", status=401)) is None  # no token: refused
    assert stops_in(access("jicggzao0i", status=404)) is None
    assert stops_in(access("jicggzao0i", method="GET", what="logs")) is None
    assert stops_in("127.0.0.1 'POST /api/jobs/ HTTP/1.1' 200 214 bytes") is None  # a submit


class Polls(threading.Event):
    """The follower's `closed`, counting its polls: a test knows it has looked, without a sleep."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.counted = threading.Condition()

    def wait(self, timeout: float | None = None) -> bool:
        with self.counted:
            self.count += 1
            self.counted.notify_all()
        return super().wait(timeout)

    def another(self) -> None:
        """Return once the follower has polled again (so it read what was there before)."""
        with self.counted:
            seen = self.count
            assert self.counted.wait_for(lambda: self.count >= seen + 2, timeout=10)


class Following:
    def __init__(self, path: Path) -> None:
        self.seen: list[str] = []
        self.closed = Polls()
        self.thread = threading.Thread(
            target=follow_stops, args=(path, self.seen.append, self.closed, 0.02), daemon=True
        )
        self.thread.start()
        self.closed.another()  # it has looked at the file (or found none)

    def wait_for(self, expected: list[str], timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while self.seen != expected:
            assert time.monotonic() < deadline, f"saw {self.seen}, expected {expected}"
            time.sleep(0.02)

    def stop(self) -> None:
        self.closed.set()
        self.thread.join(5)
        assert not self.thread.is_alive()


def test_stops_from_now_on_each_once_also_a_line_written_in_two_parts(tmp_path):
    log = tmp_path / "dashboard.log"
    log.write_text(access("before-the-host"))  # a stop of an earlier day: not repeated
    following = Following(log)
    try:
        with open(log, "a") as f:
            line = access("j1")
            f.write(line[:40])
            f.flush()
            following.closed.another()  # it reads half a line in between
            f.write(line[40:] + access("j2", status=401) + access("j3"))
        following.wait_for(["j1", "j3"])
        following.closed.another()
        assert following.seen == ["j1", "j3"]  # and nothing more
    finally:
        following.stop()


def test_a_rotated_log_loses_no_stop_and_a_log_made_later_is_read_whole(tmp_path):
    log = tmp_path / "dashboard.log"
    following = Following(log)  # no file yet: the dashboard has not written one
    try:
        log.write_text(access("first"))
        following.wait_for(["first"])
        with open(log, "a") as old:
            old.write(access("last-of-the-old-file"))
            old.flush()
            log.rename(tmp_path / "dashboard.log.1")  # as Ray's RotatingFileHandler does
            old.write(access("after-the-rename"))  # the old handle, until it is closed
        log.write_text(access("in-the-new-file"))
        following.wait_for(["first", "last-of-the-old-file", "after-the-rename",
                            "in-the-new-file"])  # fmt: skip
    finally:
        following.stop()

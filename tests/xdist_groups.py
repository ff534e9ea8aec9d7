"""`--dist loadgroup` that works on pytest 9.2: the suite's tests that start Ray run in one
xdist worker, one after another, while the other worker runs the rest.

pytest-xdist 3.8 carries a test's `xdist_group` from the worker that collected it to the
scheduler by appending `@group` to the test's node id, and pytest 9.2's structured node ids no
longer take that (pytest-dev/pytest-xdist#1386, open): every test is then scheduled alone, and
two Ray clusters run at once. Here each worker writes the groups it collected into a directory
the controller made, and the controller's scheduler reads them from there. Drop this module once
an xdist release fixes the issue.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from xdist.scheduler import LoadGroupScheduling

GROUPS_DIR_ENV = "ORCHESTRATOR_TEST_XDIST_GROUPS"  # the controller's directory, for its workers


def start(config: pytest.Config) -> None:
    """In the controller of a `--dist loadgroup` run: the directory its workers (which inherit
    its environment) write their groups into."""
    if config.getoption("dist", "no") == "loadgroup" and not hasattr(config, "workerinput"):
        os.environ[GROUPS_DIR_ENV] = tempfile.mkdtemp(prefix="xdist-groups-")


def record(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a worker: each collected test's group, by node id."""
    directory = os.environ.get(GROUPS_DIR_ENV)
    if directory is None or not hasattr(config, "workerinput"):
        return
    groups = {item.nodeid: mark.args[0] if mark.args else mark.kwargs.get("name", "default")
              for item in items if (mark := item.get_closest_marker("xdist_group"))}  # fmt: skip
    path = Path(directory) / f"{config.workerinput['workerid']}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(groups))
    tmp.rename(path)  # the scheduler reads it only once every worker's collection is in


_held: list[int] = []  # this worker's lock on running Ray tests, held until it exits


def claim(config: pytest.Config, item: pytest.Item, group: str) -> None:
    """In a worker, before a test of `group`: the group's lock, taken once and held until the
    worker exits (a dead worker's goes with it). If another live worker holds it, the grouping
    broke (an xdist release that schedules otherwise): the test fails and says so, rather than
    two Ray clusters running at once and missing their deadlines."""
    directory = os.environ.get(GROUPS_DIR_ENV)
    if _held or directory is None or not hasattr(config, "workerinput"):
        return
    if (mark := item.get_closest_marker("xdist_group")) is None or group not in mark.args:
        return
    fd = os.open(Path(directory) / f"{group}.lock", os.O_CREAT | os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        why = "the group was split: tests/xdist_groups.py no longer schedules it"
        pytest.fail(f"another xdist worker runs the {group!r} group's tests: {why}", pytrace=False)
    _held.append(fd)


class RecordedGroups(LoadGroupScheduling):
    """xdist's loadgroup scheduling, each test's group read from what the workers recorded (a
    test with none is a unit of its own, as in xdist)."""

    def __init__(self, config: pytest.Config, log=None) -> None:
        super().__init__(config, log)
        self._groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._groups is None:
            self._groups = {}
            for path in Path(os.environ[GROUPS_DIR_ENV]).glob("*.json"):
                self._groups.update(json.loads(path.read_text()))
        return self._groups.get(nodeid) or super()._split_scope(nodeid)


def finish(config: pytest.Config) -> None:
    """In the controller, at the end: its directory goes."""
    if not hasattr(config, "workerinput") and (directory := os.environ.pop(GROUPS_DIR_ENV, None)):
        shutil.rmtree(directory, ignore_errors=True)


def scheduler(config: pytest.Config, log) -> RecordedGroups | None:
    if config.getoption("dist", "no") == "loadgroup" and GROUPS_DIR_ENV in os.environ:
        return RecordedGroups(config, log)
    return None

"""Where the test suite's time goes: each test's wall time and the CPU the machine spent on it.

    PYTHONPATH=benchmarks .venv/bin/python -m pytest -p suite_cpu   # writes suite-cpu.csv
    .venv/bin/python benchmarks/suite_cpu.py suite-cpu.csv          # the summary

As a pytest plugin it appends one row per test (wall seconds, busy CPU seconds of the whole
machine from /proc/stat, the test's id) to `$SUITE_CPU_OUT` (default `suite-cpu.csv`). The
machine's, not pytest's: a test's cost is mostly in processes it starts (Ray's workers, the
controller, podman), which no per-process clock of pytest sees. Run it on an otherwise idle
machine. The summary says how busy the machine was, the floor that CPU sets on any run of the
same tests on this many cores, and the files and tests that cost most.
"""

from __future__ import annotations

import collections
import csv
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

_HZ = os.sysconf("SC_CLK_TCK")


def busy_seconds() -> float:
    """CPU seconds the machine has spent on anything but idling, since boot (all cores)."""
    with open("/proc/stat") as stat:
        ticks = [int(v) for v in stat.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / _HZ  # less idle and iowait


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    start, busy = time.monotonic(), busy_seconds()
    yield
    row = [f"{time.monotonic() - start:.2f}", f"{busy_seconds() - busy:.2f}", item.nodeid]
    with Path(os.environ.get("SUITE_CPU_OUT", "suite-cpu.csv")).open("a", newline="") as f:
        csv.writer(f).writerow(row)


def summary(path: Path, top: int = 15) -> str:
    rows = [(float(w), float(c), test) for w, c, test in csv.reader(path.open())]
    wall, cpu = sum(r[0] for r in rows), sum(r[1] for r in rows)
    cores = os.cpu_count() or 1
    by_file: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for w, c, test in rows:
        by_file[test.split("::")[0]][0] += w
        by_file[test.split("::")[0]][1] += c
    long = [r for r in rows if r[0] >= 10]
    lines = [
        f"{len(rows)} tests: {wall / 60:.1f} min of wall time, {cpu:.0f} CPU-s busy "
        f"({cpu / wall:.2f} of {cores} cores, {cpu / wall / cores:.0%})",
        f"the CPU alone needs {cpu / cores / 60:.1f} min on {cores} cores, all of them busy",
        f"{len(long)} tests of 10 s or more: {sum(r[0] for r in long) / 60:.1f} min, "
        f"{sum(r[1] for r in long):.0f} CPU-s",
        "", "by file: wall s, busy CPU-s",
    ]  # fmt: skip
    for name, (w, c) in sorted(by_file.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"  {w:7.1f} {c:7.1f}  {name}")
    lines += ["", "by test: wall s, busy CPU-s"]
    lines += [f"  {w:7.1f} {c:7.1f}  {t}" for w, c, t in sorted(rows, key=lambda r: -r[1])[:top]]
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(Path(sys.argv[1] if len(sys.argv) > 1 else "suite-cpu.csv")))

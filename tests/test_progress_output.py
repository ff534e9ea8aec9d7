"""A job's output as it is written, not line by line: a real tqdm bar, and 50 MB without a
newline, through the embedded cluster (node/output_splitter.py, node_agent `_pump`)."""

from __future__ import annotations

import re
import time
from pathlib import Path

from conftest import NODE_SECRET_NAME, NODE_SECRET_VALUE, make_job

from orchestrator.client.api import push
from orchestrator.client.jobs import JobHandle
from orchestrator.lifecycle import JobState
from orchestrator.node.output_splitter import MAX_LINE_CHARS
from orchestrator.storage.logs import is_progress, read_logs
from orchestrator.storage.root import StorageRoot

MiB = 2**20

CONFIG = f"""
from truss_train import definitions
project = definitions.TrainingProject(
    name="output",
    job=definitions.TrainingJob(
        image=definitions.Image(base_image="python:3.11"),
        compute=definitions.Compute(memory="256Mi"),
        runtime=definitions.Runtime(
            start_commands=["python main.py {{args}}"],
            environment_variables={{
                "TOKEN": definitions.SecretReference(name="{NODE_SECRET_NAME}")
            }},
        ),
    ),
)
"""

# tqdm as a training loop draws it without a terminal: every state after a `\r`, one newline at
# the end; a secret in its description, as a run name or a token can end up there.
BAR = """
import os, sys, time
from tqdm import tqdm
for _ in tqdm(range(300), desc=f"train {os.environ['TOKEN']}", mininterval=0, file=sys.stdout,
              ascii=True):
    time.sleep(0.025)
print("after the bar", flush=True)
"""


def test_a_progress_bar_shows_while_it_runs_masked_and_is_stored_compactly(
    tmp_path, storage_root, ray_cluster
):
    config = make_job(tmp_path / "bar", CONFIG.replace("{args}", ""), {"main.py": BAR})
    job = push(config, storage_root=storage_root)
    deadline = time.monotonic() + 90
    while True:  # a state of the bar, stored while the bar still runs
        lines = job.logs()
        moving = [x for x in lines if is_progress(x) and "/300" in x and "300/300" not in x]
        moving = [x for x in moving if 0 < int(re.search(r" (\d+)/300", x)[1]) < 300]
        if moving and not any("300/300" in x for x in lines):
            break
        assert time.monotonic() < deadline, lines
        assert not job.status().is_terminal, lines
        time.sleep(0.1)
    assert all("train *****" in x for x in moving), moving

    assert job.wait(timeout=90) == JobState.COMPLETED, job.logs()[-10:]
    lines = job.logs()
    assert not any(NODE_SECRET_VALUE in x for x in lines)
    bar = [x for x in lines if "/300" in x]
    finals = [x for x in bar if not is_progress(x)]
    assert len(finals) == 1 and "300/300" in finals[0] and "train *****" in finals[0]
    assert len(bar) <= 20, bar  # tqdm wrote 301 states over ~7.5 s; about one a second kept
    after = next(i for i, x in enumerate(lines) if x.endswith("] after the bar"))
    assert lines.index(finals[0]) == after - 1  # in order: the bar's end, then what follows


# Prints its agent's pid, then on a signal file writes 50 MB with no newline and waits again, so
# the agent's peak memory can be read before and after while it still runs.
DUMP = """
import os, sys, time
import psutil
agent = psutil.Process()
while agent is not None and "ray::" not in " ".join(agent.cmdline()):
    agent = agent.parent()
print(f"agent {agent.pid}", flush=True)
def wait(flag):
    deadline = time.time() + 120
    while not os.path.exists(flag) and time.time() < deadline:
        time.sleep(0.05)
wait(sys.argv[1] + ".go")
for _ in range(50):
    sys.stdout.buffer.write(b"x" * 2**20)
sys.stdout.buffer.write(b"\\ndumped\\n")
sys.stdout.flush()
wait(sys.argv[1] + ".end")
"""


def peak_rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(x for x in status.splitlines() if x.startswith("VmHWM:")).split()[1]) * 1024


def follow_until(job: JobHandle, text: str, cursor: int, timeout: float = 120) -> tuple[list, int]:
    """New stored lines until one holds `text` (read a segment at a time, not all again)."""
    root, seen = StorageRoot(job.record.storage_root), []
    deadline = time.monotonic() + timeout
    while not any(text in x for x in seen):
        assert time.monotonic() < deadline, seen[-3:]
        assert not job.status().is_terminal, job.logs()[-5:]
        lines, cursor = read_logs(root, job.id, cursor)
        seen += lines
        time.sleep(0.1)
    return seen, cursor


def test_50_mb_without_a_newline_arrives_whole_without_growing_the_agent(
    tmp_path, storage_root, ray_cluster
):
    flag = tmp_path / "flag"
    config = make_job(tmp_path / "dump", CONFIG.replace("{args}", str(flag)), {"main.py": DUMP})
    job = push(config, storage_root=storage_root)
    try:
        seen, cursor = follow_until(job, "] agent ", -1)
        agent = int(next(x for x in seen if "] agent " in x).split("] agent ")[1])
        before = peak_rss(agent)
        Path(f"{flag}.go").touch()
        dumped, _ = follow_until(job, "] dumped", cursor)  # ends with it: the last line
        grown = peak_rss(agent) - before
    finally:
        Path(f"{flag}.go").touch()
        Path(f"{flag}.end").touch()
    assert job.wait(timeout=120) == JobState.COMPLETED
    # Read and forwarded a piece at a time (a 1 MiB read, a 4 MiB queue, 16 stream items of
    # 64 KiB), whatever the size: +14 to +23 MiB seen, the allocator's high-water mark included.
    # Read as one line, these 50 MB took the agent's peak up by 201 MiB.
    assert grown < 64 * MiB, f"the agent's peak RSS grew by {grown / MiB:.0f} MiB"
    texts = [x.split("] ", 1)[1] for x in dumped if x.startswith("[rank 0 ")]
    xs = [t for t in texts if t and set(t) == {"x"}]
    assert sum(map(len, xs)) == 50 * MiB  # every byte, in lines of 256 KiB, each whole again
    assert {len(x) for x in xs[:-1]} == {MAX_LINE_CHARS} and not any(map(is_progress, dumped))

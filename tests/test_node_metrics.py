"""The rank sampler on its own (no Ray): real processes, real directories, a real storage root.

tests/test_multinode.py runs it inside a 2-node gang, with Ray's metrics agent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest
from test_checkpoint_upload import uploader, write_checkpoint

from orchestrator.agents.command_runner import CommandRunner
from orchestrator.agents.messages import MetricsRequest
from orchestrator.agents.node_agent import NodeAgent
from orchestrator.node import node_metrics
from orchestrator.node.node_metrics import (
    DiskSizes,
    GpuProbe,
    MetricsSampler,
    ProcessTree,
    disk_bytes,
)
from orchestrator.node.secrets import SecretMasker
from orchestrator.storage.metrics import (
    MetricsSample,
    RankMetrics,
    read_job_metrics,
    read_rank_metrics,
    write_rank_metrics,
)
from orchestrator.storage.records import NodeInfo
from orchestrator.storage.root import StorageRoot

MiB = 2**20

# Holds 200 MiB (every page touched, so it is resident) until its stdin closes.
HOLDER = textwrap.dedent("""
    import sys, time
    held = bytearray(200 * 2**20)
    held[::4096] = b"x" * len(range(0, len(held), 4096))
    print("ready", flush=True)
    sys.stdin.read()
""")
BUSY = "import time\nend = time.time() + 60\nwhile time.time() < end: pass\n"


@pytest.fixture
def burner():
    """A job's command as it runs: a shell with two Pythons under it, one burning a core, one
    holding memory; in a process group of its own, ended whole."""
    shell = subprocess.Popen(
        ["/bin/sh", "-c", f"{sys.executable} -c '{BUSY}' & {sys.executable} -c '{HOLDER}'; :"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert shell.stdout is not None and shell.stdout.readline().strip() == "ready"
        yield shell
    finally:
        os.killpg(shell.pid, signal.SIGKILL)
        shell.wait()


def cpu_s(burner: subprocess.Popen) -> float:
    """What the burner's processes have used, as the kernel counts it: what they got of the
    machine's two cores, which the suite's Ray tests running beside these share."""
    shell = psutil.Process(burner.pid)
    return sum(sum(p.cpu_times()[:2]) for p in (shell, *shell.children(recursive=True)))


def test_the_process_tree_counts_the_commands_cpu_and_memory_not_the_root(burner):
    tree = ProcessTree()
    used, started = cpu_s(burner), time.monotonic()
    tree.sample(os.getpid())
    time.sleep(1.0)
    cores, rss, processes = tree.sample(os.getpid())
    got = (cpu_s(burner) - used) / (time.monotonic() - started)
    # This test process (the root) idles; under it one child burns a core and one holds 200 MiB.
    # What the burner gets of the machine's two cores depends on the other work there (the
    # suite's Ray tests run beside this one): the tree sees what it got.
    assert got > 0.1, got
    assert abs(cores - got) <= 0.1 + 0.2 * got, (cores, got)
    assert rss >= 200 * MiB, rss
    assert processes >= 3  # the shell and both Pythons
    # The root's own use is not the job's: with no children there is nothing to count.
    assert ProcessTree().sample(burner.pid + 10**7) == (0.0, 0, 0)


def test_a_command_under_its_guard_is_counted_alone_not_the_guards_watcher(tmp_path):
    """The rank's sampler starts from the guard (CommandRunner.pid()): the guard's watcher, a
    fork of it that only waits, is no process of the job's."""
    runner = CommandRunner(lambda line, progress: line)
    stream = runner.run(("exec sleep 30",), dict(os.environ), str(tmp_path), SecretMasker([]))
    threading.Thread(target=lambda: list(stream), daemon=True).start()
    try:
        deadline = time.monotonic() + 10
        # Until the command's process has exec'd it is a fork of the guard, its command line
        # the guard's: the watcher's look (a sample then counts nothing, for a moment).
        while (guard := runner.pid()) is None or not _exec_d(psutil.Process(guard)):
            assert time.monotonic() < deadline, "the guard, its watcher and the command start"
            time.sleep(0.05)
        assert ProcessTree().sample(guard)[2] == 1  # `sleep` alone
    finally:
        runner.stop(grace_s=2)


def _exec_d(guard: psutil.Process) -> bool:
    """Whether the guard has its watcher and a child that runs something else: the command."""
    children = guard.children()
    return len(children) >= 2 and any(c.cmdline() != guard.cmdline() for c in children)


def test_disk_bytes_counts_hard_links_once_and_does_not_follow_links(tmp_path):
    data = tmp_path / "tree"
    (data / "sub").mkdir(parents=True)
    (data / "sub" / "a.bin").write_bytes(os.urandom(3 * MiB))
    os.link(data / "sub" / "a.bin", data / "a-again.bin")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "big.bin").write_bytes(os.urandom(8 * MiB))
    (data / "to-outside").symlink_to(outside)
    size = disk_bytes(data)
    assert 3 * MiB <= size < 4 * MiB, size
    assert disk_bytes(tmp_path / "missing") == 0


def test_a_tree_that_is_slow_to_walk_is_walked_less_often(tmp_path, monkeypatch):
    walks = []

    def slow_walk(path: Path) -> int:
        walks.append(path)
        end = time.thread_time() + 0.02  # 20 ms of CPU: walked again after 4 s at the earliest
        while time.thread_time() < end:
            pass
        return 1

    monkeypatch.setattr(node_metrics, "disk_bytes", slow_walk)
    sizes = DiskSizes(lambda: {"checkpoints": [tmp_path]})
    for _ in range(20):
        assert sizes.sample() == {"checkpoints": 1}
    assert len(walks) == 1


def test_gpus_are_left_out_without_a_driver_or_without_nvidia_ml_py(monkeypatch):
    """This machine has no NVIDIA driver; `nvidia-ml-py` is installed. Ray sets
    CUDA_VISIBLE_DEVICES from declared GPUs even where none exist: that must not fail."""
    probe = GpuProbe(["0", "1"])
    assert (probe.handles, probe.sample()) == ({}, [])
    probe.close()
    monkeypatch.setitem(sys.modules, "pynvml", None)  # the package absent: import fails
    probe = GpuProbe(["0"])
    assert probe.sample() == []
    assert GpuProbe([]).sample() == []


def sampler(root: StorageRoot, pid: int | None, tmp_path: Path, interval: float = 0.2, **kw):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir(exist_ok=True)
    metrics = RankMetrics(job_id="job-m", rank=1, interval_s=interval, memory_request_bytes=2**30)
    return MetricsSampler(
        metrics, root.url, root_pid=lambda: pid,
        dirs=lambda: {"checkpoints": [checkpoints], "cache": []}, disk_of=tmp_path,
        gpus=["0"], uploads=kw.get("uploads", lambda: None), gauges=None,
    )  # fmt: skip


def test_samples_are_stored_beside_the_job_and_the_last_one_on_stop(burner, tmp_path):
    root = StorageRoot(tmp_path / "root")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "weights.bin").write_bytes(os.urandom(5 * MiB))
    used, started = cpu_s(burner), time.monotonic()
    s = sampler(root, os.getpid(), tmp_path, interval=0.5)
    deadline = time.monotonic() + 20
    while (stored := read_rank_metrics(root, "job-m", 1)) is None:
        assert time.monotonic() < deadline, "nothing stored"
        time.sleep(0.05)
    time.sleep(1.5)
    s.stop()
    got = (cpu_s(burner) - used) / (time.monotonic() - started)
    stored = read_rank_metrics(root, "job-m", 1)
    assert stored is not None and len(stored.samples) >= 4, stored
    assert [m.rank for m in read_job_metrics(root, "job-m")] == [1]
    last = stored.samples[-1]
    assert time.time() - last.at < 2  # stop's own sample, written by stop
    assert got > 0.1, got
    # The busiest sample saw at least about what the burner got on average.
    assert max(x.cpu_cores for x in stored.samples) >= 0.8 * got - 0.05, (stored.samples, got)
    assert last.memory_bytes >= 200 * MiB
    assert last.disk_bytes["checkpoints"] >= 5 * MiB
    assert last.disk_free_bytes and last.disk_total_bytes and last.gpus == []
    assert stored.memory_request_bytes == 2**30


def test_an_unreachable_storage_root_never_stops_the_sampling(tmp_path):
    """Flushes fail at once (no riding out an outage on the sampler's thread); samples go on
    and are written once the root answers."""
    blocked = tmp_path / "root"
    blocked.write_text("a file where the storage root's directory should be")
    root = StorageRoot(blocked)
    s = sampler(root, None, tmp_path, interval=0.1)
    started = time.monotonic()
    assert s.flush() is False and s.flush_error
    assert time.monotonic() - started < 5
    count = len(s.metrics.samples)
    deadline = time.monotonic() + 10
    while len(s.metrics.samples) < count + 5:
        assert time.monotonic() < deadline, "sampling stopped"
        time.sleep(0.05)
    blocked.unlink()
    s.stop()
    stored = read_rank_metrics(StorageRoot(blocked), "job-m", 1)
    assert stored is not None and len(stored.samples) >= count + 5


def test_the_checkpoint_backlog_is_what_waits_and_then_what_was_uploaded(tmp_path, s3_outage):
    bucket = f"backlog-{uuid.uuid4().hex[:8]}"
    root = StorageRoot(f"s3://{bucket}/root")
    root.fs.mkdir(bucket)
    up = uploader(root, tmp_path / "ckpt", settle_s=0.1)
    stats = up.upload_stats()
    assert (stats.waiting, stats.uploaded) == (0, 0)
    s3_outage.down()
    write_checkpoint(tmp_path / "ckpt" / "checkpoint-1", {"model.bin": os.urandom(2 * MiB)})
    deadline = time.monotonic() + 20
    while (stats := up.upload_stats()).waiting == 0 or (stats.oldest_waiting_s or 0) < 1:
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)
    assert stats.waiting_bytes == 2 * MiB and stats.uploaded == 0
    s3_outage.up()
    deadline = time.monotonic() + 60
    while (stats := up.upload_stats()).uploaded == 0:
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)
    assert (stats.waiting, stats.waiting_bytes, stats.oldest_waiting_s) == (0, 0, None)
    assert stats.uploaded_bytes == 2 * MiB and stats.last_upload_s is not None


def test_a_long_series_is_thinned_but_keeps_its_ends_and_recent_detail():
    metrics = RankMetrics(job_id="j", rank=0)
    for i in range(10_000):
        metrics.add(MetricsSample(at=float(i), cpu_cores=1, memory_bytes=1, processes=1), 1000)
    at = [s.at for s in metrics.samples]
    assert len(at) <= 1000
    assert at[0] == 0.0 and at[-1] == 9999.0
    assert at[-400:] == [float(i) for i in range(9600, 10_000)]  # the recent past, whole
    assert at == sorted(at)


def test_once_the_commands_have_exited_stop_adds_no_empty_sample(tmp_path):
    root = StorageRoot(tmp_path / "root")
    running = [os.getpid()]
    s = sampler(root, None, tmp_path, interval=0.2)
    s._root_pid = lambda: running[0] if running else None
    deadline = time.monotonic() + 20
    while len(s.metrics.samples) < 2:
        assert time.monotonic() < deadline, "no samples"
        time.sleep(0.05)
    running.clear()  # the commands exit, then the agent stops the sampler
    s._stop.set()
    s._thread.join()
    count = len(s.metrics.samples)
    s.stop()
    stored = read_rank_metrics(root, "job-m", 1)
    assert stored is not None and len(stored.samples) == count  # written, nothing added


def test_a_replacement_agent_goes_on_with_the_stored_series_and_never_waits_on_storage(
    tmp_path, s3_outage, monkeypatch
):
    """A lost node's rank starts again on another node: its samples go on from what was stored.
    A storage root that does not answer then must not hold up the rank's commands."""
    monkeypatch.setenv("ORCHESTRATOR_NODE_ROOT", str(tmp_path / "node"))
    bucket = f"series-{uuid.uuid4().hex[:8]}"
    root = StorageRoot(f"s3://{bucket}/root")
    root.fs.mkdir(bucket)
    earlier = RankMetrics(job_id="job-r", rank=1, node_id="lost-node")
    earlier.add(MetricsSample(at=1.0, cpu_cores=3.0, memory_bytes=MiB, processes=2))
    write_rank_metrics(root, earlier)
    request = MetricsRequest(project="p", interval_s=0.2)

    def replacement() -> NodeAgent:
        agent = NodeAgent("job-r", 1, root.url)
        agent.node_info = lambda: NodeInfo(  # no Ray here
            rank=1, node_id="new-node", ip="127.0.0.1", hostname="h2", working_dir="/w"
        )
        return agent

    agent = replacement()
    agent._start_sampling(request)
    time.sleep(0.6)
    agent._end_sampling()
    stored = read_rank_metrics(root, "job-r", 1)
    assert stored is not None and stored.samples[0].at == 1.0 and len(stored.samples) >= 2
    assert stored.node_id == "new-node"

    s3_outage.down()
    agent = replacement()
    started = threading.Thread(target=agent._start_sampling, args=(request,), daemon=True)
    started.start()
    started.join(timeout=20)
    assert not started.is_alive(), "the rank's start waited on the storage root"
    agent._end_sampling()

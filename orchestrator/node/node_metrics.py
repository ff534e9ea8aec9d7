"""What a rank's commands use on its node, sampled by its node agent while they run.

Every `interval_s` a thread measures the job's processes (the command's process tree: CPU time
per second and resident memory, through psutil), the GPUs the rank holds (NVML, where
`nvidia-ml-py` and a driver are present; nothing, and no error, where not), bytes on disk under
the rank's directories, the node's network traffic and the rank's checkpoint upload backlog.
Each sample is set on Ray gauges (node/metric_series.py), so Ray's metrics agent serves it to
Prometheus, and kept in the rank's series, which is written to the storage root every
`FLUSH_S` and when the commands end (storage/metrics.py), so it outlives the cluster.

Sampling never gets in the training's way: it only reads, a failure to read one thing leaves
that thing out of the sample, and a storage root that does not answer is tried again at the
next flush while the samples wait in memory (bounded by the series' thinning).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from orchestrator.node import metric_series as series
from orchestrator.storage.metrics import (
    GpuSample,
    MetricsSample,
    RankMetrics,
    UploadStats,
    write_rank_metrics,
)
from orchestrator.storage.retry import StorageRetry
from orchestrator.storage.root import StorageRoot

FLUSH_S = 10.0  # at most this long between writes of the series to the storage root
FIRST_SAMPLE_S = 1.0
DISK_WALK_SHARE = 0.005  # walks of the directories get at most this share of one core


class ProcessTree:
    """CPU and memory of the processes under one root (the root itself, our guard, and the
    guard's watcher, a fork of it, left out).

    CPU is the time each process used since the last sample, so a process that starts and ends
    between two samples is not seen, and RSS is summed (pages shared between processes count
    once for each of them, as `top` shows them).
    """

    def __init__(self) -> None:
        self._cpu: dict[tuple[int, float], float] = {}  # (pid, create time) -> cpu seconds
        self._at: float | None = None

    def sample(self, root_pid: int | None) -> tuple[float, int, int]:
        """(cores, rss bytes, processes)."""
        now = time.time()
        try:
            procs = _commands(psutil.Process(root_pid)) if root_pid else []
        except psutil.Error:
            procs = []
        cpu: dict[tuple[int, float], float] = {}
        used = 0.0
        rss = 0
        born = now
        for p in procs:
            try:
                with p.oneshot():
                    key = (p.pid, p.create_time())
                    times = p.cpu_times()
                    total = times.user + times.system
                    rss += p.memory_info().rss
            except psutil.Error:
                continue  # ended while looked at
            cpu[key] = total
            born = min(born, key[1])
            used += total - self._cpu.get(key, 0.0)
        since = self._at if self._at is not None else born
        self._cpu, self._at = cpu, now
        cores = used / (now - since) if now - since > 1e-3 else 0.0
        return round(max(cores, 0.0), 3), rss, len(cpu)


def _commands(root: psutil.Process) -> list[psutil.Process]:
    """What runs under `root` but its own forks (the guard's watcher has its command line)."""
    line = root.cmdline()
    watchers = set()
    for child in root.children():
        with contextlib.suppress(psutil.Error):
            if child.cmdline() == line:
                watchers.add(child.pid)
    return [p for p in root.children(recursive=True) if p.pid not in watchers]


class GpuProbe:
    """The GPUs a rank holds, through NVML. Without `nvidia-ml-py`, a driver or GPUs: none."""

    def __init__(self, visible: list[str]) -> None:
        self.handles: dict[int, Any] = {}
        self.names: dict[int, str] = {}
        self._nvml: Any = None
        self._memory_v2 = True  # until the binding or the driver shows it has no v2
        if not visible:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # no module, no driver, no device: a CPU node
            return
        self._nvml = pynvml
        for device in visible:
            with contextlib.suppress(Exception):
                handle = (
                    pynvml.nvmlDeviceGetHandleByIndex(int(device))
                    if device.isdigit()
                    else pynvml.nvmlDeviceGetHandleByUUID(device)
                )
                index = pynvml.nvmlDeviceGetIndex(handle)
                self.handles[index] = handle
                name = pynvml.nvmlDeviceGetName(handle)
                self.names[index] = name.decode() if isinstance(name, bytes) else name

    def sample(self) -> list[GpuSample]:
        found = []
        for index, handle in self.handles.items():
            try:
                util = self._nvml.nvmlDeviceGetUtilizationRates(handle)
                memory = self._memory(handle)
            except Exception:
                continue
            sample = GpuSample(
                index=index, utilization_pct=float(util.gpu),
                memory_used_bytes=int(memory.used), memory_total_bytes=int(memory.total),
            )  # fmt: skip
            found.append(sample)
        return found

    def _memory(self, handle: Any) -> Any:
        """The device's memory as `nvidia-smi` counts it. NVML's first memory call counts the
        driver's reserved memory (480 MiB on an H100 with driver 580) as used, so an idle GPU read
        480 MiB and every sample that much above nvidia-smi's (seen on the device, 2026-11-27);
        its v2 gives the reserved memory apart. A binding or driver without v2: the first call."""
        nvml = self._nvml
        if self._memory_v2:
            try:
                return nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
            except Exception:
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)  # this failing too: the GPU's error
                self._memory_v2 = False  # v1 answers where v2 does not: no v2 here
                return memory
        return nvml.nvmlDeviceGetMemoryInfo(handle)

    def close(self) -> None:
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()


def disk_bytes(path: Path) -> int:
    """Bytes allocated under `path` as `du` counts them: links not followed, hard links once."""
    total = 0
    seen: set[tuple[int, int]] = set()
    stack = [path]
    while stack:
        try:
            entries = os.scandir(stack.pop())
        except OSError:
            continue
        with entries:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    stack.append(Path(entry.path))
                elif (st.st_dev, st.st_ino) not in seen:
                    if st.st_nlink > 1:
                        seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
    return total


class DiskSizes:
    """Sizes of a rank's directories, walked again only as often as DISK_WALK_SHARE allows: a
    checkpoint or cache of many files is measured less often, never at the training's cost."""

    def __init__(self, dirs: Callable[[], dict[str, list[Path]]]) -> None:
        self._dirs = dirs
        self._next = 0.0
        self.sizes: dict[str, int] = {}

    def sample(self) -> dict[str, int]:
        now = time.monotonic()
        if now >= self._next:
            started = time.thread_time()
            self.sizes = {
                name: sum(disk_bytes(p) for p in paths) for name, paths in self._dirs().items()
            }
            spent = time.thread_time() - started
            self._next = now + spent / DISK_WALK_SHARE
        return dict(self.sizes)


class NetworkRate:
    """The node's traffic per second on every interface but loopback."""

    def __init__(self) -> None:
        self._last: tuple[float, int, int] | None = None

    def sample(self) -> tuple[float, float]:
        try:
            counters = psutil.net_io_counters(pernic=True)
        except Exception:
            return 0.0, 0.0
        sent = sum(c.bytes_sent for nic, c in counters.items() if nic != "lo")
        recv = sum(c.bytes_recv for nic, c in counters.items() if nic != "lo")
        now = time.monotonic()
        last, self._last = self._last, (now, sent, recv)
        if last is None or now - last[0] <= 0:
            return 0.0, 0.0
        dt = now - last[0]
        return round((sent - last[1]) / dt, 1), round((recv - last[2]) / dt, 1)


class Gauges:
    """The Ray gauges a rank's samples are set on (metric_series.ALL)."""

    def __init__(self, job_id: str, project: str, rank: int) -> None:
        from ray.util.metrics import Gauge

        self.tags = {"job_id": job_id, "project": project, "rank": str(rank)}
        self.gauges = {
            s.name: Gauge(s.name, description=s.description, tag_keys=s.tag_keys)
            for s in series.ALL
        }

    def _set(self, s: series.Series, value: float | None, **extra: str) -> None:
        if value is not None:
            self.gauges[s.name].set(value, tags={**self.tags, **extra})

    def publish(self, sample: MetricsSample, memory_request: int | None) -> None:
        self._set(series.CPU_CORES, sample.cpu_cores)
        self._set(series.MEMORY, sample.memory_bytes)
        self._set(series.MEMORY_REQUEST, memory_request)
        for gpu in sample.gpus:
            index = str(gpu.index)
            self._set(series.GPU_UTILIZATION, gpu.utilization_pct, gpu=index)
            self._set(series.GPU_MEMORY, gpu.memory_used_bytes, gpu=index)
            self._set(series.GPU_MEMORY_TOTAL, gpu.memory_total_bytes, gpu=index)
        for name, size in sample.disk_bytes.items():
            self._set(series.DISK, size, dir=name)
        self._set(series.DISK_FREE, sample.disk_free_bytes)
        self._set(series.NET_SENT, sample.net_sent_bytes_per_s)
        self._set(series.NET_RECV, sample.net_recv_bytes_per_s)
        if (up := sample.uploads) is not None:
            self._set(series.CHECKPOINTS_WAITING, up.waiting)
            self._set(series.CHECKPOINT_BYTES_WAITING, up.waiting_bytes)
            self._set(series.CHECKPOINT_OLDEST_WAITING, up.oldest_waiting_s or 0.0)
            self._set(series.CHECKPOINT_UPLOADED_BYTES, up.uploaded_bytes)
            self._set(series.CHECKPOINT_LAST_UPLOAD, up.last_upload_s)


class MetricsSampler:
    """Samples one rank every `interval_s` on a thread of its own until `stop`."""

    def __init__(
        self,
        metrics: RankMetrics,
        storage_url: str,
        root_pid: Callable[[], int | None],
        dirs: Callable[[], dict[str, list[Path]]],
        disk_of: Path,
        gpus: list[str],
        uploads: Callable[[], UploadStats | None],
        gauges: Gauges | None,
        beat: Callable[[], tuple[float, int | None] | None] = lambda: None,
    ) -> None:
        self.metrics = metrics
        self._beat = beat  # the commands' latest orchestrator.progress(), for the stuck detector
        self._storage = no_wait_root(storage_url)  # a flush that fails goes again at the next
        self._root_pid, self._disk_of, self._uploads = root_pid, disk_of, uploads
        self._tree, self._disks, self._net = ProcessTree(), DiskSizes(dirs), NetworkRate()
        self._gpus = GpuProbe(gpus)
        self.metrics.gpu_names.update(self._gpus.names)
        self._gauges = gauges
        self._stop = threading.Event()
        self._flushed_at = 0.0
        self.flush_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="metrics-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        """The first sample after a second (a short command is seen too), then every interval."""
        interval = self.metrics.interval_s
        wait = min(FIRST_SAMPLE_S, interval)
        while not self._stop.wait(wait):
            self._step(time.monotonic() - self._flushed_at >= FLUSH_S)
            wait = interval

    def _step(self, flush: bool) -> None:
        with contextlib.suppress(Exception):  # never the training's problem
            self.sample()
        if flush:
            self.flush()

    def sample(self) -> MetricsSample:
        cores, rss, processes = self._tree.sample(self._root_pid())
        sent, recv = self._net.sample()
        try:
            usage = shutil.disk_usage(self._disk_of)
            free, total = usage.free, usage.total
        except OSError:
            free = total = None
        sample = MetricsSample(
            at=round(time.time(), 3), cpu_cores=cores, memory_bytes=rss, processes=processes,
            gpus=self._gpus.sample(), disk_bytes=self._disks.sample(), disk_free_bytes=free,
            disk_total_bytes=total, net_sent_bytes_per_s=sent, net_recv_bytes_per_s=recv,
            uploads=self._upload_stats(),
        )  # fmt: skip
        with contextlib.suppress(Exception):
            if (beat := self._beat()) is not None:
                sample.beat_at, sample.beat_step = beat
        self.metrics.add(sample)
        if self._gauges is not None:
            with contextlib.suppress(Exception):
                self._gauges.publish(sample, self.metrics.memory_request_bytes)
        return sample

    def _upload_stats(self) -> UploadStats | None:
        try:
            return self._uploads()
        except Exception:
            return None

    def flush(self) -> bool:
        self._flushed_at = time.monotonic()
        try:
            write_rank_metrics(self._storage, self.metrics)
        except Exception as e:
            self.flush_error = f"{type(e).__name__}: {e}"
            return False
        self.flush_error = None
        return True

    def stop(self) -> None:
        """A last sample while the commands still run (a stop: their last moments are kept; once
        they have exited there is nothing left to measure), and a last flush."""
        self._stop.set()
        self._thread.join(timeout=self.metrics.interval_s + 30)
        if self._root_pid() is not None:
            with contextlib.suppress(Exception):
                self.sample()
        self.flush()
        self._gpus.close()


def no_wait_root(url: str) -> StorageRoot:
    """The storage root without riding out an outage: a call fails at once (the sampler tries
    again later), so sampling never holds up the rank or its commands."""
    return StorageRoot(url, StorageRetry(url, 0, say=_quiet))


def _quiet(_: str) -> None:
    pass

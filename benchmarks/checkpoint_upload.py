"""What checkpoint upload costs the training loop, and how fast a checkpoint reaches storage.

A CPU training loop (an MLP, one torch thread) writes a checkpoint every K steps into
`checkpoint-<step>/` (written into a hidden directory, then renamed). After an unmeasured
warm-up it runs three ways, same steps and seeds:
- none: no checkpoints, the baseline step time (run first and again last);
- async: `CheckpointUploader` in a separate process uploads in the background, `flush` at the end;
- sync: the loop uploads each checkpoint itself with `CheckpointStore.upload` and waits, which
  is what Ray Train's default synchronous `ray.train.report(checkpoint=...)` amounts to.
In the async run it also times each checkpoint's rename until its manifest exists. Then, with
the loop stopped and the uploader idle, it times that for a probe checkpoint against a raw
`s3fs.put` of the same files.

S3 is moto's ThreadedMotoServer on 127.0.0.1, in its own process: it stands in for a remote
service, so it must not share the training process's GIL. With --pin (the default) the
training loop has CPU 0 to itself while it runs; the uploader and moto share the others.
glibc malloc is told to keep freed memory (--keep-freed-memory, the default), as a GPU caching
allocator would, so that step times do not swing with page faults.

Run: .venv/bin/python benchmarks/checkpoint_upload.py [--steps 20] [--ckpt-mb 200] [--every 5]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import multiprocessing as mp
import os
import re
import resource
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from common import serve_moto

PROJECT, JOB_ID, RANK = "bench-ckpt", "job-bench", 0
BUCKET = "bench"
WARMUP_STEPS = 3
PROBE_POLL_S = 0.02
GIVE_UP_S = 120
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters

# --- the two helper processes ----------------------------------------------------------------


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


UPLOADED = re.compile(r"checkpoint (\S+) uploaded.* in ([\d.]+) s$")


def _upload_times(events: list[str]) -> dict[str, float]:
    """name -> seconds its (last) upload took, from the uploader's event lines."""
    return {m[1]: float(m[2]) for e in events if (m := UPLOADED.search(e))}


def run_uploader(conn: Connection, storage_root: str, local_dir: str, settings: dict) -> None:
    """The node's uploader, as on a cluster: its own process, told only when to flush."""
    from orchestrator.agents.checkpoint_uploader import CheckpointUploader

    uploader = CheckpointUploader(
        PROJECT, JOB_ID, RANK, storage_root, local_dir, settings, None, {}
    )
    uploader.ready()
    conn.send("ready")
    while conn.recv() != "flush":
        conn.send(_upload_times(uploader.events))
    start = time.monotonic()
    result = uploader.flush(clean=True)
    entries = result.entries
    conn.send(
        {
            "flush_s": time.monotonic() - start,
            "uploaded_s": _upload_times(result.events),
            "pending": [e.name for e in entries if e.state == "pending"],
            "failed": {e.name: e.reason for e in entries if e.state == "failed"},
            "cpu_s": _cpu_s(),
        }
    )


def pin(pid: int, cpus: set[int] | None) -> None:
    """Set the CPUs of every thread of a process (threads it starts later inherit them)."""
    if cpus is None:
        return
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(tid), cpus)


@dataclass
class Layout:
    """Where the processes run. While a loop runs (with --pin), training has one core to itself
    and the uploader and moto (a stand-in for a remote S3) share the others; else all share all."""

    train: set[int] | None
    side: set[int] | None
    every: set[int]
    side_pids: list[int] = field(default_factory=list)

    def training(self) -> None:
        pin(os.getpid(), self.train)
        for pid in self.side_pids:
            pin(pid, self.side)

    def free(self) -> None:
        for pid in [os.getpid(), *self.side_pids]:
            pin(pid, self.every)


def keep_freed_memory() -> bool:
    """Make glibc malloc keep freed memory, as a GPU caching allocator does. Otherwise each
    step's gradients come back from the kernel as fresh zeroed pages (20-35k page faults a
    step here) and the step time swings by up to 2x with whatever else the machine does."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 30) and libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
    )


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# --- the training loop -----------------------------------------------------------------------


@dataclass
class Run:
    way: str
    step_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)  # the training thread's CPU time
    is_ckpt: list[bool] = field(default_factory=list)
    write_s: list[float] = field(default_factory=list)  # local write, rename included
    upload_s: list[float] = field(default_factory=list)  # sync only: the blocking upload
    renamed_at: dict[str, float] = field(default_factory=dict)  # name -> time.time()
    loop_s: float = 0.0
    loop_cpu_s: float = 0.0
    loop_faults: int = 0  # minor page faults of the training process during the loop

    def median_plain(self, values: list[float] | None = None) -> float:
        """Median over the steps that wrote no checkpoint."""
        values = self.step_s if values is None else values
        return statistics.median(v for v, c in zip(values, self.is_ckpt, strict=True) if not c)

    def mean_all(self) -> float:
        return statistics.mean(self.step_s)


def model_shape(ckpt_mb: float, depth: int = 4) -> tuple[int, int, int]:
    """(width, depth, batch): fp32 weights plus AdamW's two moments come to about ckpt_mb MB;
    the batch keeps a step near 0.1 s on one thread whatever the width."""
    width = max(256, round(math.sqrt(ckpt_mb * 1e6 / (12 * depth)) / 64) * 64)
    batch = min(1024, max(8, round(32 * (2048 / width) ** 2)))
    return width, depth, batch


def train(
    way: str, args: argparse.Namespace, layout: Layout, ckpt_dir: Path | None, store: Any = None
) -> Run:
    import torch

    from orchestrator.storage.checkpoints import UploadSettings

    torch.manual_seed(0)
    width, depth, batch = model_shape(args.ckpt_mb)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.Generator().manual_seed(1)
    settings = UploadSettings(concurrency=args.concurrency)
    run = Run(way)

    def step() -> None:
        x = torch.randn(batch, width, generator=data)
        y = torch.randn(batch, width, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    layout.training()
    for _ in range(WARMUP_STEPS):
        step()
    loop_start, cpu_start = time.perf_counter(), time.process_time()
    faults_start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(1, args.steps + 1):
        start, cpu = time.perf_counter(), time.thread_time()
        step()
        ckpt = ckpt_dir is not None and i % args.every == 0
        if ckpt:
            assert ckpt_dir is not None
            write_start = time.perf_counter()
            name = f"checkpoint-{i}"
            tmp = ckpt_dir / f".{name}.tmp"  # hidden: the uploader skips it until the rename
            tmp.mkdir()
            torch.save(model.state_dict(), tmp / "model.pt")
            torch.save(opt.state_dict(), tmp / "optimizer.pt")
            (tmp / "trainer_state.json").write_text(json.dumps({"global_step": i}))
            os.rename(tmp, ckpt_dir / name)
            run.renamed_at[name] = time.time()
            run.write_s.append(time.perf_counter() - write_start)
            if store is not None:
                up = time.perf_counter()
                store.upload(ckpt_dir / name, PROJECT, JOB_ID, RANK, settings)
                run.upload_s.append(time.perf_counter() - up)
        run.step_s.append(time.perf_counter() - start)
        run.cpu_s.append(time.thread_time() - cpu)
        run.is_ckpt.append(ckpt)
    run.loop_s = time.perf_counter() - loop_start
    run.loop_cpu_s = time.process_time() - cpu_start
    run.loop_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_start
    layout.free()
    return run


# --- the async run and the latency probe ---------------------------------------------------


@dataclass
class AsyncResult:
    run: Run
    drain_s: float  # loop end -> every checkpoint's manifest exists
    latency_s: dict[str, float]  # rename -> manifest created_at
    took_s: dict[str, float]  # the uploader's own upload time per checkpoint
    probes: list[tuple[float, float, float]]  # (rename -> manifest seen, upload took, raw put)
    flush: dict[str, Any]


def async_run(args: argparse.Namespace, layout: Layout, ckpt_dir: Path, fs: Any) -> AsyncResult:
    from orchestrator.storage.checkpoints import CheckpointStore
    from orchestrator.storage.root import StorageRoot

    root = f"s3://{BUCKET}/run-async"
    store = CheckpointStore(StorageRoot(root))
    settings = {"settle_s": args.settle_s, "concurrency": args.concurrency}
    conn, child_conn = mp.Pipe()
    proc = mp.get_context("spawn").Process(
        target=run_uploader, args=(child_conn, root, str(ckpt_dir), settings), daemon=True
    )
    proc.start()
    assert conn.recv() == "ready"
    layout.side_pids.append(proc.pid)
    run = train("async", args, layout, ckpt_dir)

    ended = time.perf_counter()
    while len(store.list(PROJECT, JOB_ID)) < len(run.renamed_at):
        _give_up_after(ended, "the uploader to catch up")
        time.sleep(0.1)
    drain_s = time.perf_counter() - ended
    created = {m.name: m.created_at for m in store.list(PROJECT, JOB_ID)}
    latency = {n: created[n] - t for n, t in run.renamed_at.items()}

    probes = []
    last = ckpt_dir / list(run.renamed_at)[-1]
    for k in range(args.probes):
        name = f"checkpoint-probe-{k}"
        hidden = ckpt_dir / f".{name}.tmp"
        shutil.copytree(last, hidden)
        raw_first = k % 2 == 1  # alternate which goes first
        raw_s = raw_put(fs, hidden, k) if raw_first else 0.0
        renamed = time.time()
        os.rename(hidden, ckpt_dir / name)
        while store.manifest(PROJECT, JOB_ID, RANK, name) is None:
            _give_up_after(renamed, f"{name}'s manifest", clock=time.time)
            time.sleep(PROBE_POLL_S)
        seen_s = time.time() - renamed
        took = None
        while took is None:  # the manifest is written a moment before the uploader records it
            conn.send("uploaded")
            took = conn.recv().get(name)
            time.sleep(0 if took else PROBE_POLL_S)
        if not raw_first:
            raw_s = raw_put(fs, ckpt_dir / name, k)
        probes.append((seen_s, took, raw_s))

    conn.send("flush")
    flush = conn.recv()
    proc.join(timeout=10)
    layout.side_pids.remove(proc.pid)
    return AsyncResult(run, drain_s, latency, dict(flush["uploaded_s"]), probes, flush)


def _give_up_after(start: float, what: str, clock: Any = time.perf_counter) -> None:
    if clock() - start > GIVE_UP_S:
        raise TimeoutError(f"waited {GIVE_UP_S} s for {what}: is the uploader failing?")


def raw_put(fs: Any, local: Path, k: int) -> float:
    """A plain `s3fs.put` of the same files into another prefix (deleted afterwards)."""
    remote = f"{BUCKET}/raw-put/probe-{k}"
    start = time.perf_counter()
    fs.put(str(local), remote, recursive=True)
    took = time.perf_counter() - start
    fs.rm(remote, recursive=True)
    return took


# --- reporting --------------------------------------------------------------------------------


def sha256_s(path: Path) -> float:
    """One thread hashing a checkpoint (from page cache): what the uploader adds per byte."""
    import hashlib

    start = time.perf_counter()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            digest = hashlib.sha256()
            with open(p, "rb") as f:
                while chunk := f.read(8 * 2**20):
                    digest.update(chunk)
    return time.perf_counter() - start


def report(
    args: argparse.Namespace, runs: list[Run], res: AsyncResult, extra: dict[str, Any]
) -> None:
    none = [r for r in runs if r.way == "none"]
    base_median = statistics.median(s for r in none for s in r.step_s)
    base_mean = statistics.mean(s for r in none for s in r.step_s)
    width, depth, batch = model_shape(args.ckpt_mb)
    print(
        f"\nmodel: MLP {depth}x{width}, batch {batch}, torch threads 1; "
        f"checkpoint {extra['ckpt_mb']:.0f} MB in {extra['ckpt_files']} files; "
        f"{args.steps} steps, checkpoint every {args.every}"
    )
    print(f"CPUs: {extra['layout']}; malloc: {extra['malloc']}")
    print(f"load average: start {extra['load_start']}, end {extra['load_end']}\n")
    print(
        f"{'way':<12} {'median plain step':>18} {'/none':>7} {'(its CPU)':>10} "
        f"{'mean all steps':>15} {'/none':>7} {'loop wall':>10} {'local write/ckpt':>17} "
        f"{'upload/ckpt':>12} {'faults/step':>12}"
    )
    for r in runs:
        write = f"{statistics.mean(r.write_s):.3f} s" if r.write_s else "-"
        upload = f"{statistics.mean(r.upload_s):.2f} s" if r.upload_s else "-"
        median, mean = r.median_plain(), r.mean_all()
        print(
            f"{r.way:<12} {median * 1e3:>15.1f} ms {median / base_median:>6.3f}x"
            f" {r.median_plain(r.cpu_s) * 1e3:>7.1f} ms"
            f" {mean * 1e3:>12.1f} ms {mean / base_mean:>6.3f}x"
            f" {r.loop_s:>8.2f} s {write:>17} {upload:>12} {r.loop_faults / len(r.step_s):>12.0f}"
        )
    if len(none) > 1:
        first, again = none[0].median_plain(), none[-1].median_plain()
        print(
            f"\nnoise floor: the same 'none' loop, last vs first: {again / first:.3f}x "
            "(CPU column: the training thread's own CPU time; wall above it = descheduled)"
        )
    a = res.run
    mean_wo_write = (sum(a.step_s) - sum(a.write_s)) / len(a.step_s)
    print(
        f"async, mean step with the local writes taken out: {mean_wo_write * 1e3:.1f} ms "
        f"({mean_wo_write / base_mean:.3f}x none)"
    )
    print(
        f"async: loop end -> last manifest {res.drain_s:.2f} s; "
        f"flush afterwards {res.flush['flush_s']:.2f} s, pending {res.flush['pending']}, "
        f"failed {res.flush['failed']}"
    )
    print("async, per checkpoint during training: rename -> manifest created_at")
    print(
        f"  {'checkpoint':<16} {'local write':>12} {'latency':>8} {'of it upload':>13} "
        f"{'waiting':>8}"
    )
    for (name, lat), write in zip(res.latency_s.items(), a.write_s, strict=True):
        took = res.took_s.get(name, float("nan"))
        print(f"  {name:<16} {write:>10.3f} s {lat:>6.2f} s {took:>11.2f} s {lat - took:>6.2f} s")
    print("\nlatency probe, loop stopped, uploader idle:")
    print(
        f"{'probe':<6} {'rename -> manifest seen':>24} {'of it upload':>13} "
        f"{'scan+settle':>12} {'raw s3fs.put':>13} {'ratio':>7} {'upload/raw':>11}"
    )
    rows = [(str(k), *probe) for k, probe in enumerate(res.probes)]
    if len(rows) > 1:
        rows.append(("median", *(statistics.median(p[i] for p in res.probes) for i in range(3))))
    for label, seen, took, raw in rows:
        print(
            f"{label:<6} {seen:>22.2f} s {took:>11.2f} s {seen - took:>10.2f} s {raw:>11.2f} s"
            f" {seen / raw:>6.2f}x {took / raw:>10.2f}x"
        )
    seen_med, raw_med = rows[-1][1], rows[-1][3]
    print(
        f"\nCPU seconds: training loop (async) {a.loop_cpu_s:.1f} over {a.loop_s:.1f} s wall; "
        f"uploader process {res.flush['cpu_s']:.1f}; moto process {extra['moto_cpu']:.1f}; "
        f"sha256 of one checkpoint, one thread {extra['sha_s']:.2f} s; "
        f"moto peak RSS {extra['moto_rss']:.0f} MB"
    )
    print(
        "\ntargets: async median plain step within 1.05x none: "
        f"{'met' if a.median_plain() / base_median <= 1.05 else 'MISSED'}; "
        f"rename -> manifest within 1.25x raw put: "
        f"{'met' if seen_med / raw_med <= 1.25 else 'MISSED'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ckpt-mb", type=float, default=200)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--settle-s", type=float, default=0.5)
    parser.add_argument("--concurrency", type=int, default=8, help="UploadSettings.concurrency")
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="during the loops, training on one core, uploader and moto on the others",
    )
    parser.add_argument(
        "--keep-freed-memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="glibc malloc keeps freed memory (no page faults per step; see keep_freed_memory)",
    )
    parser.add_argument(
        "--warmup-s", type=float, default=3, help="unmeasured training loops first, seconds"
    )
    parser.add_argument("--probes", type=int, default=1, help="latency probes (rename vs put)")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    malloc = "keeps freed memory" if args.keep_freed_memory and keep_freed_memory() else "default"
    load_start = _load()
    moto_conn, moto_child = mp.Pipe()
    moto = mp.get_context("spawn").Process(target=serve_moto, args=(moto_child,), daemon=True)
    moto.start()
    port = moto_conn.recv()
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin and len(cpus) >= 2:
        layout = Layout({cpus[0]}, set(cpus[1:]), set(cpus), [moto.pid])
    else:
        layout = Layout(None, None, set(cpus), [moto.pid])
    os.environ.update(
        {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
        }
    )
    import s3fs

    from orchestrator.storage.checkpoints import CheckpointStore
    from orchestrator.storage.root import StorageRoot

    fs = s3fs.S3FileSystem(use_listings_cache=False)
    fs.mkdir(BUCKET)
    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    try:
        runs: list[Run] = []

        def fresh(way: str) -> Path:
            path = work / way
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            return path

        print(f"warm-up ({args.warmup_s:g} s) ...", flush=True)
        warm_until = time.perf_counter() + args.warmup_s
        # Once with checkpoints, deleted after: on this VM, page cache that was never touched
        # (or was handed back to the host) writes up to 6x slower than recycled page cache,
        # which would charge the first way to write (async) for it.
        train("warm-up", args, layout, fresh("warm-up"))
        shutil.rmtree(work / "warm-up")
        while time.perf_counter() < warm_until:
            train("warm-up", args, layout, None)
        print("none ...", flush=True)
        runs.append(train("none", args, layout, None))
        print("async ...", flush=True)
        ckpt_async = fresh("async")
        res = async_run(args, layout, ckpt_async, fs)
        runs.append(res.run)
        last = ckpt_async / list(res.run.renamed_at)[-1]
        files = [p for p in last.rglob("*") if p.is_file()]
        ckpt_mb = sum(p.stat().st_size for p in files) / 1e6
        sha = sha256_s(last)
        shutil.rmtree(ckpt_async)
        fs.rm(f"{BUCKET}/run-async", recursive=True)  # moto holds objects in memory
        print("sync ...", flush=True)
        sync_store = CheckpointStore(StorageRoot(f"s3://{BUCKET}/run-sync"))
        runs.append(train("sync", args, layout, fresh("sync"), sync_store))
        fs.rm(f"{BUCKET}/run-sync", recursive=True)
        print("none again ...", flush=True)
        runs.append(train("none", args, layout, None))
        moto_conn.send("cpu")
        moto_cpu = moto_conn.recv()
        moto_conn.send("peak_rss")
        moto_rss = moto_conn.recv()
        extra = {
            "ckpt_mb": ckpt_mb,
            "ckpt_files": len(files),
            "sha_s": sha,
            "moto_cpu": moto_cpu,
            "moto_rss": moto_rss,
            "load_start": load_start,
            "load_end": _load(),
            "malloc": malloc,
            "layout": (
                f"training on {sorted(layout.train)}, uploader and moto on {sorted(layout.side)}"
                if layout.train
                else f"not pinned, all processes on {sorted(layout.every)}"
            ),
        }
        report(args, runs, res, extra)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        moto_conn.send("stop")
        moto_conn.recv()
        moto.join(timeout=10)


if __name__ == "__main__":
    main()

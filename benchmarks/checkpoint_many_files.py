"""Many small files: a checkpoint of thousands of files uploaded by `CheckpointStore.upload`.

    .venv/bin/python benchmarks/checkpoint_many_files.py [--files 2000] [--kib 4] [--rounds 3]

A checkpoint of N small files in nested directories (the shape of a sharded optimizer state or
a tokenizer-heavy model) goes to S3 (moto on loopback, in a process of its own) three ways, in
alternating rounds: the store's upload with one file at a time (`concurrency=1`), with its
default 8 at a time, and a raw `s3fs.put(recursive=True)` of the same tree (s3fs batches its
requests concurrently) as the baseline. Prints the median of each and its ratio to raw.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

from common import code_state, serve_moto

BUCKET = "many-files"


def make_checkpoint(root: Path, files: int, kib: int) -> Path:
    ckpt = root / "checkpoint-many"
    for i in range(files):
        path = ckpt / f"shard-{i // 100:03d}" / f"part-{i % 7}" / f"f{i}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(kib * 1024))
    return ckpt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--kib", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    conn, child = mp.Pipe()
    moto = mp.get_context("spawn").Process(target=serve_moto, args=(child,), daemon=True)
    moto.start()
    port = conn.recv()
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench")  # fmt: skip
    import s3fs

    from orchestrator.storage.checkpoints import CheckpointStore, UploadSettings
    from orchestrator.storage.root import StorageRoot

    fs = s3fs.S3FileSystem()
    fs.mkdir(BUCKET)
    times: dict[str, list[float]] = {"store, concurrency 1": [], "store, concurrency 8": [],
                                     "raw s3fs.put": []}  # fmt: skip
    try:
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = make_checkpoint(Path(tmp), args.files, args.kib)
            for k in range(args.rounds):
                for way in times:
                    prefix = f"{BUCKET}/{k}-{way.replace(' ', '').replace(',', '-')}"
                    start = time.perf_counter()
                    if way == "raw s3fs.put":
                        fs.put(str(ckpt), prefix, recursive=True)
                    else:
                        settings = UploadSettings(concurrency=int(way.rsplit(" ", 1)[1]))
                        store = CheckpointStore(StorageRoot(f"s3://{prefix}"))
                        store.upload(ckpt, "p", "j", 0, settings)
                    times[way].append(time.perf_counter() - start)
                    fs.rm(prefix, recursive=True)
                    print(f"round {k + 1} {way}: {times[way][-1]:.2f} s", flush=True)
    finally:
        conn.send("stop")
        conn.recv()
        moto.join(timeout=10)

    raw = statistics.median(times["raw s3fs.put"])
    print(f"\ncode {code_state()}; {args.files} files of {args.kib} KiB, "
          f"median of {args.rounds} rounds")  # fmt: skip
    for way, values in times.items():
        median = statistics.median(values)
        print(f"{way:<22} {median:>7.2f} s  {median / raw:>5.2f}x raw  "
              f"{args.files / median:>7.0f} files/s")  # fmt: skip


if __name__ == "__main__":
    main()

"""A rank's GPU in its container on a real GPU node without CDI (node/gpus.py's device path):
the container gets what `gpu_access` gives (the device nodes, the driver's libraries and
nvidia-smi bound read-only under /usr/local/nvidia) through node/podman.py's own `podman run`,
and must see the GPU and run a CUDA kernel; without the devices, or without the driver's files,
the same program must fail, which shows each part is what gives the GPU.

The image holds a static busybox, the CUDA program (benchmarks/gpu/vector_add.cu, the CUDA
runtime linked in) and the C libraries it and nvidia-smi load: no CUDA library of its own.

Usage (on the GPU node, as benchmarks/gpu_container_check.sh runs it):
    python3 benchmarks/gpu/container_devices.py PROGRAM [DEV]
DEV (default /dev): where the device nodes are; another folder only to try the script out on a
machine without a GPU (nodes made with mknod), where the GPU run fails.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from orchestrator.node import gpus, podman
from tests import images

IMAGE = "localhost/orchestrator-gpu-check/cuda-program:1"
PROBE = (
    "nvidia-smi -L; echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES; "
    "echo LD_LIBRARY_PATH=$LD_LIBRARY_PATH; ls /dev | grep nvidia | tr '\\n' ' '; echo; "
    "/vector_add"
)


def build_image(program: Path, directory: Path) -> str:
    rootfs = directory / "rootfs"
    images._busybox_into(rootfs)
    shutil.copy(program, rootfs / "vector_add")
    for link, real in (("lib", "usr/lib"), ("lib64", "usr/lib64")):
        (rootfs / link).symlink_to(real)
    smi = shutil.which("nvidia-smi")
    for library in images._host_libraries([program, *([Path(smi)] if smi else [])], rootfs):
        folder = Path(os.path.realpath(library.parent)).relative_to("/")
        images._link(library, rootfs / folder / library.name)
    (rootfs / "etc" / "ld.so.conf").write_text("/usr/lib/x86_64-linux-gnu\n")
    subprocess.run(["ldconfig", "-r", str(rootfs)], check=True)
    images._import(rootfs, IMAGE)
    return IMAGE


def run(name: str, access: gpus.GpuAccess, workdir: Path) -> tuple[int, str]:
    container = podman.Container(
        name=f"orchestrator-gpu-check-{name}", image=IMAGE,
        status_file=str(workdir / "failed"), binds=((str(workdir), str(workdir)), *access.binds),
        read_only=tuple(inside for _, inside in access.binds), devices=access.devices,
    )  # fmt: skip
    started = time.monotonic()
    ran = subprocess.run(
        podman.run_argv(container, str(workdir), (PROBE,)),
        input=podman.environment_script(access.env), capture_output=True, timeout=180,
    )  # fmt: skip
    out = (ran.stdout + ran.stderr).decode(errors="replace").strip()
    print(f"--- {name}: exit {ran.returncode} in {time.monotonic() - started:.1f} s\n{out}")
    return ran.returncode, out


def main() -> int:
    program = Path(sys.argv[1]).resolve()
    dev = sys.argv[2] if len(sys.argv) > 2 else "/dev"
    access = gpus.gpu_access(["0"], dev=dev)  # the GPU Ray gives a rank asking for one
    print("devices:", " ".join(access.devices))
    print("driver files:", len(access.binds), " ".join(inside for _, inside in access.binds))
    print("env:", access.env)
    with tempfile.TemporaryDirectory(dir="/var/tmp") as directory:
        started = time.monotonic()
        build_image(program, Path(directory))
        print(f"image {IMAGE} built in {time.monotonic() - started:.1f} s")
        workdir = Path(directory) / "rank"
        workdir.mkdir()
        code, out = run("with-gpu", access, workdir)
        no_devices = run("no-devices", dataclasses.replace(access, devices=()), workdir)
        no_files = run("no-driver-files", dataclasses.replace(access, binds=()), workdir)
    images.podman_cli("rmi", IMAGE)
    checks = {
        "the GPU, numbered 0, and a correct kernel in the container": code == 0
        and "GPU 0: " in out
        and ": correct" in out
        and "CUDA_VISIBLE_DEVICES=0" in out,
        "without the device nodes the kernel does not run": no_devices[0] != 0
        and ": correct" not in no_devices[1],
        "without the driver's files the kernel does not run": no_files[0] != 0
        and ": correct" not in no_files[1],
    }
    for what, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}: {what}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""A rank's GPUs in its container (node/gpus.py): what a node's CDI spec or its device nodes
give, and, with real podman, what the container then sees. This machine has no GPU: the device
nodes are made here with NVIDIA's major number (the container sees them; nothing can open them)
and the driver's library is a stand-in file. CDI itself is podman's; its specs live in /etc/cdi
and /var/run/cdi, which no test writes, so podman's part of it runs only on a GPU node.

The container part needs podman, runc and /bin/busybox (tests/install-system.sh);
ORCHESTRATOR_SKIP_CONTAINER_TESTS=1 skips it instead.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from pathlib import Path

import images
import pytest

from orchestrator.node import gpus, podman
from orchestrator.node.gpus import DRIVER_DIR, GpuUnavailable, gpu_access

NVIDIA_MAJOR = 195  # the driver's character devices: nvidia0.. are minors 0.., nvidiactl 255

# The shape `nvidia-ctk cdi generate` writes (trimmed): a device per index and per UUID, "all".
CDI_SPEC = """---
cdiVersion: 0.5.0
kind: nvidia.com/gpu
devices:
- name: "0"
  containerEdits:
    deviceNodes: [{path: /dev/nvidia0}]
- name: "1"
  containerEdits:
    deviceNodes: [{path: /dev/nvidia1}]
- name: GPU-6f3c1f7e-5a8e-4c1b-9d2a-0b7e1c2d3e4f
  containerEdits:
    deviceNodes: [{path: /dev/nvidia1}]
- name: all
  containerEdits:
    deviceNodes: [{path: /dev/nvidia0}, {path: /dev/nvidia1}]
containerEdits:
  deviceNodes: [{path: /dev/nvidiactl}, {path: /dev/nvidia-uvm}]
"""


def test_a_rank_without_gpus_gets_no_device_and_no_variable():
    assert gpu_access([], cdi_dirs=(), dev="/nonexistent") == gpus.GpuAccess()


def test_through_cdi_a_rank_gets_its_gpus_by_index_numbered_from_zero_inside(tmp_path):
    (tmp_path / "nvidia.yaml").write_text(CDI_SPEC)
    (tmp_path / "amd.json").write_text('{"cdiVersion": "0.5.0", "kind": "amd.com/gpu", '
                                       '"devices": [{"name": "7"}]}')  # fmt: skip
    (tmp_path / "broken.yaml").write_text("kind: [nvidia.com/gpu\n")  # podman's to report
    access = gpu_access(["1"], cdi_dirs=(str(tmp_path), str(tmp_path / "absent")))
    assert access.devices == ("nvidia.com/gpu=1",)
    assert access.env == {"CUDA_VISIBLE_DEVICES": "0"}  # the node's 1 is the container's 0
    assert access.binds == ()  # the spec brings the driver's files
    both = gpu_access(["1", "0"], cdi_dirs=(str(tmp_path),))
    assert both.devices == ("nvidia.com/gpu=1", "nvidia.com/gpu=0")
    assert both.env == {"CUDA_VISIBLE_DEVICES": "0,1"}


def test_a_cdi_spec_without_the_ranks_gpu_is_an_error_naming_it_and_what_the_spec_has(tmp_path):
    (tmp_path / "nvidia.yaml").write_text(CDI_SPEC)
    with pytest.raises(GpuUnavailable) as raised:
        gpu_access(["0", "7"], cdi_dirs=(str(tmp_path),))
    message = str(raised.value)
    assert "has no GPU 7" in message and "it names 0, 1, GPU-6f3c" in message
    assert "nvidia-ctk cdi generate" in message


def test_without_cdi_or_the_device_node_the_error_names_the_missing_device(tmp_path):
    (tmp_path / "nvidia0").touch()
    with pytest.raises(GpuUnavailable) as raised:
        gpu_access(["0", "3"], cdi_dirs=(str(tmp_path / "none"),), dev=str(tmp_path))
    assert "no CDI spec of nvidia.com/gpu" in str(raised.value)
    assert f"{tmp_path}/nvidia3" in str(raised.value)
    assert f"{tmp_path}/nvidia0" not in str(raised.value)


def _need_podman() -> None:
    if os.environ.get("ORCHESTRATOR_SKIP_CONTAINER_TESTS") == "1":
        pytest.skip("ORCHESTRATOR_SKIP_CONTAINER_TESTS=1: jobs in containers are not tested")
    if shutil.which("podman") is None or not Path("/bin/busybox").exists():
        pytest.fail("podman or /bin/busybox missing: run tests/install-system.sh")


def test_without_cdi_the_container_sees_its_gpus_devices_only_and_the_drivers_files(tmp_path):
    """A rank given the node's GPU 1 of two: /dev/nvidia1 and the control device are in its
    container, /dev/nvidia0 is not; the driver's library is read-only under /usr/local/nvidia,
    on LD_LIBRARY_PATH; CUDA numbers the GPU 0."""
    _need_podman()
    dev = tmp_path / "dev"
    dev.mkdir()
    for name, minor in (("nvidia0", 0), ("nvidia1", 1), ("nvidiactl", 255)):
        os.mknod(dev / name, 0o666 | 0o020000, os.makedev(NVIDIA_MAJOR, minor))  # S_IFCHR
    library = tmp_path / "libcuda.so.550.54.15"
    library.write_text("not a real driver\n")
    access = gpu_access(["1"], cdi_dirs=(str(tmp_path / "none"),), dev=str(dev))
    assert access.devices == (f"{dev}/nvidia1:/dev/nvidia1", f"{dev}/nvidiactl:/dev/nvidiactl")
    inside = f"{DRIVER_DIR}/lib64/libcuda.so.1"
    access = dataclasses.replace(access, binds=((str(library), inside),))
    container = podman.Container(
        name=f"orchestrator-test-gpus-{os.getpid()}", image=images.busybox_image(tmp_path),
        status_file=str(tmp_path / "failed"), binds=((str(tmp_path), str(tmp_path)),
                                                     *access.binds),
        read_only=(inside,), devices=access.devices,
    )  # fmt: skip
    probe = (
        'for d in /dev/nvidia*; do [ -c "$d" ] && echo "device $d"; done; '
        f'cat {inside}; echo "cuda $CUDA_VISIBLE_DEVICES"; echo "libs $LD_LIBRARY_PATH"; '
        f'echo "path $PATH"; echo x > {inside} || echo read-only'
    )
    ran = subprocess.run(
        podman.run_argv(container, str(tmp_path), (probe,)),
        input=podman.environment_script(access.env), capture_output=True, timeout=120,
    )  # fmt: skip
    out = ran.stdout.decode()
    assert ran.returncode == 0, ran.stderr.decode()
    assert "device /dev/nvidia1" in out and "device /dev/nvidiactl" in out
    assert "/dev/nvidia0" not in out
    assert "not a real driver" in out and "read-only" in out
    assert "cuda 0\n" in out
    assert f"libs {DRIVER_DIR}/lib64\n" in out
    assert f":{DRIVER_DIR}/bin\n" in out


def test_the_drivers_files_are_what_ldconfig_knows_resolved_with_every_name(tmp_path, monkeypatch):
    """`ldconfig -p` and nvidia-smi as a node with the driver has them (stand-ins on PATH): each
    name a library goes by is bound to the file it resolves to; other architectures' copies and
    other libraries are not."""
    if gpus._LDCONFIG_ARCH.get(os.uname().machine) is None:
        pytest.skip(f"ldconfig's name for {os.uname().machine} is not known here")
    arch = gpus._LDCONFIG_ARCH[os.uname().machine]
    real = tmp_path / "libcuda.so.550.54.15"
    real.write_text("")
    (tmp_path / "libcuda.so.1").symlink_to(real.name)
    (tmp_path / "libcuda.so").symlink_to("libcuda.so.1")
    ml = tmp_path / "libnvidia-ml.so.550.54.15"
    ml.write_text("")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ldconfig").write_text(
        "#!/bin/sh\n"
        "echo '4 libs found in cache /etc/ld.so.cache'\n"
        f"echo '\tlibcuda.so.1 (libc6,{arch}) => {tmp_path}/libcuda.so.1'\n"
        "echo '\tlibcuda.so.1 (libc6) => /usr/lib/i386-linux-gnu/libcuda.so.1'\n"
        f"echo '\tlibcuda.so (libc6,{arch}) => {tmp_path}/libcuda.so'\n"
        f"echo '\tlibnvidia-ml.so.1 (libc6,{arch}) => {ml}'\n"
        f"echo '\tlibz.so.1 (libc6,{arch}) => /lib/libz.so.1'\n"
    )  # fmt: skip
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    assert gpus.driver_files() == [
        (str(real), f"{DRIVER_DIR}/lib64/libcuda.so"),
        (str(real), f"{DRIVER_DIR}/lib64/libcuda.so.1"),
        (str(ml), f"{DRIVER_DIR}/lib64/libnvidia-ml.so.1"),
        (str(bin_dir / "nvidia-smi"), f"{DRIVER_DIR}/bin/nvidia-smi"),
    ]


def test_a_driver_on_ld_library_path_outside_the_loaders_cache_is_found_first(
    tmp_path, monkeypatch
):
    """NVIDIA's images and some GPU hosts keep the driver in /usr/local/nvidia/lib64 on
    LD_LIBRARY_PATH, which `ldconfig -p` does not list: the container gets those files, and where
    both have a name, the one the host's own processes load (LD_LIBRARY_PATH comes first)."""
    driver = tmp_path / "nvidia" / "lib64"
    driver.mkdir(parents=True)
    real = driver / "libcuda.so.580.159.04"
    real.write_text("")
    (driver / "libcuda.so.1").symlink_to(real.name)
    (driver / "libnvidia-ml.so.1").write_text("")
    (driver / "libz.so.1").write_text("")  # not the driver's
    (driver / "libnvidia-gpucomp.so.1").symlink_to("missing")  # a dangling link: nothing to bind
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "libcuda.so.1").write_text("")
    (bin_dir / "ldconfig").write_text(
        "#!/bin/sh\necho '1 libs found in cache /etc/ld.so.cache'\n"
        f"echo '\tlibcuda.so.1 (libc6,x86-64) => {cache}/libcuda.so.1'\n"
    )  # fmt: skip
    (bin_dir / "ldconfig").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setattr(gpus.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv("LD_LIBRARY_PATH", f"{tmp_path / 'absent'}::{driver}")
    assert gpus.driver_files() == [
        (str(real), f"{DRIVER_DIR}/lib64/libcuda.so.1"),
        (str(real), f"{DRIVER_DIR}/lib64/{real.name}"),  # by its own name too, as the link's
        (str(driver / "libnvidia-ml.so.1"), f"{DRIVER_DIR}/lib64/libnvidia-ml.so.1"),
    ]

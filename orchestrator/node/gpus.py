"""A rank's GPUs in its container: what podman is given so the job's image sees the GPUs Ray
gave the rank, and only those.

Through CDI where the node has a spec of NVIDIA's GPUs (`nvidia-ctk cdi generate`, which
cluster.yaml runs): `--device nvidia.com/gpu=<index>`, the spec bringing the device nodes, the
driver's libraries and its hooks. Else the device nodes themselves, and the driver's user-space
libraries and tools (as LD_LIBRARY_PATH, `ldconfig -p` and PATH find them on the node) bound
read-only under /usr/local/nvidia, where NVIDIA's CUDA images look (the container's shells add it to
LD_LIBRARY_PATH and PATH when it is there, node/podman.py).

Inside, the rank's GPUs are the only ones CUDA can open, so they are numbered from 0, as a Slurm
job confined to its GPUs has them: CUDA_VISIBLE_DEVICES says `0,1`, not the node's `4,5`.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

CDI_DIRS = ("/etc/cdi", "/var/run/cdi")  # where podman reads CDI specs
CDI_KIND = "nvidia.com/gpu"
DRIVER_DIR = "/usr/local/nvidia"  # lib64/ and bin/ inside, as NVIDIA's images expect
# The driver's user-space parts CUDA, NVML and PTX compilation need (libnvidia-container's list).
_LIBRARIES = (
    "libcuda.so", "libcudadebugger.so", "libnvidia-ml.so", "libnvidia-ptxjitcompiler.so",
    "libnvidia-nvvm.so", "libnvidia-gpucomp.so", "libnvidia-allocator.so", "libnvidia-cfg.so",
    "libnvidia-opencl.so",
)  # fmt: skip
_TOOLS = ("nvidia-smi", "nvidia-debugdump")
_CONTROL_DEVICES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
_LDCONFIG_ARCH = {"x86_64": "x86-64", "aarch64": "AArch64"}


class GpuUnavailable(RuntimeError):
    """The node cannot give the rank's GPUs to a container; the message says what it lacks."""


@dataclass(frozen=True)
class GpuAccess:
    """What `podman run` adds for the rank's GPUs, and the container's own CUDA_VISIBLE_DEVICES."""

    devices: tuple[str, ...] = ()  # --device values: CDI names, or node:container paths
    binds: tuple[tuple[str, str], ...] = ()  # the driver's files (host, inside), read-only
    env: dict[str, str] = field(default_factory=dict)


def gpu_access(
    gpu_ids: list[str], cdi_dirs: tuple[str, ...] = CDI_DIRS, dev: str = "/dev"
) -> GpuAccess:
    """The container options for the node's GPUs `gpu_ids` (Ray's, the node's indices); none
    without GPUs. Raises GpuUnavailable naming what is missing when a GPU cannot be given."""
    if not gpu_ids:
        return GpuAccess()
    env = {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(len(gpu_ids)))}
    names = cdi_devices(cdi_dirs)
    if names:
        missing = [i for i in gpu_ids if i not in names]
        if missing:
            raise GpuUnavailable(
                f"the node's CDI spec of {CDI_KIND} (in {' or '.join(cdi_dirs)}) has no GPU "
                f"{', '.join(missing)}; it names {', '.join(sorted(names))} (run `nvidia-ctk cdi "
                "generate` again after a driver or GPU change)"
            )
        return GpuAccess(devices=tuple(f"{CDI_KIND}={i}" for i in gpu_ids), env=env)
    nodes = [Path(dev) / f"nvidia{i}" for i in gpu_ids]
    if missing_nodes := [str(p) for p in nodes if not p.exists()]:
        raise GpuUnavailable(
            f"GPU(s) {', '.join(gpu_ids)} of this node cannot be given to the container: no CDI "
            f"spec of {CDI_KIND} (nvidia-ctk cdi generate) and no {', '.join(missing_nodes)}"
        )
    control = [Path(dev) / name for name in _CONTROL_DEVICES]
    devices = [f"{p}:/dev/{p.name}" for p in [*nodes, *control] if p.exists()]
    return GpuAccess(devices=tuple(devices), binds=tuple(driver_files()), env=env)


def cdi_devices(cdi_dirs: tuple[str, ...] = CDI_DIRS) -> set[str]:
    """The device names the node's CDI specs give for NVIDIA GPUs (`0`, `GPU-<uuid>`, `all`)."""
    import yaml  # Ray's own dependency; a JSON spec is YAML too

    names: set[str] = set()
    for directory in cdi_dirs:
        for spec_file in sorted(Path(directory).glob("*")):
            if spec_file.suffix not in (".yaml", ".yml", ".json"):
                continue
            try:
                spec = yaml.safe_load(spec_file.read_text())
            except (OSError, yaml.YAMLError):
                continue  # podman says what is wrong with it, if it is used
            if isinstance(spec, dict) and spec.get("kind") == CDI_KIND:
                names |= {str(d.get("name")) for d in spec.get("devices") or [] if "name" in d}
    return names


def driver_files() -> list[tuple[str, str]]:
    """The driver's libraries and tools on this node, each (its file, its path inside the
    container under DRIVER_DIR): every name a library goes by in LD_LIBRARY_PATH's folders
    (where a node's driver lives outside the loader's cache, as in NVIDIA's own images), then
    in `ldconfig -p`, the loader's order, so `libcuda.so.1` and `libcuda.so` both resolve."""
    files: dict[str, str] = {}
    for folder in filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(":")):
        for library in sorted(Path(folder).glob("lib*.so*")):
            if library.name.startswith(_LIBRARIES) and library.exists():
                files.setdefault(library.name, str(library.resolve()))
    listed = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    arch = _LDCONFIG_ARCH.get(platform.machine(), platform.machine())
    for line in listed.splitlines()[1:]:
        name, _, rest = line.strip().partition(" ")
        flags, _, path = rest.partition(" => ")
        if arch in flags and name.startswith(_LIBRARIES) and name not in files:
            files[name] = str(Path(path).resolve())
    binds = [(real, f"{DRIVER_DIR}/lib64/{name}") for name, real in sorted(files.items())]
    for tool in _TOOLS:
        if found := shutil.which(tool):
            binds.append((str(Path(found).resolve()), f"{DRIVER_DIR}/bin/{tool}"))
    return binds

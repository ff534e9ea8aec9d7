"""Job images built here, offline, from what this machine already has: no registry on the internet
is reached. A job's image needs no Ray (our agents stay on the host); the Python one has it all
the same, for a job that tries to reach the cluster with its own client (test_containers.py's
attack).

- `busybox_image`: Debian's static busybox and its applets: a shell and nothing else.
- `python_image`: this interpreter (its standard library), bash, and the packages a recipe needs
  with their dependencies (torch from its CPU wheel, scikit-learn, pip; Ray and grpcio), copied
  from this environment, with the system libraries their binaries link against. What the mnist
  recipe needs, and about 1.4 GB: built once per machine (30 s), reused while what went into it
  is unchanged (its tag is a digest of that).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

from packaging.requirements import Requirement

from orchestrator.node import podman

BUSYBOX = "localhost/orchestrator-tests/busybox:1"
PYTHON = "localhost/orchestrator-tests/python-torch"
PACKAGES = ("torch", "scikit-learn", "pip", "ray", "grpcio")
# Parts of the standard library no job needs, and the bulk of it.
_STDLIB_LEFT_OUT = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "site-packages"}


def podman_cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *podman.global_args(), *args], capture_output=True,
                          text=True, **kwargs)  # fmt: skip


def busybox_image(directory: Path) -> str:
    """The image's name; built unless this machine already has it (a rebuild would leave the
    last one behind, unnamed)."""
    with _building():
        if podman.exists(BUSYBOX):
            return BUSYBOX
        rootfs = directory / "rootfs"
        _busybox_into(rootfs)
        _import(rootfs, BUSYBOX)
    return BUSYBOX


def python_image() -> str:
    """The image's name; built unless this machine already has it."""
    name = f"{PYTHON}:{_python_digest()}"
    with _building():
        if podman.exists(name):
            return name
        with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="python-image-") as directory:
            rootfs = Path(directory) / "rootfs"
            _busybox_into(rootfs)
            _python_into(rootfs)
            _import(rootfs, name)
    return name


@contextlib.contextmanager
def _building() -> Iterator[None]:
    """One build at a time on this machine: test processes running side by side (pytest -n)
    would otherwise both find an image missing and both build it."""
    with open("/var/tmp/orchestrator-test-images.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _distributions() -> list[importlib.metadata.Distribution]:
    """PACKAGES and what they require on this platform, with the extras a requirement names,
    as installed here."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo: list[tuple[str, frozenset[str]]] = [(name, frozenset()) for name in PACKAGES]
    done: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, extras = todo.pop()
        dist = importlib.metadata.distribution(name)
        key = dist.metadata["Name"].lower().replace("_", "-")
        if (key, extras) in done:
            continue
        done.add((key, extras))
        found[key] = dist
        for line in dist.requires or []:
            # Its needs here: other platforms' left out, an extra's only where it was asked for
            # (torch's CUDA build asks for cuda-toolkit[cudart,cublas,...]).
            requirement = Requirement(line)
            marker = requirement.marker
            if marker is None or any(marker.evaluate({"extra": e}) for e in {"", *extras}):
                todo.append((requirement.name, frozenset(requirement.extras)))
    return [found[key] for key in sorted(found)]


def _python_digest() -> str:
    parts = [sys.version, *(f"{d.metadata['Name']}=={d.version}" for d in _distributions())]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def _busybox_into(rootfs: Path) -> None:
    (rootfs / "bin").mkdir(parents=True)
    for folder in ("etc", "tmp", "mnt", "root"):
        (rootfs / folder).mkdir()
    (rootfs / "tmp").chmod(0o1777)
    shutil.copy("/bin/busybox", rootfs / "bin" / "busybox")
    applets = subprocess.run(["/bin/busybox", "--list"], capture_output=True, text=True).stdout
    for applet in applets.split():
        if applet != "busybox":
            (rootfs / "bin" / applet).symlink_to("busybox")
    (rootfs / "usr" / "bin").mkdir(parents=True)
    (rootfs / "usr" / "bin" / "env").symlink_to("/bin/busybox")  # scripts' `#!/usr/bin/env`


def _python_into(rootfs: Path) -> None:
    """This interpreter as /usr/local/bin/python3 with its standard library, bash, PACKAGES in
    /usr/local's site-packages, and the host libraries all of their binaries need."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    local = rootfs / "usr" / "local"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    target_lib = local / "lib" / version
    shutil.copytree(stdlib, target_lib, copy_function=_link,
                    ignore=lambda d, names: _STDLIB_LEFT_OUT & set(names) if d == str(stdlib)
                    else [n for n in names if n.startswith("config-")])  # fmt: skip
    libdir = Path(sysconfig.get_config_var("LIBDIR") or "/nonexistent")
    for library in libdir.glob("libpython3*.so*"):
        _link(library, local / "lib" / library.name)
    (local / "bin").mkdir(parents=True)
    _link(Path(os.path.realpath(sys._base_executable)), local / "bin" / version)
    for alias in ("python3", "python"):
        (local / "bin" / alias).symlink_to(version)
    site = target_lib / "site-packages"
    # Debian's and Ubuntu's own Python looks in dist-packages outside a virtual environment.
    (target_lib / "dist-packages").symlink_to("site-packages")
    for dist in _distributions():
        for file in dist.files or []:
            if file.parts[0] == ".." or "__pycache__" in file.parts:
                continue  # scripts in the venv's bin/, bytecode made anew in the image
            _link(Path(dist.locate_file(file)), site / file)
    _link(Path("/bin/bash"), rootfs / "bin" / "bash")
    binaries = [local / "bin" / version, rootfs / "bin" / "bash", *local.rglob("*.so*")]
    for link, real in (("lib", "usr/lib"), ("lib64", "usr/lib64")):  # merged /usr, as Debian
        (rootfs / link).symlink_to(real)
    for library in _host_libraries(binaries, rootfs):
        # The name it is linked by, in the directory it really is in (/lib is /usr/lib).
        directory = Path(os.path.realpath(library.parent)).relative_to("/")
        _link(library, rootfs / directory / library.name)
    # The loader's cache, so that /usr/local/lib (libpython) is searched, as in python's images.
    (rootfs / "etc" / "ld.so.conf").write_text("/usr/local/lib\n/usr/lib/x86_64-linux-gnu\n")
    subprocess.run(["ldconfig", "-r", str(rootfs)], check=True)


def _host_libraries(binaries: list[Path], rootfs: Path) -> set[Path]:
    """The system's shared libraries `binaries` load (as ldd resolves them), outside rootfs's
    copies (those a package ships beside its binaries resolve to this environment: in the copy)."""
    ours = (sys.prefix, sys.base_prefix)
    needed: set[Path] = {Path("/lib64/ld-linux-x86-64.so.2")}
    for start in range(0, len(binaries), 200):
        listed = subprocess.run(["ldd", *map(str, binaries[start : start + 200])],
                                capture_output=True, text=True).stdout  # fmt: skip
        for path in re.findall(r"=> (/\S+)", listed):
            if not path.startswith(ours) and not path.startswith(str(rootfs)):
                needed.add(Path(path))
    # Each library with the names it is known by (libc.so.6 is a link to libc-2.36.so on some).
    return needed | {Path(os.path.realpath(p)) for p in needed}


def _link(source: Path, target: Path) -> None:
    """A hard link where the file system allows (1 GB copied in no time), else a copy."""
    target = Path(target)
    if target.exists() or target.is_symlink():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    if Path(source).is_symlink():
        target.symlink_to(os.readlink(source))
        return
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _import(rootfs: Path, name: str) -> None:
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    imported = subprocess.run(
        ["podman", *podman.global_args(), "import", "-", name], stdin=tar.stdout,
        capture_output=True, text=True,
    )  # fmt: skip
    tar.stdout.close()
    assert tar.wait() == 0 and imported.returncode == 0, imported.stderr

"""Debian's docker-registry on 127.0.0.1 with a password: where tests and benchmarks pull job
images from, offline."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

from orchestrator.node import podman

REGISTRY_USER, REGISTRY_PASSWORD = "alice", "reg-pw-3c9e"


class Registry:
    """Debian's docker-registry on 127.0.0.1 with a password (htpasswd), holding the image."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.address = f"127.0.0.1:{s.getsockname()[1]}"
        users = subprocess.run(["htpasswd", "-Bbn", REGISTRY_USER, REGISTRY_PASSWORD],
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
        (directory / "htpasswd").write_text(users)
        (directory / "config.yml").write_text(
            f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {directory / 'data'}\n"
            f"http:\n  addr: {self.address}\nauth:\n  htpasswd:\n    realm: tests\n"
            f"    path: {directory / 'htpasswd'}\n"
        )
        # podman speaks plain HTTP to it: a registries.conf of the tests' own, for every node.
        self.registries_conf = directory / "registries.conf"
        self.registries_conf.write_text(
            f'[[registry]]\nlocation = "{self.address}"\ninsecure = true\n'
        )
        self.log = open(directory / "registry.log", "wb")  # noqa: SIM115
        self.process = subprocess.Popen(
            ["docker-registry", "serve", str(directory / "config.yml")],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while not self._answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the registry did not answer: see {directory / 'registry.log'}")
            time.sleep(0.05)

    def _answers(self) -> bool:
        host, port = self.address.split(":")
        with socket.socket() as s:
            return s.connect_ex((host, int(port))) == 0

    def push(self, image: str, name: str) -> str:
        """`image` pushed as `name` here, and its local copy under that name removed: a node
        pulls it."""
        target = f"{self.address}/{name}"
        podman_cli = ["podman", *podman.global_args()]
        subprocess.run([*podman_cli, "tag", image, target], check=True)
        pushed = subprocess.run(
            [*podman_cli, "push", "--tls-verify=false", "--creds",
             f"{REGISTRY_USER}:{REGISTRY_PASSWORD}", target],
            capture_output=True, text=True,
        )  # fmt: skip
        assert pushed.returncode == 0, pushed.stderr
        subprocess.run([*podman_cli, "rmi", target], check=True, capture_output=True)
        return target

    def log_text(self) -> str:
        self.log.flush()
        return (self.directory / "registry.log").read_text()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)
        self.log.close()

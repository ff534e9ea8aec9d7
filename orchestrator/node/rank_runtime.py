"""Where one rank's processes run on its node (`RankRuntime`): in the node's own environment
(`OnHost`), or in a podman container of the job's image (`InContainer`, node/podman.py).

The node agent gets the rank's runtime from the job's (agents/runtimes.py `JobRuntime.on_node`)
once the node is prepared, and whatever starts or ends the rank's processes asks it: the
environment they see, the processes that run the commands and which command a failure was, a
shell command or a terminal beside them, the stop, and the process the metrics count from.
Before that, the rank's prepare asks an `ImagePull` (nothing, or `PodmanPull`) to get the job's
image onto the node. No other module on the node asks whether there is a container.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from orchestrator.node import podman
from orchestrator.node.gpus import GpuAccess, gpu_access
from orchestrator.node.image_cache import ImageCache
from orchestrator.node.podman import Container
from orchestrator.node.secrets import SECRET_ENV_PREFIX, resolve_secret
from orchestrator.node.terminal import ContainerShell, HostShell, TerminalShell
from orchestrator.sizes import human_bytes

T = TypeVar("T")
SHELL_TIMEOUT_EXIT = 124  # as timeout(1)


@dataclass(frozen=True)
class RankPlace:
    """What the node prepared for one rank, which a container of the job's image is made to
    see (agents/node_preparer.py)."""

    name: str  # the rank's agent's: its container's name
    status_file: str  # in the rank's directory: which command failed, and memory kills
    binds: tuple[tuple[str, str], ...] = ()  # (host path, path inside)
    read_only: tuple[str, ...] = ()  # paths inside mounted read-only (weights)
    gpus: GpuAccess = field(default_factory=GpuAccess)
    digest: str | None = None  # the image's, as the node had it when prepared


class RankRuntime:
    """Where a rank's processes run. Each kind (`OnHost`, `InContainer`) says what they see,
    how they start, what a failure was and how a shell beside them starts; the stop and a
    shell command's time limit are the same for all, with hooks."""

    def environment(self, job_env: dict[str, str]) -> dict[str, str]:
        """Everything the rank's processes see, given the job's variables."""
        raise NotImplementedError

    def batches(self, commands: tuple[str, ...]) -> list[tuple[str, ...]]:
        """The commands grouped by the process that runs them, in order (`start` each)."""
        raise NotImplementedError

    def opening(self) -> list[str]:
        """What the job's log is told before each process starts."""
        return []

    def start(
        self, batch: tuple[str, ...], env: dict[str, str], cwd: str, guard: list[str]
    ) -> subprocess.Popen[bytes]:
        """The process that runs one batch under the agent's `guard` (its argv, which the
        command follows), leading its own process group, its output merged on stdout."""
        raise NotImplementedError

    def failure(self, batch: tuple[str, ...], code: int) -> tuple[str, str | None]:
        """Which command of the batch failed with `code`, and why where that is known."""
        raise NotImplementedError

    def pid(self, process: subprocess.Popen[bytes]) -> int:
        """The process whose descendants are the running commands (what the metrics count)."""
        return process.pid

    def stop(self, process: subprocess.Popen[bytes], grace_s: float) -> None:
        """SIGTERM every process of the rank's, SIGKILL what is left after `grace_s`.

        The whole group gets the grace, not only the shell: a trainer that saves a checkpoint
        on SIGTERM outlives the `sh -c` that started it, which SIGTERM ends at once.
        """
        self._terminate(process)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (process.poll() is None or _alive(process.pid)):
            time.sleep(0.05)
        _signal_group(process.pid, signal.SIGKILL)
        self._remove()
        process.wait()

    def _terminate(self, process: subprocess.Popen[bytes]) -> None:
        _signal_group(process.pid, signal.SIGTERM)

    def _remove(self) -> None:
        """What is left to remove once the processes are killed."""

    def exec(
        self, command: str, env: dict[str, str], cwd: str, timeout_s: float
    ) -> tuple[int, bytes]:
        """One shell command as the rank's commands run (`orchestrator shell -- CMD`): its exit
        code (SHELL_TIMEOUT_EXIT when it ran past `timeout_s`, all it started killed) and its
        output, stderr merged."""
        shell = self._shell(command, env, cwd)
        process = shell.process
        try:
            out, _ = process.communicate(input=shell.stdin, timeout=timeout_s)
            code = shell.exit_code()
        except subprocess.TimeoutExpired:
            shell.end()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            out, _ = process.communicate()
            code = SHELL_TIMEOUT_EXIT
        finally:
            shell.forget()
        return code, out

    def _shell(self, command: str, env: dict[str, str], cwd: str) -> _Shell:
        raise NotImplementedError

    def terminal(self, env: dict[str, str], cwd: str, term: str) -> TerminalShell:
        """A terminal's shell as the rank's commands run (node/terminal.py)."""
        raise NotImplementedError


class OnHost(RankRuntime):
    """The rank's processes in the node's own environment: the host runtime's, and Ray's
    image_uri one's, whose agent Ray started in the image. Each command is a process."""

    def environment(self, job_env: dict[str, str]) -> dict[str, str]:
        """The node's environment, then the job's. The node's secret store
        (ORCHESTRATOR_SECRET_*) is not the job's to read, and the Python Ray runs with comes
        first on PATH (`python`, `pip`, `torchrun` are the node's)."""
        node_env = {k: v for k, v in os.environ.items() if not k.startswith(SECRET_ENV_PREFIX)}
        env = {**node_env, **job_env}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        return env

    def batches(self, commands: tuple[str, ...]) -> list[tuple[str, ...]]:
        return [(command,) for command in commands]

    def start(
        self, batch: tuple[str, ...], env: dict[str, str], cwd: str, guard: list[str]
    ) -> subprocess.Popen[bytes]:
        (command,) = batch
        return subprocess.Popen(
            [*guard, "/bin/sh", "-c", command], cwd=cwd, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group, so stop reaches every child
        )  # fmt: skip

    def failure(self, batch: tuple[str, ...], code: int) -> tuple[str, str | None]:
        return batch[0], None

    def _shell(self, command: str, env: dict[str, str], cwd: str) -> _Shell:
        return _Shell(subprocess.Popen(
            ["/bin/sh", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        ))  # fmt: skip

    def terminal(self, env: dict[str, str], cwd: str, term: str) -> TerminalShell:
        return HostShell(env, cwd, term)


ON_HOST = OnHost()  # it holds nothing: one serves every rank


class InContainer(RankRuntime):
    """The rank's processes in its podman container: all its commands one after another in one
    container (what one installs, the next sees), with the job's environment alone (none of
    the node's), given on stdin; removed when stopped or when its agent dies."""

    def __init__(self, container: Container, gpu_env: dict[str, str] | None = None) -> None:
        self.container = container
        self.gpu_env = gpu_env or {}  # its GPUs numbered from 0 (node/gpus.py)
        self._pid: int | None = None  # its init's, once asked

    @classmethod
    def of(
        cls, place: RankPlace, image: str, memory_bytes: int | None = None,
        cpus: float | None = None,
    ) -> InContainer:  # fmt: skip
        """The rank's container of `image`, seeing what the node prepared for it and its GPUs,
        with the compute request's memory and CPUs as its limits."""
        gpus = place.gpus
        return cls(Container(
            name=place.name, image=image, status_file=place.status_file,
            binds=(*place.binds, *gpus.binds),
            read_only=(*place.read_only, *(inside for _, inside in gpus.binds)),
            memory_bytes=memory_bytes, cpus=cpus, digest=place.digest, devices=gpus.devices,
        ), gpus.env)  # fmt: skip

    def environment(self, job_env: dict[str, str]) -> dict[str, str]:
        """The image's own environment, and the job's: none of the node's. A
        CUDA_VISIBLE_DEVICES the job sets wins, as on the host."""
        return {**self.gpu_env, **job_env}

    def batches(self, commands: tuple[str, ...]) -> list[tuple[str, ...]]:
        return [commands] if commands else []

    def opening(self) -> list[str]:
        c = self.container
        digest = c.digest or "its digest unknown"
        gpus = f", with {', '.join(c.devices)}" if c.devices else ""
        return [f"the commands run in a container of {c.image} ({digest}){gpus}"]

    def start(
        self, batch: tuple[str, ...], env: dict[str, str], cwd: str, guard: list[str]
    ) -> subprocess.Popen[bytes]:
        c = self.container
        # Under the rank's name: what an earlier attempt's agent left goes first.
        subprocess.run(podman.remove_argv(c.name), capture_output=True)
        self._pid = None
        Path(c.status_file).unlink(missing_ok=True)
        cleanup = json.dumps(podman.remove_argv(c.name))  # what the guard runs before it kills
        process = subprocess.Popen(
            [*guard, *podman.run_argv(c, cwd, batch)],
            # podman's conmon leaves a file named `oom` in its working directory when the kernel
            # kills a process for memory: the rank's directory, not the agent's.
            cwd=Path(c.status_file).parent,
            env={**os.environ, "ORCHESTRATOR_GUARD_CLEANUP": cleanup},  # agents/command_runner.py
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.PIPE,
            start_new_session=True,
        )  # fmt: skip
        assert process.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # it failed at once: its output says why
            process.stdin.write(podman.environment_script(env))
        process.stdin.close()
        return process

    def failure(self, batch: tuple[str, ...], code: int) -> tuple[str, str | None]:
        """The command the container's shell wrote to the status file (in a bind) it stopped
        at, and that the kernel killed a process for memory, if it did."""
        c = self.container
        index, oom_kills = podman.failed_command(c.status_file)
        command = batch[index] if index is not None else f"podman run {c.image}"
        if oom_kills and c.memory_bytes:
            return command, f"out of memory: limit {human_bytes(c.memory_bytes)}"
        return command, "out of memory" if oom_kills else None

    def pid(self, process: subprocess.Popen[bytes]) -> int:
        """The container's init (its processes are its descendants), once it runs."""
        if self._pid is None:
            self._pid = podman.container_pid(self.container.name)
        return self._pid or process.pid

    def _terminate(self, process: subprocess.Popen[bytes]) -> None:
        # Every process in it but its init, as the host's stop signals the group.
        subprocess.run(podman.signal_all_argv(self.container.name), capture_output=True)

    def _remove(self) -> None:
        # podman's client is gone: the container goes too.
        subprocess.run(podman.remove_argv(self.container.name), capture_output=True)

    def _shell(self, command: str, env: dict[str, str], cwd: str) -> _Shell:
        shell = podman.exec_argv(self.container, cwd, command)
        process = subprocess.Popen(
            shell.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        return _ShellInContainer(process, podman.environment_script(env), shell)

    def terminal(self, env: dict[str, str], cwd: str, term: str) -> TerminalShell:
        return ContainerShell(self.container, env, cwd, term)


class _Shell:
    """One shell command's process on the host: its process group is all it started."""

    def __init__(self, process: subprocess.Popen[bytes], stdin: bytes | None = None) -> None:
        self.process, self.stdin = process, stdin  # stdin: what it reads before its end

    def exit_code(self) -> int:
        return self.process.returncode

    def end(self) -> None:
        """End what it started beyond its process group, past its time."""

    def forget(self) -> None:
        """Remove what it left on the node."""


class _ShellInContainer(_Shell):
    """A shell command in the rank's container (or a new one like it), its environment on
    stdin: what it started is not the podman client's, and its exit code is in a file."""

    def __init__(
        self, process: subprocess.Popen[bytes], stdin: bytes, command: podman.ShellCommand
    ) -> None:
        super().__init__(process, stdin)
        self.command = command

    def exit_code(self) -> int:
        return self.command.exit_code(self.process.returncode)

    def end(self) -> None:
        if (end := podman.end_shell_argv(self.command)) is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                subprocess.run(end, capture_output=True, timeout=30)

    def forget(self) -> None:
        self.command.forget()


class ImagePull:
    """What a rank's prepare does for the job's image; here nothing: the rank runs in the
    node's environment, given its GPUs by Ray."""

    digest: str | None = None  # the image's, as the node has it once pulled

    def container_gpus(self, gpu_ids: list[str]) -> GpuAccess:
        """What a container of the image is given of the rank's GPUs (Ray's `gpu_ids`)."""
        return GpuAccess()

    def during(self, prepare: Callable[[], T]) -> T:
        """`prepare`'s answer, the image pulled meanwhile."""
        return prepare()

    def release(self) -> None:
        """Let go of the image (the node's image cache may remove it)."""


class PodmanPull(ImagePull):
    """The job's image onto the node through its image cache (node/image_cache.py: one pull
    per node however many ask, a lock per image), held for `holder` until `release`; its lines
    said as they come. `registry` and `secret_name`: docker_auth's REGISTRY_SECRET, resolved
    here for `team`."""

    def __init__(
        self, image: str, holder: str, registry: str | None = None,
        secret_name: str | None = None, team: str | None = None,
        say: Callable[[str], None] = lambda _: None, alive: Callable[[str], bool] = lambda _: True,
    ) -> None:  # fmt: skip
        self.image, self.holder, self.say, self.alive = image, holder, say, alive
        self._login = (registry, secret_name, team)
        self._held = False

    def container_gpus(self, gpu_ids: list[str]) -> GpuAccess:
        """Raises GpuUnavailable naming what the node lacks (before the pull: it fails now)."""
        return gpu_access(gpu_ids)

    def during(self, prepare: Callable[[], T]) -> T:
        """The pull and `prepare` at the same time; the first to fail fails at once (a refused
        password is not reported after minutes of weights)."""
        pull = self._puller()
        pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="prepare")
        try:
            futures = [pool.submit(pull), pool.submit(prepare)]
            concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
            for future in futures:
                if future.done() and (error := future.exception()) is not None:
                    raise error
            prepared = futures[1].result()
        finally:
            pool.shutdown(wait=False)
        self.digest = podman.image_digest(self.image)
        return prepared

    def pull(self) -> None:
        """The image on this node now: pulled unless it is here, or a pull under way waited
        for. Raises ImagePullFailed (node/podman.py) naming the image and why."""
        self._puller()()

    def _puller(self) -> Callable[[], object]:
        """The pull, to run; the registry secret resolved now (a missing one fails at once)."""
        registry, secret_name, team = self._login
        credentials = None
        if registry and secret_name:
            credentials = (registry, resolve_secret(secret_name, team))
        self._held = True
        return lambda: ImageCache(alive=self.alive).ensure(
            self.image, self.holder, credentials, self.say
        )

    def release(self) -> None:
        if self._held:
            ImageCache().release(self.holder)
            self._held = False


def _alive(pgid: int) -> bool:
    """Whether any process of the group is left."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)

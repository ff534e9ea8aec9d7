"""A rank's commands in a container of the job's image, with podman: pulling the image, the
command line that runs the rank's commands, the shell inside that runs them in order, and the
environment they are given.

Only the job's commands run in the container; the node agent, the uploader, the metrics sampler
and the shell stay on the host, so any image works, with or without Ray or Python inside it. The
container shares the host's network (torch distributed rendezvous on BT_LEADER_ADDR), runs an
init as PID 1 (SIGTERM reaches the trainer), has the compute request's memory and CPUs as
limits, and sees no host path but its binds, each at the path the job's variables name.

The environment never reaches a command line or the container's configuration (`podman
inspect`, the OCI spec on disk): it is written to the container's stdin as shell assignments,
which the container's shell sources before it runs the commands, whose stdin is then at its end,
as on the host.
"""

from __future__ import annotations

import base64
import json
import resource
import shlex
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from orchestrator import settings
from orchestrator.node.gpus import DRIVER_DIR

# The container's main process: reads the job's variables from stdin, then runs each command
# ($2...) through its own shell, in order, stopping at the first that fails; it writes that
# command's index and how many processes the kernel killed for memory in the container's cgroup
# (v1 or v2, as the container sees it) to the status file ($1). A stop signals every process in
# the container (`signal_all_argv`): this shell notes it and waits for the command, which saves
# and ends as on the host; were it to die first, the container's init would end and take the
# command along.
_DRIVER_PATHS = (  # the driver's files node/gpus.py binds where a node has no CDI spec
    f'if [ -d {DRIVER_DIR}/lib64 ]; then export PATH="$PATH:{DRIVER_DIR}/bin" '
    f'LD_LIBRARY_PATH="{DRIVER_DIR}/lib64${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"; fi'
)
_ENTRY = """. /dev/stdin || exit 125
DRIVER_PATHS
trap 'stopping=1' TERM
status=$1
shift
oom_kills() {
    for f in /sys/fs/cgroup/memory/memory.oom_control /sys/fs/cgroup/memory.events; do
        [ -r "$f" ] && while read -r key value; do
            [ "$key" = oom_kill ] && echo "$value" && return
        done < "$f"
    done
    echo 0
}
i=0
for command in "$@"; do
    [ -n "$stopping" ] && break
    /bin/sh -c "$command" &
    pid=$!
    wait "$pid"
    code=$?
    while kill -0 "$pid" 2>/dev/null; do wait "$pid"; code=$?; done
    if [ "$code" -ne 0 ]; then echo "$i $(oom_kills)" > "$status"; exit "$code"; fi
    i=$((i + 1))
done
""".replace("DRIVER_PATHS", _DRIVER_PATHS)
SHM_BYTES = 1 << 30  # /dev/shm: data loaders' workers pass batches through it (podman's is 64 MiB)


@dataclass(frozen=True)
class Container:
    """One rank's container: its image, limits and binds (host path -> path inside)."""

    name: str
    image: str
    status_file: str  # in a bind: which command failed, and the kernel's memory kills
    binds: tuple[tuple[str, str], ...] = ()
    read_only: tuple[str, ...] = ()  # paths inside mounted read-only (weights)
    memory_bytes: int | None = None
    cpus: float | None = None
    digest: str | None = None  # the image's, as the node had it when prepared
    devices: tuple[str, ...] = ()  # --device: the rank's GPUs (node/gpus.py)


class ImagePullFailed(RuntimeError):
    """The node could not get the job's image; the message names it, its registry and why."""


def pull(
    image: str, credentials: tuple[str, str] | None = None, timeout_s: float = 1800,
    say: Callable[[str], None] = lambda _: None,
) -> None:  # fmt: skip
    """Pull `image` onto this node (node/image_cache.py decides when), saying podman's progress
    lines as they come, so a missing image or a refused password ends the deploy, naming them.
    `credentials`: the registry and `username:password` (docker_auth's REGISTRY_SECRET), given
    to podman in an auth file of this call's own, removed after (never on a command line)."""
    with tempfile.TemporaryDirectory(prefix="orchestrator-pull-") as private:  # mode 0700
        argv = ["podman", *global_args(), "pull"]
        if credentials is not None:
            registry, secret = credentials
            auth = Path(private) / "auth.json"
            auth.touch(mode=0o600)
            token = base64.b64encode(secret.encode()).decode()
            auth.write_text(json.dumps({"auths": {registry: {"auth": token}}}))
            argv += ["--authfile", str(auth)]
        process = subprocess.Popen(
            [*argv, image], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        timed_out = threading.Event()

        def expire() -> None:
            timed_out.set()
            process.kill()

        deadline = threading.Timer(timeout_s, expire)
        deadline.start()
        lines = []
        try:
            assert process.stderr is not None
            for line in process.stderr:  # not a terminal: one line per step, no bars
                if line.strip():
                    lines.append(line.strip())
                    if not line.startswith("Error"):
                        say(line.strip())
            code = process.wait()
        finally:
            deadline.cancel()
    if timed_out.is_set():
        raise ImagePullFailed(f"pulling image {image} took over {timeout_s:g} s")
    if code != 0:
        why = lines[-1].removeprefix("Error: ") if lines else f"podman exited {code}"
        registry = credentials[0] if credentials else image.split("/")[0]
        raise ImagePullFailed(f"could not pull image {image} from {registry}: {why}")


def exists(name: str, kind: str = "image") -> bool:
    """Whether this node has an image (or a container, `kind`) of that name."""
    found = subprocess.run(["podman", *global_args(), kind, "exists", name],
                           capture_output=True)  # fmt: skip
    return found.returncode == 0


def image_facts(image: str) -> tuple[str, int] | None:
    """The image's full id and size in bytes, or None if this node has no image of that name."""
    found = subprocess.run(
        ["podman", *global_args(), "image", "inspect", "--format", "{{.Id}} {{.Size}}", image],
        capture_output=True, text=True,
    )  # fmt: skip
    if found.returncode != 0 or len(found.stdout.split()) != 2:
        return None
    ident, size = found.stdout.split()
    return ident, int(size)


def images_in_use() -> set[str]:
    """The full ids of the images any container on this node (running or not) was made from."""
    listed = subprocess.run(["podman", *global_args(), "ps", "-a", "--format", "{{.ImageID}}"],
                            capture_output=True, text=True)  # fmt: skip
    return {line.strip() for line in listed.stdout.splitlines() if line.strip()}


def remove_image(image: str) -> bool:
    """The name removed (and the image with it, when no other name is left on it)."""
    removed = subprocess.run(["podman", *global_args(), "rmi", image], capture_output=True)
    return removed.returncode == 0


def storage_dir(image: str) -> str:
    """A directory on the disk where podman keeps `image` (its top layer's)."""
    found = subprocess.run(
        ["podman", *global_args(), "image", "inspect", "--format",
         "{{.GraphDriver.Data.UpperDir}}", image], capture_output=True, text=True,
    )  # fmt: skip
    path = found.stdout.strip()
    return path if found.returncode == 0 and path.startswith("/") else "/"


def global_args() -> list[str]:
    """podman's own options: $ORCHESTRATOR_PODMAN_ARGS, else what this node's cgroups need.
    On cgroup v1 (or the v1/v2 hybrid), crun (podman's default runtime) fails; runc with
    cgroupfs works."""
    configured = settings.PODMAN_ARGS.get()
    if configured is not None:
        return shlex.split(configured)
    if not Path("/sys/fs/cgroup/cgroup.controllers").exists():  # not the unified v2 hierarchy
        return ["--runtime", "runc", "--cgroup-manager", "cgroupfs"]
    return []


def run_argv(container: Container, cwd: str, commands: tuple[str, ...]) -> list[str]:
    """`podman run` of the rank's commands, attached (its output is theirs); stdin carries the
    environment (`environment_script`)."""
    entry = ["/bin/sh", "-c", _ENTRY, "orchestrator", container.status_file, *commands]
    return [*_run(container, container.name, cwd, "-i"), container.image, *entry]


def _run(container: Container, name: str, cwd: str, *flags: str) -> list[str]:
    """`podman run` of the rank's container as its commands have it: network, init, limits,
    binds; the image and what it runs follow."""
    argv = [
        "podman", *global_args(), "run", "--rm", *flags, "--name", name,
        "--network", "host", "--init", "--shm-size", str(SHM_BYTES), "--workdir", cwd,
        *_ulimits(),
    ]  # fmt: skip
    if container.memory_bytes:
        argv += ["--memory", str(container.memory_bytes)]
    if container.cpus:
        argv += ["--cpus", f"{container.cpus:g}"]
    for device in container.devices:
        argv += ["--device", device]
    for host, inside in container.binds:
        mode = "ro" if inside in container.read_only else "rw"
        argv += ["--volume", f"{host}:{inside}:{mode}"]
    return argv


# A shell command's wrapper: its pid (inside) to $2, then the command, whose exit code goes to
# $3. podman can fail an exec whose command has ended when the container ends in that moment
# (the command was what ended it: `touch /tmp/go` for a loop waiting on it); the file still
# says how the command ended.
_SHELL_COMMAND = (
    f'. /dev/stdin && {{ {_DRIVER_PATHS}; echo $$ > "$2"; /bin/sh -c "$1" </dev/null; '
    'code=$?; { echo $code > "$3"; } 2>/dev/null; exit $code; }'
)


@dataclass(frozen=True)
class ShellCommand:
    """`orchestrator shell -- CMD` in the container: its argv, the container it runs in, and
    whether that container is its own (a held job's: removed to end it)."""

    argv: list[str]
    name: str
    own_container: bool
    pid_file: Path  # the command's pid inside, once it runs
    exit_file: Path  # its exit code, once it ended

    def exit_code(self, podman_code: int) -> int:
        """The command's exit code: the one it wrote where it ended, else (it was killed, or
        never ran) podman's."""
        try:
            return int(self.exit_file.read_text())
        except (OSError, ValueError):
            return podman_code

    def forget(self) -> None:
        self.pid_file.unlink(missing_ok=True)
        self.exit_file.unlink(missing_ok=True)


def shell_wrapper(command: str, pid_file: Path, exit_file: Path) -> list[str]:
    """What runs a shell command inside: the job's environment from stdin, then `command`."""
    return ["/bin/sh", "-c", _SHELL_COMMAND, "orchestrator", command, str(pid_file),
            str(exit_file)]  # fmt: skip


def exec_argv(container: Container, cwd: str, command: str) -> ShellCommand:
    """One shell command (`orchestrator shell -- CMD`), its environment on stdin as for the
    commands: in the rank's container while the commands run, else (a held job's nodes, its
    commands ended) in a new container of the image with the rank's binds."""
    files = Path(container.status_file).parent / f"shell-{uuid.uuid4().hex[:8]}"
    pid_file, exit_file = files.with_suffix(".pid"), files.with_suffix(".exit")
    shell = shell_wrapper(command, pid_file, exit_file)
    if exists(container.name, "container"):
        argv = ["podman", *global_args(), "exec", "-i", "--workdir", cwd, container.name, *shell]
        return ShellCommand(argv, container.name, False, pid_file, exit_file)
    name = f"{container.name}-shell-{uuid.uuid4().hex[:8]}"
    argv = [*_run(container, name, cwd, "-i"), container.image, *shell]
    return ShellCommand(argv, name, True, pid_file, exit_file)


# Kill process $1 and every process descended from it (by parent pid): what a shell command
# that ran past its time left in the rank's container. Each found is stopped before the next
# look, so none can fork unseen; all are killed once a look finds no new one.
_KILL_TREE = """pids=" $1 " grew=1
while [ -n "$grew" ]; do
    grew=
    kill -s STOP $pids 2>/dev/null
    for d in /proc/[0-9]*; do
        case "$pids" in *" ${d#/proc/} "*) continue ;; esac
        read -r line < "$d/stat" 2>/dev/null || continue
        set -- "$1" ${line##*) }
        case "$pids" in *" $3 "*) pids="$pids${d#/proc/} " grew=1 ;; esac
    done
done
kill -s KILL $pids 2>/dev/null
exit 0
"""


def end_shell_argv(shell: ShellCommand, wait_s: float = 2.0) -> list[str] | None:
    """What ends the shell command and all it started inside, as a timeout on the host kills
    its process group. Its pid is waited for up to `wait_s` (a timeout shorter than podman's
    start); None if it never ran."""
    if shell.own_container:
        return remove_argv(shell.name)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            pid = int(shell.pid_file.read_text())
            break
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)
    return ["podman", *global_args(), "exec", shell.name, "/bin/sh", "-c", _KILL_TREE,
            "orchestrator", str(pid)]  # fmt: skip


# A terminal's shell in the container: the job's variables from fd 3, its pid (inside) to fd 4,
# then bash if the image has it, else sh.
_TERMINAL = """. /dev/fd/3 || exit 125
DRIVER_PATHS
exec 3<&-
echo $$ >&4
exec 4>&-
export SHELL=/bin/sh TERM="$1"
[ -x /bin/bash ] && SHELL=/bin/bash
exec "$SHELL" -i
""".replace("DRIVER_PATHS", _DRIVER_PATHS)
# The terminal's hang-up: SIGHUP to each process of session $1, SIGKILL to those left after $2 s.
_HANG_UP = """members() {
    for d in /proc/[0-9]*; do
        read -r line < "$d/stat" 2>/dev/null || continue
        set -- ${line##*) }
        [ "$4" = "$session" ] && echo "${d#/proc/}"
    done
}
session=$1 tenths=$(($2 * 10))
kill -s HUP $(members) 2>/dev/null
while [ "$tenths" -gt 0 ] && [ -n "$(members)" ]; do sleep 0.1; tenths=$((tenths - 1)); done
kill -s KILL $(members) 2>/dev/null
exit 0
"""


def terminal_argv(container: Container, cwd: str, term: str) -> tuple[list[str], str]:
    """An interactive shell, fds 3 and 4 passed in (`_TERMINAL`), and the container it runs in:
    the rank's while its commands run (`podman exec -it`), else a new one of the image with the
    rank's binds, gone with the shell."""
    shell = ["/bin/sh", "-c", _TERMINAL, "orchestrator", term]
    if exists(container.name, "container"):
        return [
            "podman", *global_args(), "exec", "-it", "--preserve-fds", "2", "--workdir", cwd,
            container.name, *shell,
        ], container.name  # fmt: skip
    name = f"{container.name}-terminal-{uuid.uuid4().hex[:8]}"
    argv = _run(container, name, cwd, "-it", "--preserve-fds", "2")
    return [*argv, container.image, *shell], name


def hang_up_argv(name: str, session: str, grace_s: float) -> list[str]:
    return ["podman", *global_args(), "exec", name, "/bin/sh", "-c", _HANG_UP, "orchestrator",
            session, str(max(int(grace_s), 1))]  # fmt: skip


def signal_all_argv(name: str, signal: str = "TERM") -> list[str]:
    """Signal every process in the container but its init (and this shell), as a stop on the
    host signals the command's whole process group."""
    return ["podman", *global_args(), "exec", name, "/bin/sh", "-c", f"kill -s {signal} -- -1"]


def container_pid(name: str) -> int | None:
    """The host pid of the container's init (its processes are its descendants); None until
    it runs."""
    found = subprocess.run(
        ["podman", *global_args(), "inspect", "--format", "{{.State.Pid}}", name],
        capture_output=True, text=True,
    )  # fmt: skip
    pid = found.stdout.strip()
    return int(pid) if found.returncode == 0 and pid.isdigit() and int(pid) > 0 else None


def image_digest(image: str) -> str | None:
    """The digest of what this node has under that name (`image@digest` pins it), or None."""
    found = subprocess.run(
        ["podman", *global_args(), "image", "inspect", "--format", "{{.Digest}}", image],
        capture_output=True, text=True,
    )  # fmt: skip
    digest = found.stdout.strip()
    return digest if found.returncode == 0 and digest.startswith("sha256:") else None


def failed_command(status_file: str) -> tuple[int | None, int]:
    """Which command failed and how many processes the kernel had killed for memory, as the
    container's shell wrote them; (None, 0) if it wrote nothing (the container did not start,
    or was killed)."""
    try:
        index, oom_kills = Path(status_file).read_text().split()
        return int(index), int(oom_kills)
    except (OSError, ValueError):
        return None, 0


def remove_argv(name: str) -> list[str]:
    """Remove the container whatever its state: what a stop leaves, or an agent that died."""
    return ["podman", *global_args(), "rm", "--force", "--ignore", "--time", "0", name]


def environment_script(env: dict[str, str]) -> bytes:
    """The job's variables as the container's shell sources them (values quoted: any bytes)."""
    lines = [f"export {name}={shlex.quote(value)}" for name, value in sorted(env.items())]
    return ("\n".join(lines) + "\n").encode()


# Above this, runc could not set the limits on these machines (no CAP_SYS_RESOURCE).
_MOST_ULIMIT = 32768


def _ulimits() -> list[str]:
    """The agent's own open-file and process limits, at most _MOST_ULIMIT: podman's defaults
    (and a node's hard limits) are more than runc may set without CAP_SYS_RESOURCE."""
    args = []
    for flag, which in (("nofile", resource.RLIMIT_NOFILE), ("nproc", resource.RLIMIT_NPROC)):
        soft, _ = resource.getrlimit(which)
        value = _MOST_ULIMIT if soft == resource.RLIM_INFINITY else min(soft, _MOST_ULIMIT)
        args += ["--ulimit", f"{flag}={value}:{value}"]
    return args

"""Where a job's ranks run, without Ray or a real podman: the cluster's kind
(agents/runtimes.py), each rank's runtime on its node (node/rank_runtime.py: the environment,
the processes that run the commands, a failure, the stop, a shell command, the image's pull),
and that no other module asks which kind it is."""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_node_agent import gone

from orchestrator.agents.command_runner import CommandRunner
from orchestrator.agents.messages import CommandsEnded, ImageRequest, OutputLines
from orchestrator.agents.runtimes import (
    ContainerRuntime,
    HostRuntime,
    ImageUriRuntime,
    RuntimeKind,
    cluster_runtime_kind,
    image_pull,
    push_notices,
)
from orchestrator.node import podman
from orchestrator.node.gpus import GpuAccess
from orchestrator.node.podman import ImagePullFailed
from orchestrator.node.rank_runtime import (
    SHELL_TIMEOUT_EXIT,
    ImagePull,
    InContainer,
    OnHost,
    PodmanPull,
    RankPlace,
)
from orchestrator.node.secrets import SecretMasker

PACKAGE = Path(__file__).resolve().parents[1] / "orchestrator"
# The modules that may know which kind a job runs in; settings.py defines the settings.
RUNTIME_MODULES = {"agents/runtimes.py", "node/rank_runtime.py"}
FLAGS = {"JOB_RUNTIME", "USE_IMAGE_URI", "use_image_uri"}
GPUS = GpuAccess(
    devices=("nvidia.com/gpu=3",), binds=(("/usr/lib/libcuda.so.1", "/usr/local/nvidia/lib64/x"),),
    env={"CUDA_VISIBLE_DEVICES": "0"},
)  # fmt: skip


def modules() -> dict[str, ast.Module]:
    return {
        str(path.relative_to(PACKAGE)): ast.parse(path.read_text())
        for path in PACKAGE.rglob("*.py")
    }


def test_no_module_but_the_runtimes_reads_the_settings_that_choose_the_runtime():
    readers = sorted(
        f"{name}:{node.lineno}"
        for name, tree in modules().items()
        if name not in RUNTIME_MODULES | {"settings.py"}
        for node in ast.walk(tree)
        if (isinstance(node, ast.Attribute) and node.attr in FLAGS)
        or (isinstance(node, ast.Name) and node.id in FLAGS)
        or (isinstance(node, ast.alias) and node.name in FLAGS)
        or (isinstance(node, ast.Constant) and node.value in {"ORCHESTRATOR_JOB_RUNTIME",
                                                             "ORCHESTRATOR_USE_IMAGE_URI"})
    )  # fmt: skip
    assert not readers, f"ask agents/runtimes.py (RuntimeKind, JobRuntime) instead: {readers}"


def _asks_for_a_container(test: ast.expr) -> bool:
    """`container`, `not self._container`, `container is None`, `(c := ...) is not None`."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        test = test.operand
    if (isinstance(test, ast.Compare) and isinstance(test.ops[0], ast.Is | ast.IsNot)
            and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value is None):  # fmt: skip
        test = test.left
    if isinstance(test, ast.NamedExpr):
        test = test.target
    name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", "")
    return "container" in name.lower()


def test_nothing_outside_the_runtimes_branches_on_whether_there_is_a_container():
    branches = []
    for name, tree in modules().items():
        if name in RUNTIME_MODULES | {"node/podman.py"}:  # podman's: all of it is in one
            continue
        for node in ast.walk(tree):
            tests = [node.test] if isinstance(node, ast.If | ast.IfExp | ast.While) else []
            tests += node.values if isinstance(node, ast.BoolOp) else []
            tests += node.ifs if isinstance(node, ast.comprehension) else []
            branches += [f"{name}:{t.lineno}: {ast.unparse(t)}" for t in tests
                         if _asks_for_a_container(t)]  # fmt: skip
    assert not branches, f"ask the rank's runtime (node/rank_runtime.py) instead: {branches}"


@pytest.mark.parametrize(
    "job_runtime, image_uri, kind",
    [("host", "", RuntimeKind.HOST), ("container", "", RuntimeKind.CONTAINER),
     ("host", "1", RuntimeKind.IMAGE_URI), ("container", "1", RuntimeKind.CONTAINER)],
)  # fmt: skip
def test_the_clusters_kind_and_what_its_queue_service_says_of_it(
    job_runtime, image_uri, kind, monkeypatch
):
    """The beat says what ORCHESTRATOR_JOB_RUNTIME says, as before; only a container cluster's
    nodes pull waiting jobs' images."""
    monkeypatch.setenv("ORCHESTRATOR_JOB_RUNTIME", job_runtime)
    monkeypatch.setenv("ORCHESTRATOR_USE_IMAGE_URI", image_uri)
    assert cluster_runtime_kind() == kind
    assert kind.said == job_runtime
    assert kind.nodes_pull_images == (kind == RuntimeKind.CONTAINER)


def test_push_warns_of_trusted_code_only_where_the_cluster_said_host():
    from orchestrator import definitions as d

    job = d.TrainingJob(image=d.Image(base_image="python:3.11"),
                        runtime=d.Runtime(start_commands=["true"]))  # fmt: skip
    (notice,) = push_notices(job, "host")
    assert "as trusted code: image.base_image is recorded only" in notice
    assert push_notices(job, "container") == [] and push_notices(job, None) == []


def place(tmp_path: Path, gpus: GpuAccess = GPUS) -> RankPlace:
    return RankPlace(
        name="orchestrator-j1-rank-0", status_file=str(tmp_path / "failed"),
        binds=((str(tmp_path), str(tmp_path)), ("/cache/w", "/models/w")),
        read_only=("/models/w",), gpus=gpus, digest="sha256:abc",
    )  # fmt: skip


def test_a_host_or_image_uri_rank_runs_on_its_node_a_container_ranks_in_its_container(tmp_path):
    """The container sees the rank's binds and its GPUs' (read-only), with the job's limits;
    the podman command line says so."""
    assert isinstance(HostRuntime("i").on_node(place(tmp_path)), OnHost)
    assert isinstance(ImageUriRuntime("i").on_node(place(tmp_path)), OnHost)
    runtime = ContainerRuntime("pytorch:2", memory_bytes=2 << 30, cpus=4).on_node(place(tmp_path))
    assert isinstance(runtime, InContainer)
    argv = " ".join(podman.run_argv(runtime.container, str(tmp_path), ("python train.py",)))
    for part in (f"--volume {tmp_path}:{tmp_path}:rw", "--volume /cache/w:/models/w:ro",
                 "--volume /usr/lib/libcuda.so.1:/usr/local/nvidia/lib64/x:ro",
                 "--device nvidia.com/gpu=3", "--memory 2147483648", "--cpus 4",
                 "--name orchestrator-j1-rank-0 "):  # fmt: skip
        assert part in argv
    assert runtime.opening() == [
        "the commands run in a container of pytorch:2 (sha256:abc), with nvidia.com/gpu=3"
    ]


def test_on_the_host_the_commands_see_the_nodes_environment_but_its_secrets(monkeypatch):
    monkeypatch.setenv("ORCHESTRATOR_SECRET_HF", "node-secret")
    monkeypatch.setenv("NODE_ONLY", "here")
    env = OnHost().environment({"NODE_ONLY": "the job's", "BT_NODE_RANK": "0"})
    assert env["NODE_ONLY"] == "the job's" and env["BT_NODE_RANK"] == "0"
    assert not any(k.startswith("ORCHESTRATOR_SECRET_") for k in env)
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)


def test_in_a_container_the_commands_see_the_jobs_environment_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("NODE_ONLY", "here")
    runtime = ContainerRuntime("i").on_node(place(tmp_path))
    assert runtime.environment({"BT_NODE_RANK": "0"}) == {
        "CUDA_VISIBLE_DEVICES": "0", "BT_NODE_RANK": "0"
    }  # fmt: skip
    assert runtime.environment({"CUDA_VISIBLE_DEVICES": "1"}) == {"CUDA_VISIBLE_DEVICES": "1"}


def test_each_runtime_says_which_command_failed_and_why(tmp_path):
    commands = ("pip install x", "python train.py", "echo done")
    assert OnHost().batches(commands) == [(c,) for c in commands]
    assert OnHost().failure(("python train.py",), 1) == ("python train.py", None)
    limited = ContainerRuntime("img", memory_bytes=256 << 20).on_node(place(tmp_path))
    assert limited.batches(commands) == [commands] and limited.batches(()) == []
    status = Path(limited.container.status_file)
    status.write_text("1 0\n")
    assert limited.failure(commands, 1) == ("python train.py", None)
    status.write_text("1 2\n")  # the container's shell saw two memory kills
    assert limited.failure(commands, 137) == ("python train.py", "out of memory: limit 256.0 MiB")
    unlimited = ContainerRuntime("img").on_node(place(tmp_path))
    assert unlimited.failure(commands, 137) == ("python train.py", "out of memory")
    status.unlink()  # the container never started
    assert unlimited.failure(commands, 125) == ("podman run img", None)


class OneShell(OnHost):
    """A runtime of the test's own: every command in one shell, its failure its own words."""

    def batches(self, commands: tuple[str, ...]) -> list[tuple[str, ...]]:
        return [commands]

    def opening(self) -> list[str]:
        return ["in one shell"]

    def start(self, batch, env, cwd, guard):
        return super().start((" && ".join(batch),), env, cwd, guard)

    def failure(self, batch, code):
        return "one of them", f"code {code}"


def test_the_runner_runs_the_commands_as_the_runtime_it_is_given_says(tmp_path):
    runner = CommandRunner(lambda line, progress: f"[t] {line}")
    items = list(runner.run(("echo one", "exit 3", "echo never"), dict(os.environ),
                            str(tmp_path), SecretMasker([]), runtime=OneShell()))  # fmt: skip
    lines = [line for item in items if isinstance(item, OutputLines) for line in item.lines]
    assert lines == ["[t] in one shell", "[t] one"]
    ended = items[-1]
    assert isinstance(ended, CommandsEnded)
    assert (ended.exit_code, ended.command, ended.why) == (3, "one of them", "code 3")


def start_alone(runtime: OnHost, command: str, tmp_path: Path) -> subprocess.Popen[bytes]:
    """`command` as the runtime starts a rank's, without the agent's guard."""
    return runtime.start((command,), dict(os.environ), str(tmp_path), guard=[])


def test_a_host_stop_ends_every_process_of_the_command_at_once_or_after_its_grace(tmp_path):
    process = start_alone(OnHost(), "sleep 300 & echo $!; wait", tmp_path)
    child = int(process.stdout.readline())
    started = time.monotonic()
    OnHost().stop(process, grace_s=30)
    assert time.monotonic() - started < 10  # both ended on SIGTERM: no grace waited out
    assert gone(child)
    stubborn = start_alone(OnHost(), "trap '' TERM; sleep 300 & echo $!; wait", tmp_path)
    child = int(stubborn.stdout.readline())
    started = time.monotonic()
    OnHost().stop(stubborn, grace_s=0.5)
    assert time.monotonic() - started >= 0.5 and gone(child)  # killed once the grace was up


PODMAN_ARGS = "--log-level=error"  # podman's own options, as a node's settings give them


def fake_podman(tmp_path: Path, monkeypatch) -> Path:
    """A `podman` first on PATH that records each call (one JSON line) and does nothing."""
    calls = tmp_path / "podman-calls"
    script = tmp_path / "bin" / "podman"
    script.parent.mkdir()
    script.write_text(f"""#!{sys.executable}
import json, sys
with open({str(calls)!r}, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
""")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("ORCHESTRATOR_PODMAN_ARGS", PODMAN_ARGS)
    return calls


def test_a_container_stop_signals_inside_then_kills_and_removes_the_container(
    tmp_path, monkeypatch
):
    """SIGTERM to every process in the container (its init aside), the grace, SIGKILL to the
    podman client's group, then the container removed."""
    calls = fake_podman(tmp_path, monkeypatch)
    runtime = ContainerRuntime("img").on_node(place(tmp_path))
    client = start_alone(OnHost(), "trap '' TERM; sleep 300", tmp_path)  # podman run's stand-in
    started = time.monotonic()
    runtime.stop(client, grace_s=0.5)
    assert time.monotonic() - started >= 0.5 and client.poll() == -signal.SIGKILL
    said = [json.loads(line)[1:] for line in calls.read_text().splitlines()]
    assert said == [
        ["exec", "orchestrator-j1-rank-0", "/bin/sh", "-c", "kill -s TERM -- -1"],
        ["rm", "--force", "--ignore", "--time", "0", "orchestrator-j1-rank-0"],
    ]


def test_a_container_rank_starts_clean_under_the_guard_with_its_environment_on_stdin(
    tmp_path, monkeypatch
):
    """An earlier attempt's container and status file go first; the guard is told how to
    remove the container; the job's variables reach the container's shell on stdin only."""
    calls = fake_podman(tmp_path, monkeypatch)
    runtime = ContainerRuntime("img").on_node(place(tmp_path, GpuAccess()))
    Path(runtime.container.status_file).write_text("0 0\n")
    probe = (
        "import json, os, sys; print(json.dumps(["
        "os.environ.get('ORCHESTRATOR_GUARD_CLEANUP'), sys.stdin.read(), os.getcwd()]))"
    )
    process = runtime.start(("python train.py",), {"TOKEN": "s3cret"}, str(tmp_path),
                            guard=[sys.executable, "-c", probe])  # fmt: skip
    cleanup, stdin, cwd = json.loads(process.stdout.read())
    assert process.wait(timeout=60) == 0
    assert json.loads(cleanup) == podman.remove_argv("orchestrator-j1-rank-0")
    assert stdin == "export TOKEN=s3cret\n" and cwd == str(tmp_path)
    assert not Path(runtime.container.status_file).exists()
    assert [json.loads(line)[:2] for line in calls.read_text().splitlines()] == [
        [PODMAN_ARGS, "rm"]
    ]
    assert "s3cret" not in " ".join(process.args)


def test_a_shell_command_on_the_host_reports_its_code_and_past_its_time_is_killed(tmp_path):
    assert OnHost().exec("echo $GREETING; exit 3", {"GREETING": "hi"}, str(tmp_path), 30) == (
        3, b"hi\n"
    )  # fmt: skip
    started = time.monotonic()
    code, out = OnHost().exec("sleep 300 & echo $!; wait", {}, str(tmp_path), timeout_s=1)
    assert code == SHELL_TIMEOUT_EXIT and time.monotonic() - started < 30
    assert gone(int(out))


def test_without_an_image_the_prepare_runs_alone(tmp_path):
    nothing = image_pull(None, "agent", None, print, lambda _: True)
    assert type(nothing) is ImagePull
    assert nothing.container_gpus(["0"]) == GpuAccess()  # Ray's CUDA_VISIBLE_DEVICES stands
    assert nothing.during(lambda: "prepared") == "prepared" and nothing.digest is None


def test_an_image_is_pulled_while_the_rest_is_prepared_and_held_until_released(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(podman, "exists", lambda name, kind="image": True)
    monkeypatch.setattr(podman, "image_digest", lambda image: "sha256:feed")
    said: list[str] = []
    pull = image_pull(ImageRequest("img:1"), "agent-a", None, said.append, lambda _: True)
    assert isinstance(pull, PodmanPull)
    assert pull.during(lambda: "prepared") == "prepared" and pull.digest == "sha256:feed"
    assert said == ["image img:1: on this node already"]
    state = tmp_path / "home" / "images" / "images.json"
    assert json.loads(state.read_text())["img:1"]["holders"] == ["agent-a"]
    pull.release()
    assert json.loads(state.read_text())["img:1"]["holders"] == []


def test_a_failed_pull_fails_the_prepare_without_waiting_for_the_rest(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(podman, "exists", lambda name, kind="image": False)

    def refused(image, credentials=None, timeout_s=1800, say=None):
        raise ImagePullFailed(f"could not pull image {image}: unauthorized")

    monkeypatch.setattr(podman, "pull", refused)
    rest = threading.Event()  # what the prepare waits for: never set while the pull fails
    pull = PodmanPull("img:1", "agent-a")
    started = time.monotonic()
    with pytest.raises(ImagePullFailed, match="unauthorized"):
        pull.during(lambda: rest.wait(60))
    rest.set()
    assert time.monotonic() - started < 30

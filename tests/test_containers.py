"""Jobs whose commands run in a container of their image (ORCHESTRATOR_JOB_RUNTIME=container):
real podman, and an image built here offline from Debian's static busybox (no Python, no Ray in
it: our agents stay on the host). On a cluster of its own, whose head and node have the setting
and a secret, as `ray start` would give them.

Needs podman, runc and /bin/busybox (tests/install-system.sh installs them);
ORCHESTRATOR_SKIP_CONTAINER_TESTS=1 skips these tests instead.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import images
import pexpect
import psutil
import pytest
from conftest import attach, eventually, free_port, make_job, simulated_cluster
from ray.util.state import list_actors
from registry import REGISTRY_PASSWORD, REGISTRY_USER, Registry

from orchestrator import actor_names
from orchestrator.agents.image_puller import ImagePuller
from orchestrator.client.api import push
from orchestrator.cluster.auth import token_file
from orchestrator.lifecycle import JobState
from orchestrator.node import podman
from orchestrator.node.image_cache import ImageCache

pytestmark = pytest.mark.cluster  # starts a Ray cluster of its own

IMAGE = images.BUSYBOX
SECRET_NAME, SECRET_VALUE = "container_token", "ctr-s3cr3t-91f4"
CLUSTER: dict[str, str] = {}  # the container cluster's GCS address, Ray Client and session dir


def _need_tools() -> None:
    if os.environ.get("ORCHESTRATOR_SKIP_CONTAINER_TESTS") == "1":
        pytest.skip("ORCHESTRATOR_SKIP_CONTAINER_TESTS=1: jobs in containers are not tested")
    tools = ("podman", "runc", "docker-registry", "htpasswd")
    missing = [t for t in tools if shutil.which(t) is None]
    if missing or not Path("/bin/busybox").exists():
        pytest.fail(f"{missing or '/bin/busybox'} missing: run tests/install-system.sh (or set "
                    "ORCHESTRATOR_SKIP_CONTAINER_TESTS=1 to skip these tests)")  # fmt: skip


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    _need_tools()
    server = Registry(tmp_path_factory.mktemp("registry"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def container_cluster(
    orchestrator_home, registry: Registry, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    images.busybox_image(tmp_path_factory.mktemp("image"))
    node_env = {
        "ORCHESTRATOR_JOB_RUNTIME": "container",
        _secret_env(SECRET_NAME): SECRET_VALUE,
        _secret_env("registry_login"): f"{REGISTRY_USER}:{REGISTRY_PASSWORD}",
        _secret_env("registry_wrong"): f"{REGISTRY_USER}:not-the-password",
        "CONTAINERS_REGISTRIES_CONF": str(registry.registries_conf),
    }
    client_port = free_port()  # `orchestrator shell`'s terminal goes through Ray Client
    node_env["ORCHESTRATOR_RAY_CLIENT_ADDRESS"] = f"ray://127.0.0.1:{client_port}"
    saved = {k: os.environ.get(k) for k in node_env}
    os.environ.update(node_env)
    cluster, address = simulated_cluster(ray_client_port=client_port)
    try:
        cluster.add_node(num_cpus=2)
        cluster.add_node(num_cpus=1, num_gpus=1, resources={"accelerator_type:H100": 1})
        cluster.wait_for_nodes()
        CLUSTER.update(gcs=cluster.address, client=node_env["ORCHESTRATOR_RAY_CLIENT_ADDRESS"],
                       session=cluster.head_node.get_session_dir_path())  # fmt: skip
        yield address
    finally:
        cluster.shutdown()
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.update({key: value})


def _secret_env(name: str) -> str:
    return f"ORCHESTRATOR_SECRET_{name.upper()}"


def image_job(
    directory: Path, commands: list[str], checkpoints: bool = False, accelerator: str | None = None,
    image: str = IMAGE, auth: str = "None", nodes: int = 1, session: str = "None", cpus: int = 1,
) -> Path:  # fmt: skip
    return make_job(
        directory,
        f"""
        from truss_train import definitions as d
        project = d.TrainingProject(
            name="in-a-container",
            job=d.TrainingJob(
                image=d.Image(base_image={image!r}, docker_auth={auth}),
                compute=d.Compute(cpu_count={cpus}, memory="256Mi", accelerator={accelerator!r},
                                  node_count={nodes}),
                runtime=d.Runtime(
                    start_commands={commands!r},
                    environment_variables={{"TOKEN": d.SecretReference(name={SECRET_NAME!r})}},
                    checkpointing_config=d.CheckpointingConfig(enabled={checkpoints}),
                ),
                interactive_session={session},
            ),
        )
        """,
    )


def test_commands_run_in_the_image_seeing_only_their_mounts_and_checkpoints_upload(
    container_cluster, tmp_path
):
    here = Path(__file__).resolve().parent  # a host path: the container must not see it
    commands = [
        "echo installed > /etc/installed-by-job",  # what a `pip install` does to an image
        f"cat /etc/installed-by-job; test -e {here} || echo no host paths; "
        f"test -e {token_file()} || echo no token file; "  # the cluster's, beside Ray's processes
        "echo auth ${RAY_AUTH_MODE:-none} ${RAY_AUTH_TOKEN_PATH:-none}; "
        "echo rank $BT_NODE_RANK of $BT_GROUP_SIZE token $TOKEN; "
        "mkdir -p $BT_CHECKPOINT_DIR/checkpoint-1 && echo one > $BT_CHECKPOINT_DIR/checkpoint-1/w; "
        "mkdir $BT_CHECKPOINT_DIR/.tmp-2 && echo two > $BT_CHECKPOINT_DIR/.tmp-2/w && "
        "mv $BT_CHECKPOINT_DIR/.tmp-2 $BT_CHECKPOINT_DIR/checkpoint-2",
    ]
    root = str(tmp_path / "storage")
    job = push(image_job(tmp_path / "a", commands, checkpoints=True), address=container_cluster,
               storage_root=root)  # fmt: skip
    assert job.wait(timeout=120) == JobState.COMPLETED, (job.logs(), job.details())
    printed = [line.split("] ", 1)[-1] for line in job.logs()]
    assert "installed" in printed  # the second command sees what the first did to the image
    assert "no host paths" in printed
    assert "no token file" in printed and "auth none none" in printed  # no cluster credential
    assert "rank 0 of 1 token *****" in printed  # the secret reached it, masked in the logs
    stored = {(m.name, m.size_bytes) for m in job.checkpoints()}
    assert stored == {("checkpoint-1", 4), ("checkpoint-2", 4)}  # in place and renamed in

    # The next job in the same image starts from the image, not from what the last one did.
    again = push(image_job(tmp_path / "b", ["test -e /etc/installed-by-job || echo clean"]),
                 address=container_cluster, storage_root=root)  # fmt: skip
    assert again.wait(timeout=120) == JobState.COMPLETED, again.logs()
    assert any(line.endswith("] clean") for line in again.logs())
    # The cluster's queue service says where it runs jobs, so push says nothing of trusted code.
    from orchestrator.storage.queue_store import QueueStore
    from orchestrator.storage.root import StorageRoot

    assert QueueStore(StorageRoot(root)).runtimes() == {"container"}
    assert not any("trusted code" in n for n in again.record.notices), again.record.notices


SAVE_ON_TERM = (
    "trap 'mkdir -p $BT_CHECKPOINT_DIR/checkpoint-9 && echo saved > $BT_CHECKPOINT_DIR/"
    "checkpoint-9/w; echo saved on SIGTERM; exit 0' TERM; echo ready; "
    "while :; do sleep 0.1; done"
)


def test_a_stop_reaches_the_command_in_its_container_which_saves_and_no_secret_shows(
    container_cluster, tmp_path, monkeypatch
):
    monkeypatch.setenv("ORCHESTRATOR_METRICS_INTERVAL_S", "0.5")
    job = push(image_job(tmp_path / "job", [SAVE_ON_TERM, "echo never"], checkpoints=True),
               address=container_cluster, storage_root=str(tmp_path / "storage"))  # fmt: skip
    eventually(lambda: any(line.endswith("] ready") for line in job.logs()), "ready", 120)
    name = actor_names.node_agent(job.id, 0)
    inspect = subprocess.run(["podman", *podman.global_args(), "inspect", name],
                             capture_output=True, text=True)  # fmt: skip
    assert inspect.returncode == 0, inspect.stderr  # it runs in that container
    assert SECRET_VALUE not in inspect.stdout and "TOKEN" not in inspect.stdout
    processes = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert SECRET_VALUE not in processes

    def counted() -> bool:  # the container's processes are the rank's: its shell, the command
        ranks = job.metrics().ranks
        return bool(ranks) and any(s.processes >= 2 for s in ranks[0].samples)

    eventually(counted, "a sample counting the container's processes", 60)
    # `orchestrator shell -- CMD` runs in the rank's container, with the job's environment.
    here = Path(__file__).resolve().parent
    code, output = job.exec(f"test -e {here} || echo no host paths; echo token $TOKEN")
    assert (code, output) == (0, "no host paths\ntoken *****\n")
    # One that runs past its time ends, and so does what it started in the container.
    code, _ = job.exec("sleep 3131 & sleep 3132", timeout_s=3)
    assert code == 124

    def left() -> list[str]:
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        return [line for line in ps.splitlines() if line.startswith("sleep 313")]

    eventually(lambda: not left(), "the timed-out command's processes gone", 30)
    # A timeout shorter than podman's start: the command is found once it runs, and ended.
    assert job.exec("sleep 3133", timeout_s=0.05)[0] == 124
    eventually(lambda: not left(), "the command that outran its timeout gone", 30)

    assert job.stop(timeout=60) == JobState.STOPPED
    printed = [line.split("] ", 1)[-1] for line in job.logs()]
    assert "saved on SIGTERM" in printed and "never" not in printed
    assert [m.name for m in job.checkpoints()] == ["checkpoint-9"]
    assert any(f"the commands run in a container of {IMAGE} (sha256:" in line
               for line in job.logs())  # fmt: skip
    gone = subprocess.run(["podman", *podman.global_args(), "container", "exists", name])
    assert gone.returncode == 1  # removed with the job


def registry_auth(registry: Registry, secret: str, method: str = "REGISTRY_SECRET") -> str:
    if method != "REGISTRY_SECRET":
        return (
            f"d.DockerAuth(auth_method={method!r}, registry={registry.address!r}, "
            "aws_oidc_docker_auth=d.AWSOIDCDockerAuth(role_arn='arn:x', region='us-east-1'))"
        )
    return (f"d.DockerAuth(auth_method='REGISTRY_SECRET', registry={registry.address!r}, "
            "registry_secret_docker_auth=d.RegistrySecretDockerAuth("
            f"secret_ref=d.SecretReference(name={secret!r})))")  # fmt: skip


def test_a_private_image_is_pulled_with_its_registry_secret_before_the_commands(
    container_cluster, registry, tmp_path
):
    image = registry.push(IMAGE, "private/busybox:1")
    root = str(tmp_path / "storage")

    wrong = push(image_job(tmp_path / "wrong", ["echo never"], image=image,
                           auth=registry_auth(registry, "registry_wrong")),
                 address=container_cluster, storage_root=root)  # fmt: skip
    assert wrong.wait(timeout=60) == JobState.DEPLOY_FAILED
    cause = wrong.details().failure.cause
    assert f"could not pull image {image} from {registry.address}" in cause, cause
    assert "unauthorized" in cause and "not-the-password" not in cause

    right = push(image_job(tmp_path / "right", ["echo pulled and ran"], image=image,
                           auth=registry_auth(registry, "registry_login")),
                 address=container_cluster, storage_root=root)  # fmt: skip
    assert right.wait(timeout=120) == JobState.COMPLETED, right.logs()
    assert any(line.endswith("] pulled and ran") for line in right.logs())

    missing = f"{registry.address}/private/no-such-image:1"
    nothing = push(image_job(tmp_path / "missing", ["echo never"], image=missing,
                             auth=registry_auth(registry, "registry_login")),
                   address=container_cluster, storage_root=root)  # fmt: skip
    assert nothing.wait(timeout=60) == JobState.DEPLOY_FAILED
    assert f"could not pull image {missing}" in nothing.details().failure.cause

    cloud = push(image_job(tmp_path / "cloud", ["echo never"], image=image,
                           auth=registry_auth(registry, "", method="AWS_OIDC")),
                 address=container_cluster, storage_root=root)  # fmt: skip
    assert cloud.wait(timeout=60) == JobState.DEPLOY_FAILED
    assert "auth_method AWS_OIDC is not supported in containers yet: use REGISTRY_SECRET" in (
        cloud.details().failure.cause
    )
    images.podman_cli("rmi", image)  # what this test pulled


def test_a_gpu_job_on_a_node_that_cannot_give_its_gpu_fails_the_deploy_saying_what_lacks(
    container_cluster, tmp_path
):
    """The node declares a GPU to Ray but has no CDI spec and no /dev/nvidia0 (what a node
    without the driver, or with another vendor's, looks like): the deploy ends, naming both."""
    job = push(image_job(tmp_path / "job", ["echo never"], accelerator="H100:1"),
               address=container_cluster, storage_root=str(tmp_path / "storage"))  # fmt: skip
    assert job.wait(timeout=120) == JobState.DEPLOY_FAILED
    cause = job.details().failure.cause
    assert "no CDI spec of nvidia.com/gpu" in cause and "/dev/nvidia0" in cause, cause
    assert "Traceback" not in cause


def test_a_command_killed_for_memory_says_so_with_the_limit(container_cluster, tmp_path):
    """`sort` holds its whole input: 400 MB in a 256 MiB container."""
    hog = "head -c 400000000 /dev/zero | tr '\\0' a | sort > /dev/null"
    job = push(image_job(tmp_path / "job", ["echo before", hog, "echo never"]),
               address=container_cluster, storage_root=str(tmp_path / "storage"))  # fmt: skip
    assert job.wait(timeout=120) == JobState.FAILED
    failure = job.details().failure
    assert failure.exit_code == 137 and failure.command == hog
    assert "command exited with code 137, out of memory: limit 256.0 MiB" in failure.cause
    # podman's conmon notes the kill in a file `oom` in its working directory: not the agent's
    # (the nodes here were started from this process's directory).
    assert not (Path.cwd() / "oom").exists()


UNTIL_RETRIED = (
    'echo attempt $BT_RETRY_COUNT; [ "$BT_RETRY_COUNT" = 1 ] && exit 0; echo ready; '
    "while :; do sleep 0.1; done"
)


def test_a_killed_agent_takes_its_container_along_and_the_retry_runs_in_a_new_one(
    container_cluster, tmp_path
):
    job = push(image_job(tmp_path / "job", [UNTIL_RETRIED]), address=container_cluster,
               storage_root=str(tmp_path / "storage"), retries=1)  # fmt: skip
    eventually(lambda: any(line.endswith("] ready") for line in job.logs()), "ready", 120)
    name = actor_names.node_agent(job.id, 0)
    podman_cli = ["podman", *podman.global_args()]
    first = subprocess.run([*podman_cli, "inspect", "--format", "{{.Id}}", name],
                           capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    agent = next(
        a for a in list_actors(address=container_cluster, filters=[("state", "=", "ALIVE")])
        if a.name == name
    )  # fmt: skip
    os.kill(agent.pid, signal.SIGKILL)
    # Gone before the retry (10 s later) could replace it: the guard removed it.
    eventually(lambda: subprocess.run([*podman_cli, "container", "exists", first]).returncode == 1,
               "the dead agent's container to be removed", 8)  # fmt: skip
    assert job.wait(timeout=120) == JobState.COMPLETED, job.logs()
    assert [a.cause for a in job.details().attempts][:1] == ["agent_lost"]
    assert any(line.endswith("] attempt 1") for line in job.logs())


MNIST = Path(__file__).resolve().parents[1] / "recipes" / "mnist-pytorch"


@pytest.fixture(scope="module")
def python_image(container_cluster) -> str:
    """Python, torch and scikit-learn, no Ray (built here once per machine: about 40 s)."""
    return images.python_image()


def _final_accuracy(lines: list[str]) -> str:
    finals = [line.split("final test accuracy: ")[1] for line in lines
              if "final test accuracy: " in line]  # fmt: skip
    assert len(finals) == 1, lines[-20:]
    return finals[0].strip()


def test_the_mnist_recipe_completes_in_its_image_with_the_host_runs_accuracy(
    container_cluster, python_image, tmp_path
):
    recipe = tmp_path / "mnist-pytorch"
    shutil.copytree(MNIST, recipe)
    config = recipe / "config.py"
    pytorch = "pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime"
    assert pytorch in config.read_text()  # the recipe's own image, which needs the internet
    config.write_text(config.read_text().replace(pytorch, python_image))

    job = push(config, address=container_cluster, storage_root=str(tmp_path / "storage"))
    assert job.wait(timeout=300) == JobState.COMPLETED, job.logs()[-30:]
    in_container = _final_accuracy(job.logs())
    # Its 4 checkpoints (every 5 epochs of 20) were written inside and uploaded whole.
    assert [m.name for m in job.checkpoints()] == [f"checkpoint-{n}" for n in (5, 10, 15, 20)]

    host = subprocess.run(
        [str(MNIST / "run.sh")], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "2"},
    )  # fmt: skip
    assert host.returncode == 0, host.stderr
    assert in_container == _final_accuracy(host.stdout.splitlines())

    # `view` says where it ran: the image, and its id as the node had it.
    digest = images.podman_cli("image", "inspect", "--format", "{{.Digest}}", python_image).stdout
    shown = subprocess.run(
        [sys.executable, "-m", "orchestrator", "view", "--job-id", job.id, "--storage-root",
         str(tmp_path / "storage")], capture_output=True, text=True, env={**os.environ,
         "COLUMNS": "300"},
    ).stdout  # fmt: skip
    assert f"container of {python_image} ({digest.strip()})" in shown, shown
    assert f"the commands run in a container of {python_image} ({digest.strip()})" in "\n".join(
        job.logs()
    )


def _wheel(directory: Path) -> str:
    """A one-module wheel: what `pip install` gets, offline."""
    import base64
    import hashlib
    import zipfile

    files = {
        "tiny.py": "WHO = 'installed by the first job'\n",
        "tiny-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: tiny\nVersion: 1.0\n",
        "tiny-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\n"
        "Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{name},sha256={digest.decode()},{len(text.encode())}")
    files["tiny-1.0.dist-info/RECORD"] = "\n".join([*record, "tiny-1.0.dist-info/RECORD,,"])
    name = "tiny-1.0-py3-none-any.whl"
    directory.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(directory / name, "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)
    return name


def test_a_pip_install_in_one_job_leaves_the_next_jobs_environment_unchanged(
    container_cluster, python_image, tmp_path
):
    wheel = _wheel(tmp_path / "first")
    root = str(tmp_path / "storage")
    first = push(image_job(tmp_path / "first", [
        f"python -m pip install -q --no-index --no-cache-dir --disable-pip-version-check ./{wheel}",
        "python -c 'import tiny; print(tiny.WHO)'",
    ], image=python_image), address=container_cluster, storage_root=root)  # fmt: skip
    assert first.wait(timeout=120) == JobState.COMPLETED, first.logs()
    assert any(line.endswith("] installed by the first job") for line in first.logs())

    probe = "import importlib.util as u; print('tiny is', u.find_spec('tiny') and 'here' or 'gone')"
    second = push(image_job(tmp_path / "second", [f'python -c "{probe}"'], image=python_image),
                  address=container_cluster, storage_root=root)  # fmt: skip
    assert second.wait(timeout=120) == JobState.COMPLETED, second.logs()
    assert any(line.endswith("] tiny is gone") for line in second.logs()), second.logs()
    # The host's own environment never had it either.
    assert subprocess.run([sys.executable, "-c", "import tiny"], capture_output=True,
                          cwd=tmp_path).returncode == 1  # fmt: skip


def test_jobs_and_ranks_asking_for_one_new_image_at_once_pull_it_once(
    container_cluster, registry, tmp_path
):
    """A job of two ranks (their prepares start together, on one machine here) and a second
    job pushed at the same time; an image with a 60 MB layer, so the pull takes a while."""
    context = tmp_path / "context"
    context.mkdir()
    (context / "Containerfile").write_text(
        f"FROM {IMAGE}\nRUN head -c 60000000 /dev/urandom > /layer\n"
    )
    built = images.podman_cli("build", "--ulimit", "nofile=1024:1024", "-t",
                              "localhost/orchestrator-tests/layered:1", str(context))  # fmt: skip
    assert built.returncode == 0, built.stderr
    image = registry.push("localhost/orchestrator-tests/layered:1", "shared/layered:1")
    images.podman_cli("rmi", "localhost/orchestrator-tests/layered:1")  # its layers too
    auth = registry_auth(registry, "registry_login")
    root = str(tmp_path / "storage")
    configs = [image_job(tmp_path / f"job-{n}", ["echo ran"], image=image, auth=auth, nodes=n)
               for n in (2, 1)]  # fmt: skip
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            jobs = list(pool.map(lambda c: push(c, address=container_cluster, storage_root=root),
                                 configs))  # fmt: skip
        for job in jobs:
            assert job.wait(timeout=120) == JobState.COMPLETED, job.logs()
        served = re.findall(r'"GET /v2/shared/layered/blobs/(sha256:\w+) HTTP/1.1" 200',
                            registry.log_text())  # fmt: skip
        # The new layer and the config, each once (the base layer was here already).
        assert len(served) == len(set(served)) == 2, served
        # (job, "rank N", what it said) for each controller line about the image
        said = [(job.id, *line.split("] ", 1)[-1].split(": ", 1)) for job in jobs
                for line in job.logs() if f": image {image}: " in line]  # fmt: skip
        pullers = {(j, rank) for j, rank, s in said if s.endswith(": pulling it onto this node")}
        assert len(pullers) == 1 and sum(": pulled in " in s for *_, s in said) == 1, said
        # Every other rank found it there: after waiting for that pull, or coming after it (the
        # node's puller and the agents' workers start at their own pace). The rank whose
        # puller pulled finds it too, unless its agent came first and pulled itself.
        found = {(j, rank) for j, rank, s in said if s.endswith(": on this node already")}
        ranks = {(jobs[0].id, "rank 0"), (jobs[0].id, "rank 1"), (jobs[1].id, "rank 0")}
        assert ranks - pullers <= found, said
        assert sum(": Copying blob " in s for *_, s in said) == 2  # podman's progress lines
        # The node's puller took part (it or an agent pulled; see the puller's own test).
        alive = list_actors(address=container_cluster, filters=[("state", "=", "ALIVE")])
        assert any(a.name.startswith("orchestrator-image-puller-") for a in alive)
    finally:
        images.podman_cli("rmi", image)


def test_a_job_waiting_in_the_queue_finds_its_image_pulled_when_it_starts(
    container_cluster, registry, tmp_path
):
    """The one node with 2 CPUs is busy; a job of 2 CPUs with a private image waits in the
    queue, and that node pulls its image meanwhile: once admitted, the job finds it there."""
    image = registry.push(IMAGE, f"shared/waiting-{tmp_path.name[-12:]}:1")
    assert not podman.exists(image)
    root = str(tmp_path / "storage")
    blocker = push(image_job(tmp_path / "blocker", [
        "echo blocking; while [ ! -e /tmp/go ]; do sleep 0.1; done"], cpus=2),
        address=container_cluster, storage_root=root)  # fmt: skip
    try:
        eventually(lambda: any(line.endswith("] blocking") for line in blocker.logs()),
                   "the blocker running", 120)  # fmt: skip
        auth = registry_auth(registry, "registry_login")
        waiter = push(image_job(tmp_path / "waiter", ["echo ran"], image=image, auth=auth,
                                cpus=2), address=container_cluster, storage_root=root)  # fmt: skip
        eventually(lambda: podman.exists(image), "the waiting job's image on the node", 60)
        assert waiter.status() == JobState.PENDING  # pulled while it waited

        assert blocker.exec("touch /tmp/go")[0] == 0
        assert blocker.wait(timeout=120) == JobState.COMPLETED
        assert waiter.wait(timeout=120) == JobState.COMPLETED, waiter.logs()
        said = [line for line in waiter.logs() if f": image {image}: " in line]  # the ranks'
        assert said and all(line.endswith(": on this node already") for line in said), said
    finally:
        blocker.stop(timeout=60)
        images.podman_cli("rmi", image)


def test_the_node_removes_images_it_pulled_least_recently_used_first_never_one_in_use(
    registry, tmp_path, monkeypatch
):
    """The node's image cache alone (no Ray): a budget of two images, four pulled in turn."""
    monkeypatch.setenv("CONTAINERS_REGISTRIES_CONF", str(registry.registries_conf))
    names = [registry.push(IMAGE, f"evict/{n}:1") for n in "abcd"]
    a, b, c, d = names
    size = images.podman_cli("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout
    dead: set[str] = set()
    cache = ImageCache(tmp_path / "images", budget_bytes=int(size) * 2 + 1000,
                       alive=lambda holder: holder not in dead)  # fmt: skip
    login = (registry.address, f"{REGISTRY_USER}:{REGISTRY_PASSWORD}")
    said: list[str] = []
    try:
        assert cache.ensure(a, "agent-a", login, said.append) == []
        cache.release("agent-a")  # its job ended
        assert cache.ensure(b, "agent-b", login, said.append) == []  # held: its job runs
        assert cache.ensure(c, "agent-c", login, said.append) == [a]  # the one no job holds
        assert not podman.exists(a) and podman.exists(b) and podman.exists(c)
        # An image put here by other means is used, and never removed.
        assert cache.ensure(IMAGE, "agent-own", None, said.append) == []
        assert f"image {IMAGE}: on this node already" in said
        # b's agent died without letting go: its hold lapses. c is held, d is being pulled.
        dead.add("agent-b")
        assert cache.ensure(d, "agent-d", login, said.append) == [b]
        assert [podman.exists(n) for n in names] == [False, False, True, True]
        assert podman.exists(IMAGE)
        assert any(s.startswith("images removed from this node for room") and b in s
                   for s in said)  # fmt: skip
    finally:
        for name in names:
            images.podman_cli("rmi", name)


def _running_in(job, pid: str) -> bool:
    _, output = job.exec(f"kill -0 {pid} 2>/dev/null && echo alive || echo gone")
    return output.strip() == "alive"


def test_a_terminal_opens_in_the_ranks_container_and_ends_with_what_it_started(
    container_cluster, tmp_path
):
    root = str(tmp_path / "storage")
    job = push(image_job(tmp_path / "job", ["echo ready; while :; do sleep 0.1; done"]),
               address=container_cluster, storage_root=root)  # fmt: skip
    eventually(lambda: any(line.endswith("] ready") for line in job.logs()), "ready", 120)
    here = Path(__file__).resolve().parent
    try:
        terminal = attach(job, root)
        terminal.sendline(f"tty; stty size; echo token=$TOKEN; test -e {here} || echo no-host; pwd")
        terminal.expect(r"/dev/pts/\d+")
        terminal.expect_exact("33 101")
        terminal.expect_exact("token=*****")  # the job's environment, masked on the way out
        terminal.expect_exact("no-host")  # the container's filesystem, not the node's
        terminal.expect_exact(job.details().nodes[0].working_dir)
        terminal.expect_exact("orch> ")
        terminal.sendline("echo started-$((2+3)); sleep 300; echo not-interrupted")
        terminal.expect_exact("started-5")
        terminal.sendcontrol("c")  # Ctrl-C reaches the program in the container
        terminal.expect_exact("orch> ", timeout=30)
        terminal.sendline("echo rc=$?")
        terminal.expect_exact("rc=130")
        terminal.sendline("sleep 1000 & echo bg=$!")
        terminal.expect(r"bg=(\d+)")
        background = terminal.match.group(1).decode()
        assert _running_in(job, background)
        terminal.sendline("exit 7")
        terminal.expect(pexpect.EOF)
        terminal.close()
        assert terminal.exitstatus == 7
        eventually(lambda: not _running_in(job, background), "its background job to end", 30)
        assert SECRET_VALUE not in terminal.logfile_read.getvalue().decode(errors="replace")

        # A client that vanishes loses its shell, and what the shell started, in the container.
        lost = attach(job, root, ORCHESTRATOR_TERMINAL_LOST_S="3")
        lost.sendline("sleep 1001 & echo pids=$!,$$")
        lost.expect(r"pids=(\d+),(\d+)")
        pids = [p.decode() for p in lost.match.groups()]
        lost.kill(signal.SIGKILL)
        lost.close()
        eventually(lambda: not any(_running_in(job, p) for p in pids), "the shell to end", 30)
        assert job.status() == JobState.RUNNING  # the job runs on
    finally:
        assert job.stop(timeout=60) == JobState.STOPPED


def test_a_held_jobs_shell_runs_in_a_new_container_of_its_image_with_the_ranks_files(
    container_cluster, tmp_path
):
    """The commands' container is gone with them; the shell of a job whose nodes are held for
    an interactive session gets one like it: the image, the rank's binds, the environment."""
    root = str(tmp_path / "storage")
    commands = ["echo changed > /etc/changed; echo left > $BT_CHECKPOINT_DIR/note.txt; exit 7"]
    job = push(image_job(tmp_path / "job", commands, checkpoints=True,
                         session='d.InteractiveSession(trigger="on_failure", timeout_minutes=5)'),
               address=container_cluster, storage_root=root)  # fmt: skip
    deadline = time.monotonic() + 120
    while job.details().held_until is None:
        assert time.monotonic() < deadline and not job.status().is_terminal, job.logs()[-10:]
        time.sleep(0.2)
    name = actor_names.node_agent(job.id, 0)
    assert not podman.exists(name, "container")  # the commands' container ended with them
    here = Path(__file__).resolve().parent
    probe = f"test -e /etc/changed || echo fresh; test -e {here} || echo no-host; echo token $TOKEN"
    code, output = job.exec(f"cat $BT_CHECKPOINT_DIR/note.txt; {probe}")
    assert (code, output) == (0, "left\nfresh\nno-host\ntoken *****\n")
    terminal = attach(job, root)
    terminal.sendline("cat $BT_CHECKPOINT_DIR/note.txt; exit 3")
    terminal.expect_exact("left")
    terminal.expect(pexpect.EOF)
    terminal.close()
    assert terminal.exitstatus == 3
    assert job.stop(timeout=60) == JobState.FAILED  # the hold ends; the failure stays
    assert job.details().failure.exit_code == 7
    left = images.podman_cli("ps", "-a", "--format", "{{.Names}}").stdout.split()
    assert not [n for n in left if n.startswith(name)], left  # none of its shells' containers


def test_an_image_found_on_the_node_is_held_before_another_job_can_remove_it(
    registry, tmp_path, monkeypatch
):
    """Job A finds its image here; another job's pull, with no room, runs its eviction right
    then (the moment is forced: A's existence check runs it). A's image stays."""
    monkeypatch.setenv("CONTAINERS_REGISTRIES_CONF", str(registry.registries_conf))
    a, b = (registry.push(IMAGE, f"race/{n}:1") for n in "ab")
    size = images.podman_cli("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout
    login = (registry.address, f"{REGISTRY_USER}:{REGISTRY_PASSWORD}")
    cache = ImageCache(tmp_path / "images", budget_bytes=int(size) + 1000)
    try:
        cache.ensure(a, "agent-a", login)
        cache.release("agent-a")  # a is here, held by no job: the first to go for room
        checked = podman.exists

        def other_job_pulls_then(name: str, kind: str = "image") -> bool:
            found = checked(name, kind)
            if name == a:
                monkeypatch.setattr(podman, "exists", checked)
                assert cache.ensure(b, "agent-b", login) == []  # a is held: nothing to remove
            return found

        monkeypatch.setattr(podman, "exists", other_job_pulls_then)
        said: list[str] = []
        cache.ensure(a, "agent-a2", login, said.append)
        assert f"image {a}: on this node already" in said
        assert podman.exists(a) and podman.exists(b)
    finally:
        for name in (a, b):
            images.podman_cli("rmi", name)


def test_a_nodes_puller_pulls_once_says_how_and_leaves_a_refusal_to_the_agent(
    registry, tmp_path, monkeypatch
):
    """The node's ImagePuller alone (its actor runs this class): a new image pulled with the
    registry secret, podman's lines said; asked again, nothing and no podman call (it remembers
    the image's layer); removed by other means, pulled again; with a refused password it says
    nothing and pulls nothing (the agent's own prepare reports it)."""
    monkeypatch.setenv("CONTAINERS_REGISTRIES_CONF", str(registry.registries_conf))
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(_secret_env("puller_login"), f"{REGISTRY_USER}:{REGISTRY_PASSWORD}")
    monkeypatch.setenv(_secret_env("puller_wrong"), f"{REGISTRY_USER}:not-the-password")
    context = tmp_path / "context"
    context.mkdir()
    (context / "Containerfile").write_text(  # a layer of its own: removing it removes its files
        f"FROM {IMAGE}\nRUN head -c 100000 /dev/urandom > /layer\n"
    )
    built = images.podman_cli("build", "--ulimit", "nofile=1024:1024", "-t",
                              "localhost/orchestrator-tests/puller:1", str(context))  # fmt: skip
    assert built.returncode == 0, built.stderr
    image = registry.push("localhost/orchestrator-tests/puller:1", "puller/layered:1")
    images.podman_cli("rmi", "localhost/orchestrator-tests/puller:1")
    puller = ImagePuller()
    login = (image, "agent-a", registry.address, "puller_login")
    try:
        said = list(puller.pull(*login))
        assert f"image {image}: pulling it onto this node" in said, said
        assert any(": Copying blob " in line for line in said)
        assert any(line.startswith(f"image {image}: pulled in ") for line in said)
        assert podman.exists(image)

        asked: list[str] = []
        exists = podman.exists
        monkeypatch.setattr(podman, "exists", lambda name, kind="image": asked.append(name))
        assert list(puller.pull(*login)) == [] and asked == []
        monkeypatch.setattr(podman, "exists", exists)

        assert images.podman_cli("rmi", image).returncode == 0  # removed by other means
        said = list(puller.pull(*login))
        assert f"image {image}: pulling it onto this node" in said and podman.exists(image)

        assert images.podman_cli("rmi", image).returncode == 0
        refused = (image, "agent-b", registry.address, "puller_wrong")
        assert [line for line in puller.pull(*refused) if "rror" in line] == []
        assert not podman.exists(image)
    finally:
        images.podman_cli("rmi", image)


ATTACK = Path(__file__).with_name("attack_job.py")
BLUE_SECRET, BLUE_VALUE = "blue_key", "blue-k3y-70c2e9a4"
# Blue's job: its files in each of its directories, then it waits for the word to end, and ends
# saying whether they are as it left them.
BLUE_COMMAND = (
    "for d in $PWD $BT_CHECKPOINT_DIR/checkpoint-1 $BT_PROJECT_CACHE_DIR $BT_TEAM_CACHE_DIR; "
    "do mkdir -p $d && echo blue > $d/mine; done; echo ready; "
    "while [ ! -e /tmp/go ]; do sleep 0.1; done; "
    "for d in $PWD $BT_CHECKPOINT_DIR $BT_LOAD_CHECKPOINT_DIR $BT_PROJECT_CACHE_DIR "
    "$BT_TEAM_CACHE_DIR; do ls -aR $d; done | grep attack || echo no stranger files; "
    "echo files $(cat $PWD/mine $BT_CHECKPOINT_DIR/checkpoint-1/mine $BT_PROJECT_CACHE_DIR/mine "
    "$BT_TEAM_CACHE_DIR/mine $BT_LOAD_CHECKPOINT_DIR/*/checkpoint-1/w)"
)


def _team_job(directory: Path, team: str, project: str, image: str, commands: list[str],
              runtime: str = "", memory: str = "256Mi", files: dict[str, str] | None = None,
              ) -> Path:  # fmt: skip
    return make_job(
        directory,
        f"""
        from truss_train import definitions as d
        project = d.TrainingProject(
            name={project!r},
            team_name={team!r},
            job=d.TrainingJob(
                image=d.Image(base_image={image!r}),
                compute=d.Compute(cpu_count=1, memory={memory!r}),
                runtime=d.Runtime(start_commands={commands!r}, {runtime}),
            ),
        )
        """,
        files,
    )


def _descendants(pid: int) -> list[int]:
    """`pid` and every process under it."""
    return [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]


def _attacks(lines: list[str]) -> dict[str, tuple[bool, str]]:
    results = {}
    for line in lines:
        if "ATTACK " in line and ": " in line:
            name, verdict = line.split("ATTACK ", 1)[1].split(": ", 1)
            results[name] = (verdict.startswith("SUCCEEDED"), verdict)
    return results


def test_another_teams_job_reaches_nothing_of_a_running_job_which_completes_untouched(
    container_cluster, python_image, tmp_path
):
    """Team red's start command tries, against team blue's running job, all a hostile job
    could (tests/attack_job.py), knowing all but the cluster's token: 0 attempts succeed, and
    blue's job completes as if red had never run. The same attacks from the host, where Ray's
    processes live, succeed: the test can tell."""
    from orchestrator.node.node_root import node_root
    from orchestrator.storage.secret_store import FileSecretStore, default_secrets_dir

    root = str(tmp_path / "storage")
    store = FileSecretStore()
    store.set(BLUE_SECRET, BLUE_VALUE, team="blue")
    try:
        seed = push(_team_job(tmp_path / "seed", "blue", "blue-seed", IMAGE, [
            "mkdir -p $BT_CHECKPOINT_DIR/checkpoint-1 && echo seeded > "
            "$BT_CHECKPOINT_DIR/checkpoint-1/w"], "checkpointing_config=d.CheckpointingConfig("
            "enabled=True)"), address=container_cluster, storage_root=root)  # fmt: skip
        assert seed.wait(timeout=120) == JobState.COMPLETED, seed.logs()
        blue = push(_team_job(tmp_path / "blue", "blue", "blue-model", IMAGE, [BLUE_COMMAND], (
            "checkpointing_config=d.CheckpointingConfig(enabled=True), "
            "cache_config=d.CacheConfig(enabled=True), "
            f"environment_variables={{'KEY': d.SecretReference(name={BLUE_SECRET!r})}}, "
            "load_checkpoint_config=d.LoadCheckpointConfig(enabled=True, checkpoints=["
            "d.BasetenCheckpoint.from_latest_checkpoint(project_name='blue-seed')])"
        )), address=container_cluster, storage_root=root)  # fmt: skip
        eventually(lambda: any(line.endswith("] ready") for line in blue.logs()), "ready", 120)

        # All red could learn of blue's job but the token: where everything is, on the node and
        # the head, and the pids of blue's processes.
        name = actor_names.node_agent(blue.id, 0)
        inspect = images.podman_cli("inspect", name)
        assert inspect.returncode == 0, inspect.stderr
        assert BLUE_VALUE not in inspect.stdout and token_file().read_text() not in inspect.stdout
        facts = json.loads(inspect.stdout)[0]
        binds = {f"b:{m['Destination']}": m["Source"] for m in facts["Mounts"]}
        assert len(binds) == 3, binds  # the rank's directory (code, checkpoints), two caches
        targets = {
            "job": blue.id, "team": "blue", "secret": BLUE_SECRET, "gcs": CLUSTER["gcs"],
            "client": CLUSTER["client"], "dashboard": container_cluster,
            "token_files": [str(token_file())], "pids": _descendants(facts["State"]["Pid"]),
            "paths": {**binds, "ray session dir": CLUSTER["session"],
                      "secret store": str(default_secrets_dir()),
                      "shared:node root": str(node_root()), "shared:storage root": root,
                      "shared:orchestrator home": os.environ["ORCHESTRATOR_HOME"]},
        }  # fmt: skip
        red = push(_team_job(tmp_path / "red", "red", "red-probe", python_image,
                             ["python3 attack_job.py targets.json"], memory="2Gi",
                             files={"attack_job.py": ATTACK.read_text(),
                                    "targets.json": json.dumps(targets)}),
                   address=container_cluster, storage_root=root)  # fmt: skip
        assert red.wait(timeout=300) == JobState.COMPLETED, red.logs()[-30:]
        lines = red.logs()
        assert any(line.endswith("] ATTACKS DONE") for line in lines), lines[-30:]
        attacks = _attacks(lines)
        expected = {"token", "ray-gcs", "ray-client", "ray-gcs-guessed-token", "grpc", "job-api",
                    "job-api-stop", "metrics", "proc", "signal", "podman",
                    *(f"files {label}" for label in targets["paths"])}  # fmt: skip
        assert set(attacks) == expected, sorted(attacks)
        # Only the node's metrics: Prometheus's text, unauthenticated as Prometheus scrapes it
        # (docs/secrets.md), where blue's job id labels the numbers of its ranks.
        assert {n for n, (won, _) in attacks.items() if won} <= {"metrics"}, "\n".join(lines)
        assert "for want of a token" in attacks["grpc"][1]  # the scan found Ray's services
        text = "\n".join(lines)
        for value in (BLUE_VALUE, token_file().read_text()):
            assert value not in text
            assert hashlib.sha256(value.encode()).hexdigest()[:12] not in text

        # The control: the same attacks from the host, as a process of the node (with Ray's
        # token in its environment, as Ray's workers have it) succeed.
        (tmp_path / "host.json").write_text(json.dumps({**targets, "harmless": True}))
        host = subprocess.run([sys.executable, str(ATTACK), str(tmp_path / "host.json")],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        from_host = _attacks(host.stdout.splitlines())
        won = {n for n, (w, _) in from_host.items() if w}
        assert won >= expected - {"ray-gcs-guessed-token", "job-api-stop", "metrics"} - {
            f"files {label}" for label in targets["paths"] if label.startswith("shared:")
            and label != "shared:node root"}, host.stdout + host.stderr[-2000:]  # fmt: skip
        assert not from_host["ray-gcs-guessed-token"][0]  # Ray checks the token, not its presence
        fingerprint = hashlib.sha256(BLUE_VALUE.encode()).hexdigest()[:12]
        assert f"{BLUE_SECRET}: {fingerprint}" in from_host["ray-gcs"][1]

        # Blue, told to end, finds its files as it left them and completes.
        assert blue.exec("touch /tmp/go")[0] == 0
        assert blue.wait(timeout=120) == JobState.COMPLETED, blue.logs()[-20:]
        printed = [line.split("] ", 1)[-1] for line in blue.logs()]
        assert "no stranger files" in printed, printed
        assert "files blue blue blue blue seeded" in printed, printed
        assert [m.name for m in blue.checkpoints()] == ["checkpoint-1"]
    finally:
        store.delete(BLUE_SECRET, team="blue")

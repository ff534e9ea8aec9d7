"""Jobs whose commands run in a container of their image (ORCHESTRATOR_JOB_RUNTIME=container):
real podman, and an image built here offline from Debian's static busybox (no Python, no Ray in
it: our agents stay on the host). On a cluster of its own, whose head and node have the setting
and a secret, as `ray start` would give them.

Needs podman, runc and /bin/busybox (tests/install-system.sh installs them);
ORCHESTRATOR_SKIP_CONTAINER_TESTS=1 skips these tests instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import eventually, make_job, simulated_cluster

from orchestrator import actor_names
from orchestrator.client.api import push
from orchestrator.lifecycle import JobState
from orchestrator.node import podman

pytestmark = pytest.mark.cluster  # starts a Ray cluster of its own

IMAGE = "localhost/orchestrator-tests/busybox:1"
SECRET_NAME, SECRET_VALUE = "container_token", "ctr-s3cr3t-91f4"


def build_image(directory: Path) -> None:
    """A rootfs of busybox and its applets, imported as an image: a shell and nothing else."""
    rootfs = directory / "rootfs"
    (rootfs / "bin").mkdir(parents=True)
    for folder in ("etc", "tmp", "mnt"):
        (rootfs / folder).mkdir()
    shutil.copy("/bin/busybox", rootfs / "bin" / "busybox")
    applets = subprocess.run(["/bin/busybox", "--list"], capture_output=True, text=True).stdout
    for applet in applets.split():
        if applet != "busybox":
            (rootfs / "bin" / applet).symlink_to("busybox")
    with tarfile.open(directory / "rootfs.tar", "w") as tar:
        tar.add(rootfs, arcname=".")
    imported = subprocess.run(
        ["podman", *podman.global_args(), "import", str(directory / "rootfs.tar"), IMAGE],
        capture_output=True, text=True,
    )  # fmt: skip
    assert imported.returncode == 0, imported.stderr


@pytest.fixture(scope="module")
def container_cluster(orchestrator_home, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if os.environ.get("ORCHESTRATOR_SKIP_CONTAINER_TESTS") == "1":
        pytest.skip("ORCHESTRATOR_SKIP_CONTAINER_TESTS=1: jobs in containers are not tested")
    missing = [t for t in ("podman", "runc") if shutil.which(t) is None]
    if missing or not Path("/bin/busybox").exists():
        pytest.fail(f"{missing or '/bin/busybox'} missing: run tests/install-system.sh (or set "
                    "ORCHESTRATOR_SKIP_CONTAINER_TESTS=1 to skip these tests)")  # fmt: skip
    build_image(tmp_path_factory.mktemp("image"))
    saved = {k: os.environ.get(k) for k in ("ORCHESTRATOR_JOB_RUNTIME", _secret_env())}
    os.environ["ORCHESTRATOR_JOB_RUNTIME"] = "container"
    os.environ[_secret_env()] = SECRET_VALUE
    cluster, address = simulated_cluster()
    try:
        cluster.add_node(num_cpus=2)
        cluster.add_node(num_cpus=1, num_gpus=1, resources={"accelerator_type:H100": 1})
        cluster.wait_for_nodes()
        yield address
    finally:
        cluster.shutdown()
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.update({key: value})


def _secret_env() -> str:
    return f"ORCHESTRATOR_SECRET_{SECRET_NAME.upper()}"


def image_job(
    directory: Path, commands: list[str], checkpoints: bool = False, accelerator: str | None = None
) -> Path:
    return make_job(
        directory,
        f"""
        from truss_train import definitions as d
        project = d.TrainingProject(
            name="in-a-container",
            job=d.TrainingJob(
                image=d.Image(base_image={IMAGE!r}),
                compute=d.Compute(cpu_count=1, memory="256Mi", accelerator={accelerator!r}),
                runtime=d.Runtime(
                    start_commands={commands!r},
                    environment_variables={{"TOKEN": d.SecretReference(name={SECRET_NAME!r})}},
                    checkpointing_config=d.CheckpointingConfig(enabled={checkpoints}),
                ),
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
        "echo rank $BT_NODE_RANK of $BT_GROUP_SIZE token $TOKEN; "
        "mkdir -p $BT_CHECKPOINT_DIR/checkpoint-1 && echo one > $BT_CHECKPOINT_DIR/checkpoint-1/w; "
        "mkdir $BT_CHECKPOINT_DIR/.tmp-2 && echo two > $BT_CHECKPOINT_DIR/.tmp-2/w && "
        "mv $BT_CHECKPOINT_DIR/.tmp-2 $BT_CHECKPOINT_DIR/checkpoint-2",
    ]
    root = str(tmp_path / "storage")
    job = push(image_job(tmp_path / "a", commands, checkpoints=True), address=container_cluster,
               storage_root=root)  # fmt: skip
    assert job.wait(timeout=120) == JobState.COMPLETED, job.logs()
    printed = [line.split("] ", 1)[-1] for line in job.logs()]
    assert "installed" in printed  # the second command sees what the first did to the image
    assert "no host paths" in printed
    assert "rank 0 of 1 token *****" in printed  # the secret reached it, masked in the logs
    stored = {(m.name, m.size_bytes) for m in job.checkpoints()}
    assert stored == {("checkpoint-1", 4), ("checkpoint-2", 4)}  # in place and renamed in

    # The next job in the same image starts from the image, not from what the last one did.
    again = push(image_job(tmp_path / "b", ["test -e /etc/installed-by-job || echo clean"]),
                 address=container_cluster, storage_root=root)  # fmt: skip
    assert again.wait(timeout=120) == JobState.COMPLETED, again.logs()
    assert any(line.endswith("] clean") for line in again.logs())


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

    assert job.stop(timeout=60) == JobState.STOPPED
    printed = [line.split("] ", 1)[-1] for line in job.logs()]
    assert "saved on SIGTERM" in printed and "never" not in printed
    assert [m.name for m in job.checkpoints()] == ["checkpoint-9"]
    assert any(f"the commands run in a container of {IMAGE} (sha256:" in line
               for line in job.logs())  # fmt: skip
    gone = subprocess.run(["podman", *podman.global_args(), "container", "exists", name])
    assert gone.returncode == 1  # removed with the job


def test_an_image_the_node_cannot_get_fails_the_job_naming_it(container_cluster, tmp_path):
    missing = "localhost:1/orchestrator-tests/no-such-image:1"
    config = image_job(tmp_path / "job", ["echo never"])
    config.write_text(config.read_text().replace(IMAGE, missing))
    job = push(config, address=container_cluster, storage_root=str(tmp_path / "storage"))
    assert job.wait(timeout=120) == JobState.FAILED
    failure = job.details().failure
    assert failure is not None and missing in failure.cause + " ".join(failure.last_lines)
    assert not any(line.endswith("] never") for line in job.logs())


def test_a_gpu_job_is_refused_in_a_container_saying_so(container_cluster, tmp_path):
    job = push(image_job(tmp_path / "job", ["echo never"], accelerator="H100:1"),
               address=container_cluster, storage_root=str(tmp_path / "storage"))  # fmt: skip
    assert job.wait(timeout=120) == JobState.DEPLOY_FAILED
    assert "GPUs in a job's container are not supported yet" in job.details().failure.cause


def test_a_command_killed_for_memory_says_so_with_the_limit(container_cluster, tmp_path):
    """`sort` holds its whole input: 400 MB in a 256 MiB container."""
    hog = "head -c 400000000 /dev/zero | tr '\\0' a | sort > /dev/null"
    job = push(image_job(tmp_path / "job", ["echo before", hog, "echo never"]),
               address=container_cluster, storage_root=str(tmp_path / "storage"))  # fmt: skip
    assert job.wait(timeout=120) == JobState.FAILED
    failure = job.details().failure
    assert failure.exit_code == 137 and failure.command == hog
    assert "command exited with code 137, out of memory: limit 256.0 MiB" in failure.cause

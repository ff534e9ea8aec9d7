"""docs/architecture.md's "Not built yet", tried on the code: every row's config is refused,
recorded only or of no effect as the row says, each of check_support's refusals and notices
(`UNBUILT` in client/support.py) has its row, and no row claims one check_support lacks.
No Ray: the client's checks, the stored record and the job's runtime (agents/runtimes.py) as
the controller gets it."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from orchestrator.agents import ray_train_seams
from orchestrator.agents.messages import ImageRequest
from orchestrator.agents.runtimes import JobRuntime, push_notices, runtime_for
from orchestrator.client.prepare import prepare_job
from orchestrator.client.submit import store_job
from orchestrator.client.support import UNBUILT, Unbuilt, check_support
from orchestrator.controller.environment import job_environment
from orchestrator.errors import UnsupportedFeatureError
from orchestrator.spec.training import TrainingJob, TrainingProject
from orchestrator.spec.weights import WeightsAuthMethod
from orchestrator.storage.records import JobRecord, NodeInfo
from orchestrator.storage.root import StorageRoot

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "orchestrator"
# Where a job's config is acted on once it is pushed: a field none of these reads is recorded only.
RUNTIME = ("agents", "cluster", "controller", "node", "scheduler", "serving", "storage")
KINDS = ("refused", "recorded only", "no effect")


def rows() -> dict[str, tuple[str, list[str], str]]:
    """The table's rows by the config each names first: what is done (the bold words), the
    first cell's other code spans, and the row's last cell (where it is done)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text[text.index("\n## Not built yet\n") :]
    found = {}
    for line in section.splitlines()[1:]:
        if not line.startswith("| `"):
            continue
        config, does, where = (c.strip() for c in line.strip().strip("|").split(" | "))
        spans = re.findall(r"`([^`]+)`", config)
        kind = re.match(r"\*\*([^*]+)\*\*", does)
        assert kind is not None and kind.group(1) in KINDS, f"{spans[0]}: says none of {KINDS}"
        found[spans[0]] = (kind.group(1), spans[1:], where)
    assert found, "docs/architecture.md's Not built yet has no table"
    return found


def runtime_readers(field: str) -> list[str]:
    """The modules past the client that read `field` (an attribute or a key of that name)."""
    readers = []
    for package in RUNTIME:
        for path in (PACKAGE / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Attribute) and node.attr == field) or (
                    isinstance(node, ast.Constant) and node.value == field
                ):
                    readers.append(str(path.relative_to(REPO)))
                    break
    return readers


def job_of(**job: Any) -> TrainingJob:
    """A small job that asks for what `job` adds."""
    spec = {"image": {"base_image": "python:3.11"}, "runtime": {"start_commands": ["true"]}}
    return TrainingJob.model_validate({**spec, **job})


def stored(tmp_path: Path, job: TrainingJob, job_id: str = "jnotbuilt1") -> JobRecord:
    """The job pushed into a local storage root, as `push` stores it (no cluster)."""
    code = tmp_path / "code"
    code.mkdir(exist_ok=True)
    (code / "train.py").write_text("print('hi')\n")
    project = TrainingProject(name="not-built", job=job)
    return store_job(prepare_job(project, code), StorageRoot(str(tmp_path / "storage")), job_id,
                     ray_address=None)  # fmt: skip


# --- what check_support declares ---------------------------------------------------------------

# A job that asks for each UNBUILT feature, once or more.
ASKING: dict[str, list[TrainingJob]] = {
    "weights[].auth.auth_method": [
        job_of(weights=[{"source": "s3://bucket/model", "mount_location": "/app/model",
                         "auth": {"auth_method": "AWS_OIDC", "aws_oidc_role_arn": "arn:x",
                                  "aws_oidc_region": "us-east-1"}}]),
        job_of(weights=[{"source": "gs://bucket/model", "mount_location": "/app/model",
                         "auth": {"auth_method": "GCP_OIDC", "gcp_oidc_service_account": "sa",
                                  "gcp_oidc_workload_id_provider": "p"}}]),
        job_of(weights=[{"source": "s3://bucket/model", "mount_location": "/app/model",
                         "auth": {"auth_method": "AWS_ASSUME_ROLE", "aws_assume_role_arn": "a",
                                  "aws_assume_role_region": "us-east-1"}}]),
    ],
    "runtime.load_checkpoint_config.checkpoints[].typ": [
        job_of(runtime={"start_commands": ["true"], "load_checkpoint_config": {
            "enabled": True, "checkpoints": [
                {"typ": "loops_checkpoint", "run_id": "r1", "checkpoint_name": "c1"}]}}),
    ],
    "interactive_session.session_provider": [
        job_of(interactive_session={"trigger": "on_demand", "session_provider": provider})
        for provider in ("vs_code", "cursor", "ssh")
    ],
    "compute.availability_model": [job_of(compute={"availability_model": "spot"})],
    "runtime.checkpointing_config.enabled": [
        job_of(ray_train={}, runtime={"start_commands": ["python train.py"],
                                      "checkpointing_config": {"enabled": True}}),
    ],
}  # fmt: skip
PLAIN = job_of()


def test_every_check_of_check_support_has_its_row_saying_what_it_does():
    documented = rows()
    for gap in UNBUILT:
        assert gap.config in documented, f"Not built yet has no row for {gap.config}"
        kind, _, where = documented[gap.config]
        assert kind == ("refused" if gap.refused else "recorded only"), gap.config
        assert "`client/support.py`" in where, gap.config
    claimed = {config for config, (_, _, where) in documented.items() if "support.py" in where}
    assert claimed == {gap.config for gap in UNBUILT}, "rows claim checks check_support lacks"


@pytest.mark.parametrize("gap", UNBUILT, ids=lambda gap: gap.config)
def test_check_support_refuses_or_notes_a_job_asking_for_it(gap: Unbuilt, tmp_path):
    assert gap.config in ASKING, f"tests/test_docs_not_built.py has no job asking for {gap.config}"
    assert gap.find(PLAIN) == [] and check_support(PLAIN) == check_support(job_of())
    for i, job in enumerate(ASKING[gap.config]):
        said = gap.find(job)
        assert said, f"{gap.config}: a job asking for it is not found"
        report = check_support(job)
        project = TrainingProject(name="not-built", job=job)
        if gap.refused:  # push and validate refuse it, naming the field, before anything exists
            assert set(said) <= set(report.errors) and not set(said) & set(report.notices)
            with pytest.raises(UnsupportedFeatureError) as refused:
                prepare_job(project, tmp_path)
            assert all(message in str(refused.value) for message in said)
        else:  # the job is stored with the notice, and nothing past the client reads the field
            assert set(said) <= set(report.notices) and not report.errors
            record = stored(tmp_path, job, f"jnotbuilt{i}")
            assert set(said) <= set(record.notices)
            field = gap.config.rsplit(".", 1)[-1]
            assert runtime_readers(field) == [], f"{field} is read past the client"


def test_the_weights_row_names_every_auth_method_that_is_refused():
    (_, named, _) = rows()["weights[].auth.auth_method"]
    refused = [m.value for m in WeightsAuthMethod if m != WeightsAuthMethod.CUSTOM_SECRET]
    assert named[: len(refused)] == refused
    asked = [job.weights[0].auth.auth_method.value for job in ASKING["weights[].auth.auth_method"]]
    assert asked == refused


# --- the rows check_support has no part in -----------------------------------------------------


def runtime_here(job: TrainingJob, monkeypatch: pytest.MonkeyPatch, kind: str) -> JobRuntime:
    """The job's runtime on a cluster whose ORCHESTRATOR_JOB_RUNTIME is `kind`: what its
    controller says first in the job's log (`notice`), fails the deploy with before anything is
    placed (`problem`), and has every node pull (`image_request`)."""
    monkeypatch.setenv("ORCHESTRATOR_JOB_RUNTIME", kind)
    return runtime_for(job)


def check_base_image(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert kind == "recorded only"
    job = job_of()
    assert any("image.base_image is recorded only" in n for n in push_notices(job, "host"))
    assert push_notices(job, "container") == []  # it is used there
    host = runtime_here(job, monkeypatch, "host")
    assert host.image_request() is None and host.agent_runtime_env() is None  # nothing pulled
    assert host.notice().startswith("image python:3.11 is recorded; this cluster runs jobs in")
    container = runtime_here(job, monkeypatch, "container")
    assert container.image_request() == ImageRequest("python:3.11")  # every node pulls it
    assert container.notice() == (
        "image python:3.11: each rank's commands run in a container of it (podman)"
    )
    assert container.problem() is None
    monkeypatch.setenv("ORCHESTRATOR_USE_IMAGE_URI", "1")  # the agents in it, through Ray
    in_image = runtime_here(job, monkeypatch, "host")
    assert in_image.agent_runtime_env() == {"image_uri": "python:3.11"}


def check_docker_auth(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert kind == "recorded only"
    secret = job_of(image={"base_image": "ghcr.io/acme/train:1", "docker_auth": {
        "auth_method": "REGISTRY_SECRET", "registry": "ghcr.io",
        "registry_secret_docker_auth": {"secret_ref": {"name": "ghcr_login"}}}})  # fmt: skip
    (host,) = push_notices(secret, "host")
    assert "image.base_image and image.docker_auth are recorded only" in host
    assert runtime_here(secret, monkeypatch, "host").image_request() is None
    pulled = runtime_here(secret, monkeypatch, "container")
    assert pulled.image_request() == ImageRequest("ghcr.io/acme/train:1", "ghcr.io", "ghcr_login")
    assert pulled.problem() is None
    cloud = job_of(image={"base_image": "1234.dkr.ecr.aws/train:1", "docker_auth": {
        "auth_method": "AWS_OIDC", "registry": "1234.dkr.ecr.aws",
        "aws_oidc_docker_auth": {"role_arn": "arn:x", "region": "us-east-1"}}})  # fmt: skip
    problem = runtime_here(cloud, monkeypatch, "container").problem()
    assert problem is not None and "auth_method AWS_OIDC is not supported in containers" in problem


def check_enable_baseten_workdir(kind: str, tmp_path: Path, _: pytest.MonkeyPatch) -> None:
    assert kind == "no effect"
    readers = [
        str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py")
        if "enable_baseten_workdir" in p.read_text() and p != PACKAGE / "spec" / "training.py"
    ]  # fmt: skip
    assert readers == [], f"enable_baseten_workdir is read: {readers}"
    record = stored(tmp_path, job_of(enable_baseten_workdir=False))
    node = NodeInfo(rank=0, node_id="n0", ip="10.0.0.1", hostname="h0",
                    working_dir="/tmp/orchestrator/jobs/jnotbuilt1/rank-0/workspace")  # fmt: skip
    assert job_environment(record, node)["BT_WORKING_DIR"] == node.working_dir


def check_ray_train(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert kind == "refused"
    train, plain = job_of(ray_train={}), job_of()
    assert check_support(train).errors == ()  # this Ray has every seam
    monkeypatch.setattr(ray_train_seams, "seams_missing", lambda: "this Ray (2.99.0) lacks x")
    assert check_support(train).errors == ("ray_train: this Ray (2.99.0) lacks x",)
    assert check_support(plain).errors == ()


CHECKS: dict[str, Callable[[str, Path, pytest.MonkeyPatch], None]] = {
    "ray_train": check_ray_train,
    "image.base_image": check_base_image,
    "image.docker_auth": check_docker_auth,
    "enable_baseten_workdir": check_enable_baseten_workdir,
}


def test_every_row_is_tried_on_the_code():
    assert set(rows()) == {gap.config for gap in UNBUILT} | set(CHECKS)


@pytest.mark.parametrize("config", sorted(CHECKS))
def test_a_row_check_support_has_no_part_in_is_what_the_code_does(config, tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ORCHESTRATOR_USE_IMAGE_URI", raising=False)
    kind, _, _ = rows()[config]
    CHECKS[config](kind, tmp_path, monkeypatch)

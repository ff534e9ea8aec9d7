"""cluster.yaml: accepted by Ray's own cluster launcher checks, and true to what jobs rely on.

Offline: `ray up` resolves the config with `prepare_config`, asks AWS for instance types, then
checks it with `validate_config` (ray/autoscaler/ray-schema.json via jsonschema). The AWS step is
the only one that needs the network; the rest runs here, with sockets blocked to prove it.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import shlex
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml
from packaging.requirements import InvalidRequirement, Requirement
from ray.autoscaler._private.node_provider_availability_tracker import NodeAvailabilitySummary
from ray.autoscaler._private.resource_demand_scheduler import (
    _default_utilization_scorer,
    get_nodes_for,
)
from ray.autoscaler._private.util import prepare_config, validate_config

from orchestrator import definitions as d
from orchestrator import settings
from orchestrator.client.submit import SCHEDULING_TIMEOUT_ENV
from orchestrator.node.gpus import CDI_DIRS
from orchestrator.node.secrets import secret_env_name
from orchestrator.spec.accelerators import Accelerator
from orchestrator.spec.placement import (
    ACCELERATOR_RESOURCE_PREFIX,
    bundles_for,
    strategy_for,
)
from orchestrator.storage.root import STORAGE_ROOT_ENV

CLUSTER_YAML = Path(__file__).resolve().parents[1] / "cluster.yaml"
ENV_FILE = "~/orchestrator.env"
OBJECT_STORE_SCHEMES = {"s3", "gs"}


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("checking cluster.yaml must not touch the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


@pytest.fixture
def raw() -> dict[str, Any]:
    return yaml.safe_load(CLUSTER_YAML.read_text())


@pytest.fixture
def prepared(raw: dict[str, Any]) -> dict[str, Any]:
    """What `ray up` validates: the file merged with Ray's AWS defaults."""
    return prepare_config(copy.deepcopy(raw))


def node_types(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return config["available_node_types"]


def worker_type(config: dict[str, Any], instance_type: str) -> dict[str, Any]:
    (found,) = [
        t
        for name, t in node_types(config).items()
        if name != config["head_node_type"] and t["node_config"]["InstanceType"] == instance_type
    ]
    return found


def test_passes_rays_own_validation(prepared: dict[str, Any]) -> None:
    validate_config(prepared)
    assert prepared["provider"]["type"] == "aws"
    assert prepared["head_node_type"] in node_types(prepared)


@pytest.mark.parametrize(
    "break_it, complaint",
    [
        (lambda c: c.update(max_worker=3), "max_worker"),
        (lambda c: c["available_node_types"]["head"].update(min_worker=0), "min_worker"),
        (
            lambda c: c["available_node_types"]["gpu_h100x8"]["resources"].update(GPU=0.5),
            "integer",
        ),
        (lambda c: c["available_node_types"]["cpu"].pop("resources"), "'resources' is a required"),
    ],
    ids=["unknown top-level key", "unknown node-type key", "fractional resource", "no resources"],
)
def test_validation_catches_a_broken_config(
    raw: dict[str, Any], break_it: Any, complaint: str
) -> None:
    broken = copy.deepcopy(raw)
    break_it(broken)
    with pytest.raises(jsonschema.ValidationError, match=complaint):
        validate_config(prepare_config(broken))


def test_h100_workers_declare_8_gpus_and_their_accelerator_type(raw: dict[str, Any]) -> None:
    h100 = worker_type(raw, "p5.48xlarge")
    assert h100["resources"]["GPU"] == 8
    assert h100["resources"]["CPU"] == 192
    assert h100["resources"]["accelerator_type:H100"] == 1
    assert h100["min_workers"] == 0
    assert h100["max_workers"] >= 1


def test_a10g_workers_declare_their_accelerator_type(raw: dict[str, Any]) -> None:
    a10g = worker_type(raw, "g5.12xlarge")
    assert a10g["resources"]["GPU"] == 4
    assert a10g["resources"]["accelerator_type:A10G"] == 1


def test_every_gpu_type_names_one_accelerator_a_job_can_ask_for(raw: dict[str, Any]) -> None:
    known = {a.value for a in Accelerator}
    for name, node_type in node_types(raw).items():
        resources = node_type["resources"]
        accelerators = [
            k[len(ACCELERATOR_RESOURCE_PREFIX) :]
            for k in resources
            if k.startswith(ACCELERATOR_RESOURCE_PREFIX)
        ]
        if resources.get("GPU", 0):
            assert len(accelerators) == 1 and accelerators[0] in known, name
            # Bundles ask for memory: the autoscaler must know each worker type has some.
            assert resources["memory"] > 0, name
        else:
            assert not accelerators, name


def _scorer() -> Any:
    return functools.partial(
        _default_utilization_scorer,
        node_availability_summary=NodeAvailabilitySummary(node_availabilities={}),
    )


@pytest.mark.parametrize(
    "compute, launched",
    [
        (d.Compute(node_count=2, cpu_count=16, memory="64Gi", accelerator="H100:8"), "p5.48xlarge"),
        (d.Compute(accelerator="A10G:4"), "g5.12xlarge"),
        (d.Compute(accelerator="A10G:1"), "g5.12xlarge"),
        (d.Compute(cpu_count=4, memory="8Gi"), "m6i.4xlarge"),
    ],
    ids=["H100:8 x2", "A10G:4", "A10G:1", "cpu only"],
)
def test_autoscaler_launches_the_matching_node_type(
    prepared: dict[str, Any], compute: d.Compute, launched: str
) -> None:
    """Our placement bundles, fed to Ray's own autoscaler node-type choice."""
    bundles = bundles_for(compute)
    to_add, unmet = get_nodes_for(
        node_types(prepared),
        existing_nodes={prepared["head_node_type"]: 1},
        head_node_type=prepared["head_node_type"],
        max_to_add=prepared["max_workers"],
        resources=bundles,
        utilization_scorer=_scorer(),
        strict_spread=strategy_for(compute) == "STRICT_SPREAD",
    )
    assert unmet == []
    instance_types = {node_types(prepared)[t]["node_config"]["InstanceType"] for t in to_add}
    assert instance_types == {launched}
    assert sum(to_add.values()) == compute.node_count


def test_an_accelerator_the_cluster_lacks_launches_nothing(prepared: dict[str, Any]) -> None:
    bundles = bundles_for(d.Compute(accelerator="A100:8"))
    to_add, unmet = get_nodes_for(
        node_types(prepared),
        existing_nodes={prepared["head_node_type"]: 1},
        head_node_type=prepared["head_node_type"],
        max_to_add=prepared["max_workers"],
        resources=bundles,
        utilization_scorer=_scorer(),
    )
    assert dict(to_add) == {} and unmet == bundles


def test_head_takes_no_job_work(raw: dict[str, Any]) -> None:
    head = node_types(raw)[raw["head_node_type"]]["resources"]
    assert head.get("CPU") == 0 and not head.get("GPU")


def _ray_start(commands: list[str]) -> list[str]:
    """The argv of the one `ray start` among `commands`, after the shell's setup part."""
    (line,) = [c for c in commands if "ray start" in c]
    return shlex.split(line[line.index("ray start") :])


def test_head_serves_the_dashboard_on_8265(raw: dict[str, Any]) -> None:
    argv = _ray_start(raw["head_start_ray_commands"])
    assert "--head" in argv
    assert "--dashboard-port=8265" in argv
    assert "--include-dashboard=false" not in argv


def test_setup_installs_this_package_into_the_venv_on_path(raw: dict[str, Any]) -> None:
    installs = [c for c in raw["setup_commands"] if re.search(r"\bpip install\b", c)]
    names = set()
    for command in installs:
        for token in shlex.split(command):
            try:
                names.add(Requirement(token).name)
            except InvalidRequirement:
                continue
    assert "orchestrator" in names
    (install,) = [c for c in installs if "orchestrator @" in c]
    argv = shlex.split(install)
    python = argv[argv.index("--python") + 1]
    assert python.startswith("~/")
    env_writer = "\n".join(c for c in raw["setup_commands"] if ENV_FILE in c)
    venv_bin = "$HOME/" + str(Path(python[2:]).parent)
    assert f'export PATH="{venv_bin}:$PATH"' in env_writer
    # A node type's own worker_setup_commands would replace the global ones.
    assert not any("worker_setup_commands" in t for t in node_types(raw).values())


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("start_commands", ["head_start_ray_commands", "worker_start_ray_commands"])
def test_every_ray_start_gets_the_storage_root_path_and_secrets(
    raw: dict[str, Any], tmp_path: Path, start_commands: str
) -> None:
    """Runs the env-writing setup commands and the start commands in a fake home, with a stub
    `ray` that records its environment (the one every Ray process on the node inherits)."""
    home = tmp_path
    venv_bin = home / "orchestrator-venv" / "bin"
    venv_bin.mkdir(parents=True)
    stub = venv_bin / "ray"
    stub.write_text('#!/bin/sh\nenv > "$HOME/ray-$1.env"\n')
    stub.chmod(0o755)
    secret = secret_env_name("hf_access_token")
    (home / "orchestrator-secrets.env").write_text(f"{secret}=not-a-real-token\n")
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "RAY_HEAD_IP": "10.0.0.1"}

    def run(command: str) -> None:
        subprocess.run(["bash", "-c", command], env=env, check=True, capture_output=True)

    for command in raw["setup_commands"]:
        if ENV_FILE in command:
            run(command)
    for command in raw[start_commands]:
        run(command)

    seen = dict(
        item.split("=", 1)
        for item in (home / "ray-start.env").read_text().splitlines()
        if "=" in item
    )
    root = urlsplit(seen[STORAGE_ROOT_ENV])
    assert root.scheme in OBJECT_STORE_SCHEMES and root.netloc and root.path.strip("/")
    assert seen["PATH"].split(os.pathsep)[0] == str(venv_bin)
    assert float(seen[SCHEDULING_TIMEOUT_ENV]) >= 600
    assert seen[secret] == "not-a-real-token"
    assert seen[settings.JOB_RUNTIME.name] == "container"
    assert seen["RAY_AUTH_MODE"] == "token"  # its token: ~/.ray/auth_token, Ray's default place
    assert not any(key.startswith("RAY_AUTH_TOKEN") for key in seen)
    assert (home / "ray-stop.env").exists()
    assert ". ~/orchestrator.env" in (home / ".bashrc").read_text()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_every_node_gets_the_laptops_token_readable_by_its_user_only(
    raw: dict[str, Any], tmp_path: Path
) -> None:
    """`ray get-auth-token --generate` on the laptop writes ~/.ray/auth_token; file_mounts puts
    it at Ray's default place on every node (workers get the head's file_mounts), where the
    setup commands leave it to its owner alone (rsync keeps the laptop's mode)."""
    assert raw["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    token = tmp_path / ".ray" / "auth_token"
    token.parent.mkdir()
    token.write_text("a-token")
    token.chmod(0o644)
    chmod = [c for c in raw["setup_commands"] if "auth_token" in c]
    assert len(chmod) == 1
    subprocess.run(["bash", "-c", chmod[0]], env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
                   check=True)  # fmt: skip
    assert token.stat().st_mode & 0o777 == 0o600


def test_every_node_gets_podman_and_a_cdi_spec_of_its_gpus_where_it_has_some(
    raw: dict[str, Any],
) -> None:
    """Container mode's needs (node/podman.py, node/gpus.py): podman on every node, before Ray
    starts, and on a GPU node the CDI spec of its GPUs where podman reads specs."""
    setup = raw["setup_commands"]
    (install,) = [c for c in setup if "apt-get install" in c]
    assert "podman" in shlex.split(install.replace("(", " ").replace(")", " "))
    (cdi,) = [c for c in setup if "nvidia-ctk cdi generate" in c]
    output = re.search(r"--output=(\S+)", cdi)
    assert output and str(Path(output.group(1)).parent) in CDI_DIRS
    assert "nvidia-smi" in cdi  # a CPU node (no GPU) skips it rather than failing its setup

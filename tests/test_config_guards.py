"""Configs that would harm a node or can never run are refused before anything is submitted,
naming the field; loading a config has a time limit and may not end the process. No Ray."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from orchestrator.client.config_loader import load_config
from orchestrator.client.support import check_support
from orchestrator.errors import ConfigError, UnsupportedFeatureError
from orchestrator.spec.training import JOB_VARIABLES, TrainingProject
from orchestrator.spec.validation import describe_validation_error


def cli(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *map(str, args)],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )  # fmt: skip


def project(runtime: dict | None = None, **job: object) -> dict:
    return {
        "name": "guarded",
        "job": {"image": {"base_image": "python:3.11"}, "runtime": runtime or {}, **job},
    }


def refusal(spec: dict) -> str:
    with pytest.raises(ValidationError) as info:
        TrainingProject.model_validate(spec)
    return "\n".join(describe_validation_error(info.value, TrainingProject, ""))


def accepted(spec: dict) -> TrainingProject:
    return TrainingProject.model_validate(spec)


PATH_FIELDS = {
    "checkpoint_path": lambda p: project({"checkpointing_config": {"enabled": True,
                                                                  "checkpoint_path": p}}),
    "download_folder": lambda p: project({"load_checkpoint_config": {
        "enabled": True, "download_folder": p,
        "checkpoints": [{"typ": "baseten_latest_checkpoint", "project_name": "x"}]}}),
    "mount_base_path": lambda p: project({"cache_config": {"enabled": True,
                                                           "mount_base_path": p}}),
    "mount_location": lambda p: project(weights=[{"source": "hf://org/model",
                                                  "mount_location": p}]),
}  # fmt: skip
FIELD_PATHS = {
    "checkpoint_path": "job.runtime.checkpointing_config.checkpoint_path",
    "download_folder": "job.runtime.load_checkpoint_config.download_folder",
    "mount_base_path": "job.runtime.cache_config.mount_base_path",
    "mount_location": "job.weights[0].mount_location",
}


@pytest.mark.parametrize("field", sorted(PATH_FIELDS))
@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("/", "the root directory"),
        ("/tmp", "/tmp itself"),
        ("/tmp/", "/tmp itself"),
        ("/root", "/root itself"),
        ("/etc", "in /etc, a system directory"),
        ("/usr/lib/python3", "in /usr, a system directory"),
        ("/tmp/../proc/1", "in /proc, a system directory"),
    ],
)
def test_a_job_directory_at_the_root_or_in_a_system_directory_is_refused(field, path, why):
    problems = refusal(PATH_FIELDS[field](path))
    assert problems.startswith(f"{FIELD_PATHS[field]}: {path!r} "), problems
    # mount_location's own rule comes first and refuses the root and '..' in its words
    own_rule = field == "mount_location" and (path == "/" or ".." in path)
    said = "must be a directory below / without '..'" if own_rule else f"is {why}"
    assert f"{path!r} {said}" in problems, problems


@pytest.mark.parametrize("field", sorted(PATH_FIELDS))
@pytest.mark.parametrize("path", ["/tmp/checkpoints", "/mnt/ckpts", "/root/.cache/x", "/data/run"])
def test_a_directory_of_the_jobs_own_is_accepted(field, path):
    accepted(PATH_FIELDS[field](path))


def test_the_defaults_are_accepted():
    accepted(PATH_FIELDS["download_folder"]("/tmp/loaded_checkpoints"))
    accepted(PATH_FIELDS["mount_base_path"]("/root/.cache"))


def test_an_environment_variable_may_not_override_what_the_job_is_given():
    spec = project({"environment_variables": {"BT_NODE_RANK": "0", "MY_VAR": "x",
                                              "BT_CHECKPOINT_DIR": "/x"}})  # fmt: skip
    problems = refusal(spec)
    assert problems.startswith(
        "job.runtime.environment_variables.BT_NODE_RANK: orchestrator gives every job this variable"
    ), problems
    assert problems.endswith("use another name (so is BT_CHECKPOINT_DIR)"), problems
    accepted(project({"environment_variables": {"BT_MY_OWN": "fine"}}))


def test_every_bt_variable_a_job_gets_is_one_it_may_not_set():
    """The names the controller, the rendezvous and the cache mounts set, read off their code."""
    root = Path(__file__).resolve().parents[1] / "orchestrator"
    import re

    given = set()
    for module in (
        "controller/environment.py",
        "agents/rendezvous.py",
        "node/training_cache_mounts.py",
    ):
        given |= set(re.findall(r'"(BT_[A-Z_]+)"', (root / module).read_text()))
    assert len(given) >= 14 and given <= JOB_VARIABLES, sorted(given - JOB_VARIABLES)


@pytest.mark.parametrize(
    ("compute", "field", "variable"),
    [
        ({"node_count": 1000}, "compute.node_count: 1000 nodes", "ORCHESTRATOR_MAX_NODE_COUNT"),
        ({"cpu_count": 5000}, "compute.cpu_count: 5000 CPUs per node",
         "ORCHESTRATOR_MAX_CPU_COUNT"),
        ({"accelerator": {"accelerator": "H100", "count": 64}},
         "compute.accelerator.count: 64 GPUs per node", "ORCHESTRATOR_MAX_GPUS_PER_NODE"),
        ({"memory": str(10**30)},
         f"compute.memory: {10**30} bytes of memory per node", "ORCHESTRATOR_MAX_MEMORY_BYTES"),
    ],
)  # fmt: skip
def test_counts_no_cluster_has_are_refused_and_the_limit_is_a_setting(
    compute, field, variable, monkeypatch
):
    """Also memory: 10**30 bytes was accepted (a typo of a unit would wait out the scheduling
    timeout)."""
    job = accepted(project(compute=compute)).job
    with pytest.raises(UnsupportedFeatureError) as info:
        check_support(job).raise_for_errors()
    assert f"{field} is more than any cluster here has" in str(info.value)
    assert variable in str(info.value)
    monkeypatch.setenv(variable, str(10**31))
    check_support(job).raise_for_errors()
    monkeypatch.setenv(variable, "lots")
    with pytest.raises(ConfigError, match=f"{variable} (must be|is not) a whole number"):
        check_support(job)


def write_config(directory: Path, body: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "config.py"
    config.write_text(
        "from orchestrator import definitions as d\nIMAGE = d.Image(base_image='x')\n"
        + textwrap.dedent(body)
        + "\nproject = d.TrainingProject(name='p', job=d.TrainingJob(image=IMAGE))\n"
    )
    return config


@pytest.mark.parametrize(
    ("call", "said"),
    [("import os; os._exit(0)", "called os._exit(0)"), ("import sys; sys.exit(0)",
                                                         "called sys.exit(0)")],
)  # fmt: skip
def test_a_config_that_ends_the_process_is_an_error_not_a_silent_success(tmp_path, call, said):
    config = write_config(tmp_path, call)
    result = cli("validate", config)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert f"config.py line 3 {said} while loading" in result.stderr
    assert "it must not end the process" in result.stderr


def test_a_config_that_does_not_finish_loading_is_stopped_at_the_time_limit(tmp_path, monkeypatch):
    config = write_config(tmp_path, "import time; time.sleep(600)")
    monkeypatch.setenv("ORCHESTRATOR_CONFIG_LOAD_TIMEOUT_S", "1.5")
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert time.monotonic() - started < 10
    assert "did not finish loading in 1.5 s (ORCHESTRATOR_CONFIG_LOAD_TIMEOUT_S)" in str(info.value)
    # The abandoned config still sleeps: Baseten's import paths must not stay importable.
    assert not {"truss", "truss_train"} & set(sys.modules)
    monkeypatch.setenv("ORCHESTRATOR_CONFIG_LOAD_TIMEOUT_S", "never")
    with pytest.raises(ConfigError, match="ORCHESTRATOR_CONFIG_LOAD_TIMEOUT_S must be a number"):
        load_config(write_config(tmp_path / "other", ""))


def test_validate_names_the_field_of_a_harmful_path(tmp_path):
    config = write_config(tmp_path, "")
    config.write_text(
        config.read_text().replace(
            "d.TrainingJob(image=IMAGE)",
            "d.TrainingJob(image=IMAGE, runtime=d.Runtime("
            'checkpointing_config=d.CheckpointingConfig(enabled=True, checkpoint_path="/etc")))',
        )
    )
    result = cli("validate", config)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "CheckpointingConfig.checkpoint_path: '/etc' is in /etc, a system directory" in (
        result.stderr
    )

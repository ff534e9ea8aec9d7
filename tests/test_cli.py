"""The CLI as a user runs it: a real subprocess of `python -m orchestrator`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MNIST = REPO / "recipes" / "mnist-pytorch" / "config.py"


def run_cli(
    *args: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
        timeout=120,
    )


def write_config(directory: Path, body: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_validate_prints_the_resolved_job():
    result = run_cli("validate", MNIST)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "mnist-pytorch" in out
    assert "1 x (cpu 2, memory 4Gi, accelerator none (CPU))" in out
    assert "chmod +x ./run.sh && ./run.sh" in out
    assert "checkpointing   enabled" in out
    assert "files" in out and "valid" in out


def test_validate_json_shows_secrets_as_references_only(tmp_path):
    config = write_config(
        tmp_path / "job",
        """
        from truss_train import definitions
        project = definitions.TrainingProject(
            name="secretive",
            job=definitions.TrainingJob(
                image=definitions.Image(base_image="python:3.11"),
                compute=definitions.Compute(node_count=2, accelerator="H100:8"),
                runtime=definitions.Runtime(
                    environment_variables={
                        "HF_TOKEN": definitions.SecretReference(name="hf_access_token"),
                        "PLAIN": "visible-only-by-name",
                    }
                ),
            ),
        )
        """,
    )
    result = run_cli("validate", config, "-o", "json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["nodes"] == 2
    assert summary["per_node"]["accelerator"] == "H100:8" and summary["per_node"]["gpus"] == 8
    assert summary["environment"] == {"HF_TOKEN": "secret:hf_access_token", "PLAIN": "(set)"}
    assert summary["secrets"] == ["hf_access_token"]
    assert summary["archive"]["files"] == 1
    assert "visible-only-by-name" not in result.stdout


def test_invalid_config_fails_with_the_field_path(tmp_path):
    config = write_config(
        tmp_path,
        """
        from orchestrator import definitions as d
        project = d.TrainingProject(
            name="p",
            job=d.TrainingJob(image=d.Image(base_image="x"), compute=d.Compute(memory="lots")),
        )
        """,
    )
    result = run_cli("validate", config)
    assert result.returncode == 2
    assert "config.py line 5: invalid Compute" in result.stderr
    assert "Compute.memory: 'lots' is not a memory size" in result.stderr
    assert result.stdout == ""


def test_push_dry_run_applies_overrides_and_submits_nothing():
    result = run_cli(
        "push", MNIST, "--dry-run", "--node-count", "2", "--job-name", "try-1",
        "--entrypoint", "python train.py --epochs 1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "--node-count 2 overrides 1 from the config" in out
    assert "2 x (cpu 2" in out and "try-1" in out
    assert "start commands  python train.py --epochs 1 " in out
    assert "nothing was submitted" in out and "sha256" in out


def test_push_takes_truss_train_push_flags_for_sessions_priority_and_spot():
    result = run_cli(
        "push", MNIST, "--dry-run", "-o", "json", "--interactive", "on_failure",
        "--interactive-timeout-minutes", "30", "--priority", "3", "--spot",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)["summary"]
    assert summary["interactive_session"]["trigger"] == "on_failure"  # created by the flags
    assert summary["interactive_session"]["timeout_minutes"] == 30
    assert summary["priority"] == 3 and summary["availability_model"] == "spot"
    refused = run_cli("push", MNIST, "--dry-run", "--interactive", "sometimes")
    assert refused.returncode == 2 and "--interactive" in refused.stderr


def test_a_config_that_pushes_itself_while_loading_submits_nothing(tmp_path):
    """Baseten users end a config with `truss_train.push(project)` to run `python config.py`;
    loading it (validate, push) must not submit a job from inside the load."""
    body = """
        import truss_train
        from truss_train import definitions as d
        project = d.TrainingProject(name="p", job=d.TrainingJob(image=d.Image(base_image="x")))
        truss_train.push(project)
    """
    config = write_config(tmp_path / "job", body)
    home = tmp_path / "home"
    # A cluster address nothing answers at: a push that slipped through could not hide.
    env = {"ORCHESTRATOR_HOME": str(home), "ORCHESTRATOR_STORAGE_ROOT": str(home / "storage"),
           "RAY_ADDRESS": "http://127.0.0.1:9"}  # fmt: skip
    for verb in (["validate"], ["push", "--dry-run"], ["push"]):
        result = run_cli(*verb, config, env=env)
        assert result.returncode == 2, (verb, result.stderr)
        assert "config.py line 5: the config calls truss_train.push(...) while it loads" in (
            result.stderr.replace("\n", " ")
        )
        assert not home.exists() or not any(home.rglob("*.json"))  # no record, no cluster
    guarded = write_config(
        tmp_path / "guarded",
        body.replace(
            "        truss_train.push(project)",
            """        if __name__ == "__main__":
            truss_train.push(project)""",
        ),
    )
    assert run_cli("validate", guarded, env=env).returncode == 0


def test_dry_run_is_an_api_that_submits_nothing(tmp_path, monkeypatch):
    from orchestrator import dry_run
    from orchestrator.client.overrides import Overrides

    home = tmp_path / "home"
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(home))
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:9")  # nothing answers there
    plan = dry_run(MNIST, overrides=Overrides(node_count=2))
    assert plan.summary["nodes"] == 2
    assert "--node-count 2 overrides 1 from the config" in plan.warnings
    assert len(plan.archive_sha256) == 64 and plan.archive_bytes > 0
    printed = run_cli("push", MNIST, "--dry-run", "-o", "json", "--node-count", "2")
    assert json.loads(printed.stdout)["summary"]["archive"]["sha256"] == plan.archive_sha256
    assert not home.exists()  # no cluster started, no storage root written


def test_push_dry_run_refuses_bad_overrides():
    result = run_cli("push", MNIST, "--dry-run", "--accelerator", "H100:zero")
    assert result.returncode == 2
    assert "job.compute.accelerator" in result.stderr


def test_push_refuses_features_orchestrator_cannot_honour(tmp_path):
    config = write_config(
        tmp_path,
        """
        from orchestrator import definitions as d
        project = d.TrainingProject(
            name="p",
            job=d.TrainingJob(
                image=d.Image(base_image="x"),
                weights=[d.WeightsSource(
                    source="s3://bucket/model", mount_location="/app/model",
                    auth=d.WeightsAuth(auth_method="AWS_OIDC", aws_oidc_role_arn="arn:x",
                                       aws_oidc_region="us-east-1"),
                )],
            ),
        )
        """,
    )
    result = run_cli("push", config, "--dry-run")
    assert result.returncode == 1
    assert "weights[0].auth: AWS_OIDC is Baseten's cloud identity" in result.stderr


def test_init_writes_a_starter_that_validates(tmp_path):
    target = tmp_path / "starter"
    result = run_cli("init", "--target-directory", target)
    assert result.returncode == 0, result.stderr
    assert os.access(target / "run.sh", os.X_OK)
    assert run_cli("validate", target / "config.py").returncode == 0
    again = run_cli("init", "--target-directory", target)
    assert again.returncode == 1 and "already exists" in again.stderr


def test_init_copies_recipes(tmp_path):
    listing = run_cli("init", "--list-examples")
    assert listing.returncode == 0 and "mnist-pytorch" in listing.stdout
    result = run_cli("init", "--examples", "mnist-pytorch", "--target-directory", tmp_path)
    assert result.returncode == 0, result.stderr
    copied = tmp_path / "mnist-pytorch"
    assert (copied / "train.py").read_text() == (MNIST.parent / "train.py").read_text()
    assert os.access(copied / "run.sh", os.X_OK)
    missing = run_cli("init", "--examples", "no-such-recipe", "--target-directory", tmp_path)
    assert missing.returncode == 1 and "available: " in missing.stderr


@pytest.mark.parametrize("args", [["--help"], ["push", "--help"]])
def test_help(args):
    result = run_cli(*args)
    assert result.returncode == 0
    assert "Usage" in result.stdout


def test_push_dry_run_shows_weights_and_cache(tmp_path):
    config = write_config(
        tmp_path,
        """
        from orchestrator import definitions as d
        project = d.TrainingProject(
            name="p",
            job=d.TrainingJob(
                image=d.Image(base_image="x"),
                weights=[d.WeightsSource(source="hf://a/b", mount_location="/app/m")],
                runtime=d.Runtime(enable_cache=True),
            ),
        )
        """,
    )
    result = run_cli("push", config, "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "hf://a/b -> /app/m" in result.stdout
    assert "cache           enabled" in result.stdout
    assert "nothing was submitted" in result.stdout

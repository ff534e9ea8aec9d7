"""Configs written for Baseten (`from truss_train import ...`) load unchanged, without truss.

Each fixture under tests/fixtures/baseten/ is a config as a Baseten user writes it; the tests check
that loading it gives a project with exactly the values the config sets.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from orchestrator import definitions
from orchestrator.client.config_loader import LoadedConfig, load_config
from orchestrator.client.workspace import plan_workspace

FIXTURES = Path(__file__).parent / "fixtures" / "baseten"
BASETEN_MODULES = (
    "truss",
    "truss.base",
    "truss.base.truss_config",
    "truss_train",
    "truss_train.definitions",
)

PYTORCH_IMAGE = "pytorch/pytorch:2.7.0-cuda12.8-cudnn9-runtime"
AXOLOTL_IMAGE = "axolotlai/axolotl:main-20250811-py3.11-cu126-2.7.1"
RUN_SH = "/bin/sh -c 'chmod +x ./run.sh && ./run.sh'"
HF_TOKEN = {"name": "hf_access_token"}

# Every field each fixture sets to a non-default value, as `model_dump(exclude_defaults=True)`.
EXPECTED: dict[str, dict[str, Any]] = {
    "cpu-job": {
        "name": "cpu-smoke-test",
        "job": {
            "image": {"base_image": "python:3.11-slim"},
            "compute": {"cpu_count": 4, "memory": "16Gi"},
            "runtime": {
                "start_commands": ["pip install -r requirements.txt", "python train.py --epochs 3"],
                "environment_variables": {
                    "DATA_DIR": "/tmp/data",
                    "LOG_LEVEL": "info",
                    "NUM_WORKERS": "4",
                },
            },
            "name": "cpu-smoke-test",
        },
    },
    "multinode-h100": {
        "name": "llama-8b-fsdp-multinode",
        "job": {
            "image": {"base_image": PYTORCH_IMAGE},
            "compute": {"node_count": 2, "accelerator": {"accelerator": "H100", "count": 8}},
            "runtime": {
                "start_commands": [RUN_SH],
                "environment_variables": {
                    "HF_TOKEN": HF_TOKEN,
                    "HF_HUB_ENABLE_HF_TRANSFER": "true",
                },
                "checkpointing_config": {
                    "enabled": True,
                    "checkpoint_path": "/tmp/training_checkpoints",
                    "volume_size_gib": 500,
                },
                "cache_config": {"enabled": True, "enable_legacy_hf_mount": True},
            },
        },
    },
    "weights-hf-s3": {
        "name": "llama-8b-weights",
        "job": {
            "image": {"base_image": PYTORCH_IMAGE},
            "compute": {"accelerator": {"accelerator": "H100"}},
            "runtime": {
                "start_commands": [
                    "pip install transformers datasets accelerate",
                    "python train.py --model /app/models/llama --data /app/data",
                ],
                "checkpointing_config": {"enabled": True},
                "cache_config": {"enabled": True},
            },
            "weights": [
                {
                    "source": "hf://meta-llama/Llama-3.1-8B@main",
                    "mount_location": "/app/models/llama",
                    "allow_patterns": ["*.safetensors", "*.json", "tokenizer*"],
                },
                {
                    "source": "s3://my-bucket/datasets/v1",
                    "mount_location": "/app/data",
                    "auth_secret_name": "aws_creds",
                },
            ],
        },
    },
    "secrets": {
        "name": "secrets-demo",
        "job": {
            "image": {"base_image": AXOLOTL_IMAGE},
            "compute": {"accelerator": {"accelerator": "H200"}},
            "runtime": {
                "start_commands": ["axolotl train config.yaml"],
                "environment_variables": {
                    "HF_TOKEN": HF_TOKEN,
                    "WANDB_API_KEY": {"name": "wandb_api_key"},
                    "WANDB_PROJECT": "axolotl-secrets-demo",
                    "HF_HUB_ENABLE_HF_TRANSFER": "1",
                },
            },
        },
    },
    "load-checkpoint": {
        "name": "gpt-oss-20b-resume",
        "job": {
            "image": {"base_image": AXOLOTL_IMAGE},
            "compute": {"accelerator": {"accelerator": "H100", "count": 8}},
            "runtime": {
                "start_commands": [RUN_SH],
                "environment_variables": {"HF_TOKEN": HF_TOKEN},
                "checkpointing_config": {"enabled": True},
                "load_checkpoint_config": {
                    "enabled": True,
                    "checkpoints": [
                        {"project_name": "gpt-oss-20b-sft"},
                        {"checkpoint_name": "checkpoint-100", "job_id": "abc123"},
                    ],
                },
            },
        },
    },
    "deprecated-enable-cache": {
        "name": "legacy-cache",
        "job": {
            "image": {"base_image": "pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime"},
            "compute": {"accelerator": {"accelerator": "A100"}},
            "runtime": {
                "start_commands": ["pip install -r requirements.txt", "python train.py"],
                "checkpointing_config": {"enabled": True},
                "cache_config": {"enabled": True, "enable_legacy_hf_mount": True},
            },
        },
    },
    "workspace": {
        "name": "monorepo-workspace",
        "job": {
            "image": {"base_image": PYTORCH_IMAGE},
            "compute": {"accelerator": {"accelerator": "H100", "count": 4}},
            "runtime": {
                "start_commands": ["/bin/sh -c 'cd training && chmod +x ./run.sh && ./run.sh'"],
                "cache_config": {"enabled": True},
            },
            "workspace": {"workspace_root": "..", "exclude_dirs": ["../data"]},
        },
    },
    "string-accelerator": {
        "name": "string-accelerator",
        "job": {
            "image": {"base_image": PYTORCH_IMAGE},
            "compute": {
                "cpu_count": 32,
                "memory": "512Gi",
                "accelerator": {"accelerator": "H100", "count": 8},
            },
            "runtime": {"start_commands": ["torchrun --nproc-per-node=8 train.py"]},
        },
    },
    "string-accelerator-a10g": {
        "name": "single-a10g",
        "job": {
            "image": {"base_image": PYTORCH_IMAGE},
            "compute": {"accelerator": {"accelerator": "A10G"}},
            "runtime": {"start_commands": ["python train.py"]},
        },
    },
    "sibling-module": {
        "name": "qwen3-sibling-settings",
        "job": {
            "image": {"base_image": PYTORCH_IMAGE},
            "compute": {"accelerator": {"accelerator": "L4", "count": 2}},
            "runtime": {
                "start_commands": ["torchrun --nproc-per-node=2 train.py"],
                "environment_variables": {
                    "MODEL_ID": "Qwen/Qwen3-0.6B",
                    "LEARNING_RATE": "2e-5",
                    "NUM_GPUS": "2",
                },
            },
        },
    },
    "spot-interactive": {
        "name": "spot-experiments",
        "team_name": "research",
        "job": {
            "image": {"base_image": PYTORCH_IMAGE},
            "compute": {
                "accelerator": {"accelerator": "H200", "count": 8},
                "availability_model": "spot",
            },
            "runtime": {
                "start_commands": ["python train.py --resume-from-latest"],
                "checkpointing_config": {"enabled": True},
            },
            "interactive_session": {
                "trigger": "on_failure",
                "timeout_minutes": 120,
                "session_provider": "ssh",
            },
            "name": "spot-run-1",
            "priority": 5,
        },
    },
    "docker-auth": {
        "name": "private-image",
        "job": {
            "image": {
                "base_image": "123456789012.dkr.ecr.us-east-1.amazonaws.com/trainer:2025-06",
                "docker_auth": {
                    "auth_method": "AWS_IAM",
                    "registry": "123456789012.dkr.ecr.us-east-1.amazonaws.com",
                    "aws_iam_docker_auth": {
                        "access_key_secret_ref": {"name": "aws_access_key_id"},
                        "secret_access_key_secret_ref": {"name": "aws_secret_access_key"},
                    },
                },
            },
            "runtime": {"start_commands": ["python train.py"]},
        },
    },
    "cookbook-project-name": {
        "name": "Axolotl 20B 1 Node - ML Cookbook",
        "job": {
            "image": {"base_image": AXOLOTL_IMAGE},
            "compute": {"accelerator": {"accelerator": "H100", "count": 8}},
            "runtime": {
                "start_commands": [RUN_SH],
                "environment_variables": {"HF_TOKEN": HF_TOKEN},
                "checkpointing_config": {"enabled": True},
                "cache_config": {"enabled": True},
            },
        },
    },
}

# Configs Baseten accepts that we do not load yet. strict: the test fails once they load, as a
# reminder to drop the mark.


def config_path(name: str) -> Path:
    """The fixture's config.py: at its top, or in training/ for the workspace layout."""
    (path,) = (FIXTURES / name).rglob("config.py")
    return path


def load(name: str) -> LoadedConfig:
    return load_config(config_path(name))


def fixture_params() -> list[str]:
    return list(EXPECTED)


def test_every_fixture_has_expected_values() -> None:
    on_disk = {p.relative_to(FIXTURES).parts[0] for p in FIXTURES.rglob("config.py")}
    assert on_disk == set(EXPECTED)


def test_real_truss_is_not_installed_in_this_environment() -> None:
    # The fixtures must load through orchestrator's stand-in modules; with truss installed they
    # would go through the converter instead and these tests would no longer cover the stand-in.
    assert importlib.util.find_spec("truss_train") is None
    assert importlib.util.find_spec("truss") is None


@pytest.mark.parametrize("name", fixture_params())
def test_fixture_loads_with_the_values_it_sets(name: str) -> None:
    loaded = load(name)

    assert isinstance(loaded.project, definitions.TrainingProject)
    assert loaded.config_path == config_path(name).resolve()
    assert loaded.source_dir == config_path(name).resolve().parent
    assert loaded.project.model_dump(mode="json", exclude_defaults=True) == EXPECTED[name]
    for module in BASETEN_MODULES:
        assert module not in sys.modules, f"{module} left importable after loading {name}"


def test_multinode_job_requests_two_nodes_of_eight_h100s() -> None:
    compute = load("multinode-h100").project.job.compute

    assert compute.node_count == 2
    assert compute.accelerator == definitions.AcceleratorSpec(
        accelerator=definitions.Accelerator.H100, count=8
    )
    assert compute.gpus_per_node == 8


def test_cpu_job_has_no_gpus() -> None:
    compute = load("cpu-job").project.job.compute

    assert compute.accelerator is None
    assert compute.gpus_per_node == 0
    assert compute.memory_bytes == 16 * 2**30


@pytest.mark.parametrize(
    ("name", "accelerator", "count"),
    [("string-accelerator", "H100", 8), ("string-accelerator-a10g", "A10G", 1)],
)
def test_accelerator_strings_become_specs(name: str, accelerator: str, count: int) -> None:
    spec = load(name).project.job.compute.accelerator

    assert spec is not None
    assert spec.accelerator is definitions.Accelerator(accelerator)
    assert spec.count == count


def test_secrets_are_references_whether_written_as_object_or_dict() -> None:
    runtime = load("secrets").project.job.runtime
    env = runtime.environment_variables

    assert env["HF_TOKEN"] == definitions.SecretReference(name="hf_access_token")
    assert env["WANDB_API_KEY"] == definitions.SecretReference(name="wandb_api_key")
    assert env["WANDB_PROJECT"] == "axolotl-secrets-demo"
    assert sorted(runtime.secret_references()) == ["HF_TOKEN", "WANDB_API_KEY"]


def test_weights_keep_sources_patterns_and_credentials() -> None:
    job = load("weights-hf-s3").project.job
    model, data = job.weights

    assert model.is_huggingface and model.normalized_mount == "/app/models/llama"
    assert model.allow_patterns == ["*.safetensors", "*.json", "tokenizer*"]
    assert model.secret_name is None
    assert data.scheme == "s3" and data.secret_name == "aws_creds"
    assert job.secret_references() == [definitions.SecretReference(name="aws_creds")]


def test_checkpoint_references_keep_their_kind() -> None:
    config = load("load-checkpoint").project.job.runtime.load_checkpoint_config

    assert config is not None and config.enabled
    assert config.download_folder == "/tmp/loaded_checkpoints"
    latest, named = config.checkpoints
    assert latest.typ == "baseten_latest_checkpoint"
    assert (latest.project_name, latest.job_id) == ("gpt-oss-20b-sft", None)
    assert named.typ == "baseten_named_checkpoint"
    assert (named.checkpoint_name, named.job_id) == ("checkpoint-100", "abc123")


def test_deprecated_enable_cache_becomes_cache_config_with_legacy_hf_mount() -> None:
    runtime = load("deprecated-enable-cache").project.job.runtime

    assert runtime.cache_config == definitions.CacheConfig(
        enabled=True, enable_legacy_hf_mount=True
    )
    assert runtime.enable_cache is None


def test_spot_and_interactive_session_enums_survive() -> None:
    job = load("spot-interactive").project.job

    assert job.compute.availability_model is definitions.AvailabilityModel.SPOT
    assert job.interactive_session == definitions.InteractiveSession(
        trigger=definitions.InteractiveSessionTrigger.ON_FAILURE,
        session_provider=definitions.InteractiveSessionProvider.SSH,
        timeout_minutes=120,
    )


def test_sibling_module_is_used_then_forgotten() -> None:
    env = load("sibling-module").project.job.runtime.environment_variables

    assert env["MODEL_ID"] == "Qwen/Qwen3-0.6B"
    assert "hyperparams" not in sys.modules


def test_workspace_uploads_the_root_without_excluded_data() -> None:
    loaded = load("workspace")

    plan = plan_workspace(loaded.source_dir, loaded.project.job.workspace)

    assert plan.root == (FIXTURES / "workspace").resolve()
    assert plan.config_relpath == "training"
    assert {f.arcname for f in plan.files} == {
        "shared/tokenize_data.py",
        "training/config.py",
        "training/run.sh",
        "training/train.py",
    }


@pytest.mark.parametrize("name", ["multinode-h100", "load-checkpoint"])
def test_run_script_started_by_the_config_is_uploaded(name: str) -> None:
    loaded = load(name)
    assert loaded.project.job.runtime.start_commands == [RUN_SH]

    plan = plan_workspace(loaded.source_dir, loaded.project.job.workspace)

    assert "run.sh" in {f.arcname for f in plan.files}

"""The spec: Baseten's defaults, and errors that name the field and say what is allowed."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from orchestrator import definitions as d
from orchestrator.client.support import check_support
from orchestrator.spec.base import parse_memory
from orchestrator.spec.validation import describe_validation_error


def problems(cls, **kwargs) -> list[str]:
    with pytest.raises(ValidationError) as info:
        cls(**kwargs)
    return describe_validation_error(info.value, cls)


def one_problem(cls, **kwargs) -> str:
    found = problems(cls, **kwargs)
    assert len(found) == 1, found
    return found[0]


def image() -> d.Image:
    return d.Image(base_image="pytorch/pytorch:2.7.1")


# --- defaults: the same as truss_train ---------------------------------------------------------


def test_training_job_defaults_match_baseten():
    job = d.TrainingJob(image=image())
    assert job.compute == d.Compute()
    assert job.runtime == d.Runtime()
    assert job.name is None and job.priority is None and job.workspace is None
    assert job.weights == [] and job.interactive_session is None
    assert job.enable_baseten_workdir is True


def test_compute_defaults_match_baseten():
    c = d.Compute()
    assert (c.node_count, c.cpu_count, c.memory) == (1, 1, "2Gi")
    assert c.accelerator is None
    assert c.availability_model is d.AvailabilityModel.DEDICATED
    assert c.memory_bytes == 2 * 1024**3 and c.gpus_per_node == 0


def test_runtime_and_sub_config_defaults_match_baseten():
    r = d.Runtime()
    assert r.start_commands == [] and r.environment_variables == {}
    assert r.checkpointing_config == d.CheckpointingConfig(enabled=False)
    assert r.cache_config is None and r.load_checkpoint_config is None
    ckpt = d.CheckpointingConfig()
    assert (ckpt.enabled, ckpt.checkpoint_path, ckpt.volume_size_gib) == (False, None, None)
    cache = d.CacheConfig()
    assert (cache.enabled, cache.enable_legacy_hf_mount, cache.require_cache_affinity) == (
        False,
        False,
        True,
    )
    assert cache.mount_base_path == "/root/.cache"
    load = d.LoadCheckpointConfig()
    assert load.enabled is False and load.download_folder == "/tmp/loaded_checkpoints"
    assert [c.typ for c in load.checkpoints] == ["baseten_latest_checkpoint"]


def test_other_defaults_match_baseten():
    assert d.AcceleratorSpec() == d.AcceleratorSpec(accelerator=None, count=1)
    assert d.Workspace() == d.Workspace(workspace_root=None, external_dirs=[], exclude_dirs=[])
    session = d.InteractiveSession()
    assert session.trigger is d.InteractiveSessionTrigger.ON_DEMAND
    assert session.timeout_minutes == 480
    assert session.session_provider is d.InteractiveSessionProvider.VS_CODE
    assert session.auth_provider is d.InteractiveSessionAuthProvider.MICROSOFT
    assert d.LoRADetails().rank == 16
    assert d.CheckpointList().download_folder == "/tmp/training_checkpoints"
    assert d.TrainingProject(name="p", job=d.TrainingJob(image=image())).team_name is None


def test_accelerator_enum_has_every_baseten_training_type():
    names = {a.value for a in d.Accelerator}
    assert names == {
        "T4", "L4", "A10G", "V100", "A100", "A100_40GB", "H100", "H100_40GB", "H200",
        "B200", "L40S", "RTX_PRO_6000", "B300", "GB300",
    }  # fmt: skip


# --- compute and accelerators ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("written", "accelerator", "count"),
    [("H100:8", d.Accelerator.H100, 8), ("A10G", d.Accelerator.A10G, 1), ("h200:4", "H200", 4)],
)
def test_accelerator_string_form(written, accelerator, count):
    spec = d.Compute(accelerator=written).accelerator
    assert spec.accelerator == accelerator and spec.count == count
    assert str(spec) == f"{d.Accelerator(accelerator).value}:{count}"


@pytest.mark.parametrize("written", ["H100:0", "H100:x", "H100:-1"])
def test_accelerator_bad_count_is_explained(written):
    line = one_problem(d.Compute, accelerator=written)
    assert line.startswith("Compute.accelerator: ")
    assert "TYPE:COUNT with COUNT > 0" in line


def test_unknown_accelerator_lists_the_allowed_ones():
    line = one_problem(d.Compute, accelerator="H999:8")
    assert line.startswith("Compute.accelerator.accelerator: 'H999' is not one of")
    assert "'H100'" in line and "'GB300'" in line


def test_node_count_must_be_at_least_one():
    assert one_problem(d.Compute, node_count=0) == (
        "Compute.node_count: Input should be greater than or equal to 1 (got 0)"
    )


def test_strict_types_like_baseten():
    assert "Compute.node_count" in one_problem(d.Compute, node_count="2")
    assert "Compute.cpu_count" in one_problem(d.Compute, cpu_count=1.5)


@pytest.mark.parametrize(
    ("memory", "expected"),
    [("2Gi", 2 * 2**30), ("512Mi", 512 * 2**20), ("1.5G", 1_500_000_000), ("64k", 64_000),
     ("1Ti", 2**40), ("1T", 10**12), ("1000", 1000)],
)  # fmt: skip
def test_memory_units(memory, expected):
    assert parse_memory(memory) == expected
    assert d.Compute(memory=memory).memory_bytes == expected


@pytest.mark.parametrize("memory", ["abc", "2GB", "2 gigs", "", "1ki", "-1Gi"])
def test_bad_memory_says_which_units_exist(memory):
    line = one_problem(d.Compute, memory=memory)
    assert line.startswith("Compute.memory: ") and "Ki, Mi, Gi, Ti, Pi, Ei" in line


def test_availability_model_takes_member_or_string():
    assert d.Compute(availability_model=d.AvailabilityModel.SPOT).availability_model == "spot"
    assert d.Compute(availability_model="SPOT").availability_model is d.AvailabilityModel.SPOT
    assert "'dedicated', 'spot'" in one_problem(d.Compute, availability_model="cheap")


def test_unknown_keys_are_rejected_with_the_allowed_fields():
    line = one_problem(d.Compute, cpus=4)
    assert line == (
        "Compute: unknown field 'cpus'; allowed fields: node_count, cpu_count, memory, "
        "accelerator, availability_model"
    )


def test_where_baseten_keeps_unknown_keys_they_load_and_push_says_they_are_ignored():
    """truss's ConfigModel (WeightsSource, AcceleratorSpec, Checkpoint, LoRADetails) allows
    extra keys and coerces values; a config that relies on it loads here too."""
    weights = d.WeightsSource(source="hf://a/b", mount_location="/m", revision="main")
    accelerator = d.AcceleratorSpec(accelerator="H100", count="8", interconnect="nvlink")
    assert accelerator.count == 8
    assert d.LoRADetails(rank="64", alpha=32).rank == 64
    assert d.FullCheckpoint(training_job_id="j", checkpoint_name="c", step=5).model_extra
    job = d.TrainingJob(
        image=d.Image(base_image="x"), compute=d.Compute(accelerator=accelerator), weights=[weights]
    )
    notices = check_support(job).notices
    assert any(n.startswith("weights[0]: 'revision' is not a field") for n in notices)
    assert any(n.startswith("compute.accelerator: 'interconnect' is not a field") for n in notices)


def test_assignment_is_validated():
    compute = d.Compute()
    with pytest.raises(ValidationError):
        compute.node_count = 0


# --- runtime -----------------------------------------------------------------------------------


def test_environment_variables_take_strings_and_secret_references():
    runtime = d.Runtime(
        environment_variables={
            "PLAIN": "1",
            "HF_TOKEN": d.SecretReference(name="hf_access_token"),
            "WANDB_API_KEY": {"name": "wandb"},
        }
    )
    assert runtime.environment_variables["WANDB_API_KEY"] == d.SecretReference(name="wandb")
    assert set(runtime.secret_references()) == {"HF_TOKEN", "WANDB_API_KEY"}


def test_environment_variable_values_must_be_strings():
    line = one_problem(d.Runtime, environment_variables={"EPOCHS": 5})
    assert line == (
        "Runtime.environment_variables.EPOCHS: must be a string or SecretReference(name=...), "
        "not int 5"
    )


def test_environment_variable_names_are_checked():
    line = one_problem(d.Runtime, environment_variables={"1BAD": "x", "GOOD": "y"})
    assert line.startswith("Runtime.environment_variables.1BAD: is not an environment variable")


def test_enable_cache_is_migrated_to_cache_config():
    runtime = d.Runtime(enable_cache=True)
    assert runtime.cache_config == d.CacheConfig(enabled=True, enable_legacy_hf_mount=True)
    assert runtime.enable_cache is None
    assert d.Runtime(enable_cache=False).cache_config == d.CacheConfig()


def test_enable_cache_and_cache_config_together_is_an_error():
    line = one_problem(d.Runtime, enable_cache=True, cache_config=d.CacheConfig(enabled=True))
    assert line == "Runtime.enable_cache: is deprecated: set cache_config only, not both"


def test_paths_must_be_absolute():
    assert "absolute" in one_problem(d.CheckpointingConfig, checkpoint_path="ckpts")
    assert "absolute" in one_problem(d.CacheConfig, mount_base_path="cache")
    assert "absolute" in one_problem(d.LoadCheckpointConfig, download_folder="here")


def test_volume_size_must_be_positive():
    assert "CheckpointingConfig.volume_size_gib" in one_problem(
        d.CheckpointingConfig, volume_size_gib=0
    )


def test_blank_start_command_is_rejected():
    assert "empty" in one_problem(d.Runtime, start_commands=["python train.py", "  "])


# --- names -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "why"),
    [("", "must not be empty"), ("   ", "must not be empty"),
     ("two\nlines", "contains a control character"), ("tab\there", "control character"),
     ("x" * 257, "is 257 characters long; at most 256")],
)  # fmt: skip
def test_project_and_job_names_refuse_only_what_cannot_be_a_name(name, why):
    line = one_problem(d.TrainingProject, name=name, job=d.TrainingJob(image=image()))
    assert line.startswith("TrainingProject.name: ") and why in line
    line = one_problem(d.TrainingJob, image=image(), name=name)
    assert line.startswith("TrainingJob.name: ") and why in line


@pytest.mark.parametrize(
    "name", ["demo/qwen3-0.6b", "..", ".hidden", "-lead", "x" * 256, "end.", "trailing ",
             "검색 모델", "llama 3.1 (8B) → sft", "a/b/../c"],
)  # fmt: skip
def test_every_name_baseten_accepts_is_accepted(name):
    project = d.TrainingProject(name=name, job=d.TrainingJob(image=image(), name=name))
    assert project.name == project.job.name == name


@pytest.mark.parametrize(
    "name", ["a/b", "..", ".hidden", "-lead", "x" * 129, "", "end.", "trailing "]
)
def test_team_names_must_be_safe_path_segments(name):
    job = d.TrainingJob(image=image())
    line = one_problem(d.TrainingProject, name="p", team_name=name, job=job)
    assert line.startswith("TrainingProject.team_name: ") and "not a safe name" in line


@pytest.mark.parametrize(
    "name", ["llama-8b", "run_2", "v1.2", "A", "Axolotl 20B 1 Node", "gpt-oss (lora)"]
)
def test_good_names_pass(name):
    project = d.TrainingProject(
        name=name, team_name=name, job=d.TrainingJob(image=image(), name=name)
    )
    assert project.name == project.team_name == project.job.name == name


def test_secret_names_are_checked():
    assert "not a secret name" in one_problem(d.SecretReference, name="my secret")


# --- checkpoints -------------------------------------------------------------------------------


def test_checkpoint_references():
    latest = d.BasetenCheckpoint.from_latest_checkpoint(project_name="proj")
    named = d.BasetenCheckpoint.from_named_checkpoint("checkpoint-100", job_id="abc123")
    loops = d.LoopsCheckpoint.from_checkpoint("run1", "step-5", target="sampler")
    config = d.LoadCheckpointConfig(enabled=True, checkpoints=[latest, named, loops])
    assert [c.typ for c in config.checkpoints] == [
        "baseten_latest_checkpoint",
        "baseten_named_checkpoint",
        "loops_checkpoint",
    ]
    assert config.checkpoints[1].checkpoint_name == "checkpoint-100"


def test_latest_checkpoint_needs_a_project_or_job():
    with pytest.raises(ValueError, match="needs project_name, job_id or both"):
        d.BasetenCheckpoint.from_latest_checkpoint()


def test_checkpoint_references_from_dicts_are_tagged_by_typ():
    config = d.LoadCheckpointConfig(
        checkpoints=[{"typ": "baseten_named_checkpoint", "checkpoint_name": "c-1", "job_id": "j"}]
    )
    assert config.checkpoints[0] == d.BasetenCheckpoint.from_named_checkpoint("c-1", "j")
    lines = problems(
        d.LoadCheckpointConfig, checkpoints=[{"typ": "baseten_named_checkpoint", "job_id": "j/k"}]
    )
    assert lines == [
        "LoadCheckpointConfig.checkpoints[0].checkpoint_name: is required",
        "LoadCheckpointConfig.checkpoints[0].job_id: 'j/k' is not a safe name: use 1-128 "
        "letters, digits, spaces, '.', '_', '-', '+' or parentheses, starting with a letter or "
        "digit and not ending with '.' or a space",
    ]


def test_enabled_load_needs_a_checkpoint():
    line = one_problem(d.LoadCheckpointConfig, enabled=True, checkpoints=[])
    assert line.startswith("LoadCheckpointConfig.checkpoints: is empty but enabled is true")


# --- weights -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    [
        "hf://meta-llama/Llama-3.1-8B",
        "hf://meta-llama/Llama-3.1-8B@main",
        "hf://gpt2",
        "hf://datasets/HuggingFaceFW/fineweb@3c4d5e6",
        "s3://bucket/path/to/weights",
        "gs://bucket/data",
        "r2://abc123.bucket/path",
        "cw://bucket/path/to/weights",
        "cw://my-bucket.v2/model.safetensors",
        "azure://account/container/path",
        "https://example.com/model.safetensors",
    ],
)
def test_weight_sources_accepted(source):
    w = d.WeightsSource(source=source, mount_location="/app/models/x")
    assert w.scheme == source.split("://")[0]
    assert w.is_huggingface == source.startswith("hf://")


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ("bucket/path", "has no scheme"),
        ("ftp://host/file", "scheme ftp:// is not supported"),
        ("s3://bucket", "needs a bucket and a path"),
        ("s3://bucket//abs", "needs a bucket and a path"),
        ("s3://bucket/path@v2", "revision (@...) is only allowed on hf://"),
        ("r2://bucket/path", "must name the account"),
        ("cw://bucket", "needs a bucket and a path: cw://bucket/path"),
        ("cw:///path", "needs a bucket and a path: cw://bucket/path"),
        ("cw://bucket//abs", "needs a bucket and a path: cw://bucket/path"),
        ("cw://bucket/path@v2", "revision (@...) is only allowed on hf://"),
        ("cw:/bucket/path", "has no scheme"),
        ("ftp://host/file", "use one of hf://, s3://, gs://, r2://, cw://, azure://, https://"),
        ("azure://account/container", "needs a container and a path"),
        ("https://example.com", "needs a host and a file path"),
        ("hf://a/b/c", "not a Hugging Face source"),
        ("bdn:ns/vol:tag", "has no scheme"),
    ],
)
def test_bad_weight_sources_are_explained(source, reason):
    line = one_problem(d.WeightsSource, source=source, mount_location="/m")
    assert line.startswith("WeightsSource.source: ") and reason in line


@pytest.mark.parametrize("mount", ["models", "/", "/app/../etc", "//"])
def test_mount_location_must_be_an_absolute_directory(mount):
    line = one_problem(d.WeightsSource, source="s3://b/p", mount_location=mount)
    assert line.startswith("WeightsSource.mount_location: ")


def test_duplicate_and_nested_mounts_are_rejected():
    w = [
        d.WeightsSource(source="hf://a/b", mount_location="/app/model"),
        d.WeightsSource(source="s3://b/p", mount_location="/app/model/"),
    ]
    assert one_problem(d.TrainingJob, image=image(), weights=w) == (
        "TrainingJob.weights[1].mount_location: weights[0] mounts at /app/model too: "
        "mount each source at its own directory"
    )
    w[1] = d.WeightsSource(source="s3://b/p", mount_location="/app/model/tokenizer")
    line = one_problem(d.TrainingJob, image=image(), weights=w)
    assert line.startswith("TrainingJob.weights[1].mount_location: /app/model/tokenizer and")
    assert "are nested" in line
    w[1] = d.WeightsSource(source="s3://b/p", mount_location="/app/model-2")
    assert len(d.TrainingJob(image=image(), weights=w).weights) == 2


def test_weights_auth_fields_follow_the_method():
    auth = d.WeightsAuth(auth_method="custom_secret", auth_secret_name="aws_creds")
    assert auth.auth_method is d.WeightsAuthMethod.CUSTOM_SECRET
    w = d.WeightsSource(source="s3://b/p", mount_location="/m", auth=auth)
    assert w.secret_name == "aws_creds"
    assert one_problem(d.WeightsAuth, auth_method="AWS_OIDC") == (
        "WeightsAuth.aws_oidc_role_arn: is required with auth_method AWS_OIDC "
        "(so are aws_oidc_region)"
    )
    assert (
        one_problem(
            d.WeightsAuth, auth_method="CUSTOM_SECRET", auth_secret_name="s", aws_oidc_region="x"
        )
        == "WeightsAuth.aws_oidc_region: does not belong to auth_method CUSTOM_SECRET"
    )
    line = one_problem(
        d.WeightsSource, source="s3://b/p", mount_location="/m", auth=auth, auth_secret_name="s2"
    )
    assert line.startswith("WeightsSource.auth_secret_name: ") and "not both" in line


# --- docker auth -------------------------------------------------------------------------------


def test_docker_auth_needs_exactly_the_matching_sub_config():
    iam = d.AWSIAMDockerAuth(
        access_key_secret_ref=d.SecretReference(name="ak"),
        secret_access_key_secret_ref=d.SecretReference(name="sk"),
    )
    auth = d.DockerAuth(
        auth_method=d.DockerAuthType.AWS_IAM, registry="123.dkr.ecr.aws", aws_iam_docker_auth=iam
    )
    assert {r.name for r in auth.secret_references()} == {"ak", "sk"}
    assert one_problem(d.DockerAuth, auth_method=d.DockerAuthType.AWS_IAM, registry="r") == (
        "DockerAuth.aws_iam_docker_auth: is required with auth_method AWS_IAM"
    )
    line = one_problem(
        d.DockerAuth,
        auth_method=d.DockerAuthType.AWS_IAM,
        registry="r",
        aws_iam_docker_auth=iam,
        registry_secret_docker_auth=d.RegistrySecretDockerAuth(
            secret_ref=d.SecretReference(name="x")
        ),
    )
    assert line == (
        "DockerAuth.registry_secret_docker_auth: must not be set with auth_method AWS_IAM"
    )


def test_job_lists_every_secret_it_names():
    job = d.TrainingJob(
        image=d.Image(
            base_image="private/img",
            docker_auth=d.DockerAuth(
                auth_method=d.DockerAuthType.REGISTRY_SECRET,
                registry="ghcr.io",
                registry_secret_docker_auth=d.RegistrySecretDockerAuth(
                    secret_ref=d.SecretReference(name="ghcr")
                ),
            ),
        ),
        runtime=d.Runtime(environment_variables={"T": d.SecretReference(name="hf")}),
        weights=[d.WeightsSource(source="s3://b/p", mount_location="/d", auth_secret_name="aws")],
    )
    assert sorted(r.name for r in job.secret_references()) == ["aws", "ghcr", "hf"]


# --- deploy side -------------------------------------------------------------------------------


def test_lora_rank_is_any_positive_rank_as_in_truss_0_18_36():
    assert d.LoRADetails(rank=7).rank == 7
    assert "LoRADetails.rank" in one_problem(d.LoRADetails, rank=0)


def test_checkpoint_formats_are_set_by_class():
    assert d.FullCheckpoint(training_job_id="j", checkpoint_name="c").model_weight_format == "full"
    lora = d.LoRACheckpoint(training_job_id="j", checkpoint_name="c")
    assert lora.model_weight_format is d.ModelWeightsFormat.LORA and lora.lora_details.rank == 16
    line = one_problem(d.CheckpointList, checkpoints=[lora], loops_checkpoint_ids=["x"])
    assert line == "CheckpointList.loops_checkpoint_ids: set checkpoints or this, not both"


# --- serialisation -----------------------------------------------------------------------------


def test_project_round_trips_through_json_with_secrets_as_references():
    project = d.TrainingProject(
        name="p",
        job=d.TrainingJob(
            image=image(),
            compute=d.Compute(node_count=2, accelerator="H100:8"),
            runtime=d.Runtime(environment_variables={"TOKEN": d.SecretReference(name="tok")}),
        ),
    )
    text = project.model_dump_json()
    assert '"TOKEN":{"name":"tok"}' in text
    assert '"accelerator":{"accelerator":"H100","count":8}' in text
    assert d.TrainingProject.model_validate_json(text) == project


def test_errors_found_across_fields_name_the_leaf_field():
    job = {"image": {"base_image": "x"}}
    runtime = {"start_commands": ["echo ok", " "], "environment_variables": {"1BAD": "x"}}
    assert problems(d.TrainingProject, name="p", job={**job, "runtime": runtime}) == [
        "TrainingProject.job.runtime.start_commands[1]: is empty",
        "TrainingProject.job.runtime.environment_variables.1BAD: is not an environment "
        "variable name: letters, digits and '_', not starting with a digit",
    ]
    compute = {"accelerator": {"accelerator": "H100", "count": 0}}
    assert one_problem(d.TrainingProject, name="p", job={**job, "compute": compute}) == (
        "TrainingProject.job.compute.accelerator.count: must be at least 1 when accelerator is H100"
    )

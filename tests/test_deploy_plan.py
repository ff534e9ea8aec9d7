"""What deploy_checkpoints decides before anything runs: which checkpoints, which engine and why,
the LoRA base model, names, resources, and the configs Ray Serve and Ray Serve LLM read.

No Ray: manifests are built here; the vLLM config is checked with Ray Serve LLM's own schema and
its adapters copied on the session's S3 server.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest
from ray.llm._internal.serve.core.configs.llm_config import LLMConfig
from ray.serve.schema import ServeDeploySchema

from orchestrator import definitions as d
from orchestrator.client.config_loader import load_deploy_config
from orchestrator.errors import ConfigError, UnsupportedFeatureError
from orchestrator.serving.plan import (
    Chosen,
    application,
    plan_deployment,
    resolve_base,
    serve_config,
)
from orchestrator.serving.vllm_app import llm_config
from orchestrator.storage.checkpoints import CheckpointStore, Manifest, ManifestFile
from orchestrator.storage.records import ArchiveRef, JobRecord
from orchestrator.storage.root import StorageRoot

NODE_CKPTS = "/tmp/orchestrator/jobs/j1/rank-0/checkpoints"
FULL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def record(storage_root: str = "/srv/root", weights: list[d.WeightsSource] = ()) -> JobRecord:
    job = d.TrainingJob(image=d.Image(base_image="x"), weights=list(weights))
    archive = ArchiveRef(path="a.tar", sha256="x", size_bytes=1, file_count=1, config_dir=".")
    return JobRecord(job_id="j1", project="tiny-lora", created_at=time.time(),
                     spec=d.TrainingProject(name="tiny-lora", job=job), archive=archive,
                     storage_root=storage_root)  # fmt: skip


def manifest(name: str, files: tuple[str, ...] = FULL_FILES, kind: str = "full") -> Manifest:
    listed = [ManifestFile(path=f, size=1, sha256="x") for f in files]
    return Manifest(project="p1", job_id="j1", node_rank=0, name=name, version=1, files=listed,
                    size_bytes=len(files), created_at=0.0, checkpoint_type=kind)  # fmt: skip


def full(name: str = "checkpoint-30", job: JobRecord | None = None) -> Chosen:
    return Chosen(manifest(name), job or record())


def lora(name: str = "lora-checkpoint-30", base: str = f"{NODE_CKPTS}/checkpoint-0",
         r: int = 8, job: JobRecord | None = None) -> Chosen:  # fmt: skip
    files = ("adapter_config.json", "adapter_model.safetensors")
    return Chosen(manifest(name, files, "lora"), job or record(),
                  adapter_config={"r": r, "base_model_name_or_path": base})  # fmt: skip


def config(**fields) -> d.DeployCheckpointsConfig:
    return d.DeployCheckpointsConfig(**fields)


def test_a_full_checkpoint_is_served_alone_under_the_project_name():
    plan = plan_deployment(config(), [full()])
    assert plan.model.full is not None and plan.model.full.name == "checkpoint-30"
    assert plan.model.model_ids() == ["tiny-lora"]
    assert plan.model.engine == "transformers" and "no GPU" in plan.engine_reason
    with pytest.raises(ConfigError, match="served alone"):
        plan_deployment(config(), [full(), lora()])
    with pytest.raises(ConfigError, match="no tokenizer files"):
        plan_deployment(config(), [Chosen(manifest("checkpoint-9", ("model.safetensors",)),
                                          record())])  # fmt: skip


def test_an_adapters_base_path_on_the_training_node_is_the_jobs_stored_checkpoint():
    plan = plan_deployment(config(), [lora(), lora("lora-checkpoint-60")],
                           full_checkpoints=[manifest("checkpoint-0")])  # fmt: skip
    base = plan.model.base
    assert base is not None and base.checkpoint is not None
    assert base.checkpoint.key == "j1/rank-0/checkpoint-0"
    assert plan.model.model_ids() == [
        "tiny-lora", "tiny-lora:lora-checkpoint-30", "tiny-lora:lora-checkpoint-60"
    ]  # fmt: skip
    assert plan.model.adapters["lora-checkpoint-30"].lora_rank == 8


@pytest.mark.parametrize(
    ("base_id", "kind", "name"),
    [
        ("Qwen/Qwen3-0.6B", "hf_repo", "Qwen3-0.6B"),
        ("s3://models/llama-3b", "weights", "llama-3b"),
        ("/app/models/qwen", "weights", "Qwen3-0.6B"),  # the job's `weights` mount
        ("/shared/models/gemma", "path", "gemma"),
    ],
)
def test_where_a_base_model_is_found_and_the_name_it_suggests(base_id, kind, name):
    mount = d.WeightsSource(source="hf://Qwen/Qwen3-0.6B", mount_location="/app/models/qwen")
    base, suggested = resolve_base(base_id, record(weights=[mount]), [])
    assert getattr(base, kind) is not None and suggested == name
    if base_id == "/app/models/qwen":
        assert base.weights["source"] == "hf://Qwen/Qwen3-0.6B"


def test_adapters_of_different_bases_or_of_none_are_refused_and_a_base_can_be_given():
    with pytest.raises(ConfigError, match="different base models"):
        plan_deployment(config(), [lora(), lora("lora-checkpoint-60", base="org/other")])
    with pytest.raises(ConfigError, match="base_model_id"):
        plan_deployment(config(), [Chosen(manifest("lora-checkpoint-30"), record(),
                                          adapter_config={"r": 8})])  # fmt: skip
    given = config(checkpoint_details=d.CheckpointList(base_model_id="org/Base Model 7B"))
    plan = plan_deployment(given, [lora(base="ignored/when-given")])
    assert plan.model.base is not None and plan.model.base.hf_repo == "org/Base Model 7B"
    assert plan.name == "Base-Model-7B"  # Baseten's allowed characters


def test_a_listed_format_that_does_not_match_the_checkpoint_is_an_error():
    wrong = Chosen(manifest("checkpoint-30"), record(),
                   requested_format=d.ModelWeightsFormat.LORA)  # fmt: skip
    with pytest.raises(ConfigError, match="listed as lora"):
        plan_deployment(config(), [wrong])
    whisper = Chosen(manifest("checkpoint-30"), record(),
                     requested_format=d.ModelWeightsFormat.WHISPER)  # fmt: skip
    with pytest.raises(UnsupportedFeatureError, match="Whisper"):
        plan_deployment(config(), [whisper])


def test_gpus_choose_vllm_and_resources_reach_the_serve_config():
    gpu = d.Compute(cpu_count=4, memory="16Gi", accelerator="H100:2")
    plan = plan_deployment(config(compute=gpu), [full()])
    assert plan.model.engine == "vllm" and "H100:2" in plan.engine_reason
    app = application(plan)
    assert app["import_path"] == "orchestrator.serving.vllm_app:build_app"
    assert app["args"]["compute"]["accelerator"] == {"accelerator": "H100", "count": 2}

    forced = plan_deployment(config(compute=gpu), [full()], engine="transformers")
    options = application(forced)["deployments"][0]["ray_actor_options"]
    assert options == {"num_cpus": 4, "memory": 16 * 1024**3, "num_gpus": 2,
                       "accelerator_type": "H100"}  # fmt: skip
    parsed = ServeDeploySchema.model_validate(serve_config([application(forced)], "0.0.0.0", 8000))
    assert parsed.applications[0].route_prefix == "/tiny-lora"

    secret = d.DeployCheckpointsRuntime(
        environment_variables={"HF_TOKEN": d.SecretReference(name="hf_access_token")}
    )
    with pytest.raises(UnsupportedFeatureError, match="HF_TOKEN"):
        plan_deployment(config(compute=gpu, runtime=secret), [full()])
    kept = plan_deployment(config(runtime=secret), [full()])
    assert kept.model.secret_env == {"HF_TOKEN": "hf_access_token"}  # a name, never a value


def test_the_vllm_config_is_one_ray_serve_llm_accepts_with_adapters_published(s3_server, tmp_path):
    root = StorageRoot(f"s3://b-{uuid.uuid4().hex[:8]}/root")
    root.fs.mkdir(root.url.removeprefix("s3://").split("/")[0])
    store = CheckpointStore(root)
    for name, files in {
        "checkpoint-0": {"config.json": b"{}", "tokenizer.json": b"{}"},
        "lora-checkpoint-30": {"adapter_config.json": json.dumps({"r": 20}).encode(),
                               "adapter_model.safetensors": b"weights"},
    }.items():  # fmt: skip
        local = tmp_path / name
        local.mkdir()
        for rel, data in files.items():
            (local / rel).write_bytes(data)
        store.upload(local, "p1", "j1", 0)
    job = record(storage_root=root.url)
    adapter = lora(r=20, job=job).adapter_config
    chosen = [Chosen(store.manifest("p1", "j1", 0, "lora-checkpoint-30"), job, adapter)]
    gpu = d.Compute(accelerator="L4:1")
    fulls = [store.manifest("p1", "j1", 0, "checkpoint-0")]
    plan = plan_deployment(config(compute=gpu), chosen, full_checkpoints=fulls)
    built = llm_config(plan.model, gpu, publish=True)
    LLMConfig.model_validate(built)  # Ray Serve LLM's own schema
    assert built["model_loading_config"]["model_source"]["bucket_uri"].startswith(root.url)
    assert built["engine_kwargs"]["max_lora_rank"] == 32  # the smallest vLLM rank holding r=20
    assert built["engine_kwargs"]["max_loras"] == 1  # on GPUs, a slot per adapter
    # On CPUs one more, left empty: vLLM's CPU kernels read "no adapter" as the last slot.
    assert llm_config(plan.model, None)["engine_kwargs"]["max_loras"] == 2
    assert built["accelerator_type"] == "L4"
    published = "serving/tiny-lora/adapters/lora-checkpoint-30/adapter_model.safetensors"
    assert root.read_bytes(published) == b"weights"  # where Ray Serve LLM looks for it
    assert (
        built["lora_config"]["dynamic_lora_loading_path"]
        == f"{root.url}/serving/tiny-lora/adapters"
    )


def test_the_vllm_config_on_cpu_nodes_holds_their_cpus_and_no_gpu(tmp_path):
    """vLLM's CPU build: Ray Serve LLM would ask for a GPU, and a CPU each for its replica and
    ingress, beyond the engine's; here the engine's bundle holds `cpu_count` CPUs, in float32."""
    root = StorageRoot(str(tmp_path / "root"))
    local = tmp_path / "checkpoint-30"
    local.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (local / name).write_text("{}")
    CheckpointStore(root).upload(local, "p1", "j1", 0)
    chosen = [Chosen(CheckpointStore(root).manifest("p1", "j1", 0, "checkpoint-30"),
                     record(storage_root=root.url))]  # fmt: skip
    cpu = d.Compute(cpu_count=3, memory="8Gi")
    plan = plan_deployment(config(compute=cpu), chosen, engine="vllm")
    built = llm_config(plan.model, cpu)
    parsed = LLMConfig.model_validate(built)  # Ray Serve LLM's own schema
    assert parsed.accelerator_config.kind == "cpu"
    assert built["placement_group_config"] == {"bundles": [{"CPU": 3}]}
    assert built["deployment_config"]["ray_actor_options"] == {"num_cpus": 0}
    assert built["engine_kwargs"]["dtype"] == "float32"
    assert built["runtime_env"]["env_vars"]["VLLM_CPU_KVCACHE_SPACE"] == "2"  # 8 GiB / 4
    assert "/checkpoint-30/" in built["model_loading_config"]["model_source"]  # the stored files


def test_a_deploy_config_file_loads_with_the_field_path_on_error(tmp_path: Path):
    good = tmp_path / "deploy.py"
    good.write_text(
        "from orchestrator.definitions import DeployCheckpointsConfig, CheckpointList\n"
        "deploy = DeployCheckpointsConfig(model_name='m', checkpoint_details=CheckpointList("
        "base_model_id='org/base'))\n"
    )
    assert load_deploy_config(good).model_name == "m"
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from orchestrator.definitions import DeployCheckpointsConfig, LoRADetails\n"
        "deploy = DeployCheckpointsConfig(model_name='m')\n"
        "deploy.model_name = 3\n"
    )
    with pytest.raises(ConfigError, match="model_name"):
        load_deploy_config(bad)
    none = tmp_path / "none.py"
    none.write_text("x = 1\n")
    with pytest.raises(ConfigError, match="0 DeployCheckpointsConfigs"):
        load_deploy_config(none)

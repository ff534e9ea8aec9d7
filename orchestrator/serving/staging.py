"""On a serving node, before the engine starts: variables set, secrets resolved, checkpoints local.

Checkpoints are downloaded from the storage root (each file checked against its manifest) into
`download_folder/<job>/rank-<r>/<name>/v<version>`, so replicas on one node share a copy and a
newer upload of the same name is never mistaken for it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.errors import OrchestratorError, StagingError
from orchestrator.node.secrets import resolve_secret
from orchestrator.node.weight_sources import open_source
from orchestrator.serving.served_model import BaseModelSource, ServedModel, StoredCheckpoint
from orchestrator.spec.weights import WeightsSource
from orchestrator.storage.checkpoints import CheckpointStore
from orchestrator.storage.root import StorageRoot


@dataclass(frozen=True)
class StagedModel:
    """Local directories an engine loads: the model (or base), and each adapter by model id."""

    model_dir: str  # a directory, or a Hugging Face repo id (`hf_repo` bases)
    adapters: dict[str, Path] = field(default_factory=dict)


def set_environment(model: ServedModel) -> None:
    """The deployment's variables, secrets resolved here and never written anywhere else."""
    os.environ.update(model.env)
    for variable, secret in model.secret_env.items():
        os.environ[variable] = resolve_secret(secret, model.team)


def stage(model: ServedModel) -> StagedModel:
    """Everything the engine loads, local (downloaded once per node)."""
    root = StorageRoot(model.storage_root)
    folder = Path(model.download_folder)
    if model.full is not None:
        model_dir = str(download_checkpoint(root, model.full, folder))
    elif model.base is not None:
        model_dir = _base_model(root, model.base, folder)
    else:
        raise StagingError(f"{model.name}: neither a full checkpoint nor a base model to serve")
    adapters = {
        model.adapter_id(name): download_checkpoint(root, ckpt, folder)
        for name, ckpt in model.adapters.items()
    }
    return StagedModel(model_dir, adapters)


def download_checkpoint(root: StorageRoot, ckpt: StoredCheckpoint, folder: Path) -> Path:
    manifest = CheckpointStore(root).manifest(ckpt.project_id, ckpt.job_id, ckpt.rank, ckpt.name)
    if manifest is None:
        raise StagingError(f"checkpoint {ckpt.key} is not in the storage root {root.url}")
    if not manifest.complete:
        raise StagingError(f"checkpoint {ckpt.key} is incomplete: {manifest.incomplete_reason}")
    dest = folder / ckpt.job_id / f"rank-{ckpt.rank}" / ckpt.name / f"v{manifest.version or 0}"

    def fetch(tmp: Path) -> None:
        CheckpointStore(root).download(manifest, tmp)

    return _once(dest, fetch)


def _base_model(root: StorageRoot, base: BaseModelSource, folder: Path) -> str:
    if base.checkpoint is not None:
        return str(download_checkpoint(root, base.checkpoint, folder))
    if base.weights is not None:
        spec = WeightsSource.model_validate(base.weights)
        secret = resolve_secret(spec.auth_secret_name) if spec.auth_secret_name else None
        digest = hashlib.sha256(spec.source.encode()).hexdigest()[:16]

        def fetch(tmp: Path) -> None:
            source = open_source(spec, secret)
            source.resolve()
            for f in source.files():
                source.fetch(f.path, tmp / f.path)

        return str(_once(folder / "base-models" / digest, fetch))
    if base.path is not None:
        if not Path(base.path, "config.json").is_file():
            raise StagingError(
                f"base model {base.path} is not a model directory on this node (no config.json): "
                "set checkpoint_details.base_model_id to where the base model is stored"
            )
        return base.path
    assert base.hf_repo is not None
    return base.hf_repo


def _once(dest: Path, fetch: Callable[[Path], None]) -> Path:
    """`dest`, filled by `fetch(tmp)` into a sibling and renamed into place, unless it is there."""
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        fetch(tmp)
        try:
            tmp.rename(dest)
        except OSError:
            if not dest.is_dir():  # not another replica's copy, renamed first
                raise
    except Exception as e:
        if isinstance(e, OrchestratorError):
            raise
        raise StagingError(f"could not fetch {dest.name} into {dest.parent}: {e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest

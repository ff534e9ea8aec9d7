"""On a serving node, before the engine starts: variables set, secrets resolved, checkpoints local.

Checkpoints are downloaded from the storage root (each file checked against its manifest) into
`download_folder/<job>/rank-<r>/<name>/v<version>`, so replicas on one node share a copy and a
newer upload of the same name is never mistaken for it. Each replica holds the copies it
loaded (a marker `.<copy>.users/<pid>-<token>@<host>` beside each) and lets go of them when Serve
stops it (`release`, from the replica's `__del__`): the last holder on the node removes the
copy, so a stopped deployment leaves no checkpoints on the node's disk. A marker whose process
is gone (a replica that crashed) holds nothing: the next replica staged on the node removes what
only such markers held (`sweep`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Callable, Iterator
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
    held: tuple[Holding, ...] = ()  # the copies this replica downloaded or shares


@dataclass(frozen=True)
class Holding:
    """One replica's hold on one downloaded copy (`release` lets go)."""

    copy: Path
    marker: Path
    folder: Path  # download_folder: the directories between it and the copy are ours


def set_environment(model: ServedModel) -> None:
    """The deployment's variables, secrets resolved here and never written anywhere else."""
    os.environ.update(model.env)
    for variable, secret in model.secret_env.items():
        os.environ[variable] = resolve_secret(secret, model.team)


def stage(model: ServedModel) -> StagedModel:
    """Everything the engine loads, local (downloaded once per node)."""
    root = StorageRoot(model.storage_root)
    folder = Path(model.download_folder)
    held: list[Holding] = []
    sweep(folder)
    try:
        if model.full is not None:
            model_dir = str(download_checkpoint(root, model.full, folder, held))
        elif model.base is not None:
            model_dir = _base_model(root, model.base, folder, held)
        else:
            raise StagingError(f"{model.name}: neither a full checkpoint nor a base model to serve")
        adapters = {
            model.adapter_id(name): download_checkpoint(root, ckpt, folder, held)
            for name, ckpt in model.adapters.items()
        }
    except BaseException:
        release(held)  # a replica that failed to start holds nothing
        raise
    return StagedModel(model_dir, adapters, tuple(held))


def release(held: list[Holding] | tuple[Holding, ...]) -> None:
    """Let go of these copies; one no live replica holds any more is removed, with the
    directories above it that it leaves empty (up to `download_folder`)."""
    for holding in held:
        with _locked(holding.folder):
            holding.marker.unlink(missing_ok=True)
        _remove_unless_held(holding.copy, holding.folder)


def sweep(folder: Path) -> None:
    """Remove the copies in `folder` that only replicas now gone held: one that crashed never
    let go. Called as a replica stages, so a node's disk does not keep them for good."""
    if not folder.is_dir():
        return
    for users in [*folder.glob("*/rank-*/*/.*.users"), *folder.glob("base-models/.*.users")]:
        _remove_unless_held(users.with_name(users.name[1 : -len(".users")]), folder)


def _remove_unless_held(copy: Path, folder: Path) -> None:
    gone = copy.with_name(f".{copy.name}.gone-{uuid.uuid4().hex[:8]}")
    with _locked(folder):
        users = _users(copy)
        with contextlib.suppress(OSError):
            if any(_alive(marker) for marker in users.iterdir()):
                return
        with contextlib.suppress(OSError):
            copy.rename(gone)  # out of the way at once; deleted unlocked below
        shutil.rmtree(users, ignore_errors=True)
    shutil.rmtree(gone, ignore_errors=True)  # gigabytes, maybe: other replicas go on
    with _locked(folder):
        parent = copy.parent
        while parent != folder and folder in parent.parents:
            try:
                parent.rmdir()  # job/rank-r/name above a checkpoint's v<n>, while empty
            except OSError:
                break
            parent = parent.parent


def download_checkpoint(
    root: StorageRoot, ckpt: StoredCheckpoint, folder: Path, held: list[Holding]
) -> Path:
    manifest = CheckpointStore(root).manifest(ckpt.project_id, ckpt.job_id, ckpt.rank, ckpt.name)
    if manifest is None:
        raise StagingError(f"checkpoint {ckpt.key} is not in the storage root {root.url}")
    if not manifest.complete:
        raise StagingError(f"checkpoint {ckpt.key} is incomplete: {manifest.incomplete_reason}")
    dest = folder / ckpt.job_id / f"rank-{ckpt.rank}" / ckpt.name / f"v{manifest.version or 0}"

    def fetch(tmp: Path) -> None:
        CheckpointStore(root).download(manifest, tmp)

    return _once(dest, fetch, held, folder)


def _base_model(root: StorageRoot, base: BaseModelSource, folder: Path, held: list[Holding]) -> str:
    if base.checkpoint is not None:
        return str(download_checkpoint(root, base.checkpoint, folder, held))
    if base.weights is not None:
        spec = WeightsSource.model_validate(base.weights)
        secret = resolve_secret(spec.auth_secret_name) if spec.auth_secret_name else None
        digest = hashlib.sha256(spec.source.encode()).hexdigest()[:16]

        def fetch(tmp: Path) -> None:
            source = open_source(spec, secret)
            source.resolve()
            for f in source.files():
                source.fetch(f.path, tmp / f.path)

        return str(_once(folder / "base-models" / digest, fetch, held, folder))
    if base.path is not None:
        if not Path(base.path, "config.json").is_file():
            raise StagingError(
                f"base model {base.path} is not a model directory on this node (no config.json): "
                "set checkpoint_details.base_model_id to where the base model is stored"
            )
        return base.path
    assert base.hf_repo is not None
    return base.hf_repo


def _once(dest: Path, fetch: Callable[[Path], None], held: list[Holding], folder: Path) -> Path:
    """`dest`, filled by `fetch(tmp)` into a sibling and renamed into place, unless it is there;
    held by this replica before it is looked for, so no other replica's `release` removes it."""
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder):
        dest.parent.mkdir(parents=True, exist_ok=True)
        users = _users(dest)
        users.mkdir(exist_ok=True)
        marker = users / f"{os.getpid()}-{uuid.uuid4().hex[:8]}@{socket.gethostname()}"
        marker.touch()
    held.append(Holding(dest, marker, folder))
    if dest.is_dir():
        return dest
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


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """The replicas of this node one at a time, while they take or let go of copies in
    `folder` (a lock file there, never removed: a waiter would hold a deleted one)."""
    with open(folder / ".staging.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _users(copy: Path) -> Path:
    return copy.with_name(f".{copy.name}.users")


def _alive(marker: Path) -> bool:
    """A marker's process still runs: `<pid>-<token>@<host>`. One of another host (a
    download_folder on a filesystem several nodes share) is taken as alive: it cannot be asked."""
    head, at, host = marker.name.rpartition("@")
    if not at:
        return False  # not a marker of ours
    if host != socket.gethostname():
        return True
    try:
        os.kill(int(head.partition("-")[0]), 0)
    except ValueError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    except ProcessLookupError:
        return False
    return True

"""Gets a node ready for one rank of a job, and clears it afterwards.

Before the commands: the secrets it names exist, the code is unpacked, the job's directories
exist, the checkpoints it loads are downloaded, the training caches are seeded and linked, and
each weight set is placed at its mount location. After: all of it goes again, except the
rank's checkpoints while any is not yet in the storage root.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import queue
import shutil
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.agents.messages import (
    CacheRequest,
    CacheSeeded,
    Delivery,
    PrepareRequest,
    WeightPlacement,
)
from orchestrator.agents.runtimes import image_pull
from orchestrator.agents.services import actor_alive
from orchestrator.node.gpus import GpuAccess
from orchestrator.node.node_root import RankDirs
from orchestrator.node.rank_runtime import ImagePull, RankPlace
from orchestrator.node.secrets import resolve_secret
from orchestrator.spec.checkpoints import DEFAULT_DOWNLOAD_FOLDER
from orchestrator.storage.checkpoints import CheckpointStore, Manifest
from orchestrator.storage.root import StorageRoot

# Weights and the training cache are imported where a job uses them: every job's agent worker
# imports this module while the job waits to start (docs/performance.md).
if TYPE_CHECKING:
    from orchestrator.node.training_cache_mounts import TrainingCacheMounts


class NodePreparer:
    """`holder`: the (actor name, job id) that marks the links this rank places as its own."""

    def __init__(
        self, storage: StorageRoot, dirs: RankDirs, team: str | None, holder: tuple[str, str]
    ) -> None:
        self.storage, self.dirs, self.team, self.holder = storage, dirs, team, holder
        self.checkpoint_dir = dirs.checkpoints  # or the job's checkpoint_path, once prepared
        self.cache_mounts: TrainingCacheMounts | None = None
        self._mounts: list[tuple[Path, str]] = []  # weight mounts: link -> the cache's directory
        self._holds_weights = False  # asked this node's cache for a set: release it at the end
        self._download_folder: Path | None = None  # where checkpoints to load were put
        self.image = ImagePull()  # the job's image on this node: none until prepared with one
        self.gpus = GpuAccess()  # what the container is given of the rank's GPUs
        self._pull_lines: queue.Queue[str | None] = queue.Queue()

    def prepare(self, request: PrepareRequest) -> tuple[CacheSeeded | None, tuple[Delivery, ...]]:
        """Check secrets, fetch the code, create the job's directories, fetch checkpoints to load,
        and place the job's caches and weight sets; the job's image pulled meanwhile, where
        it has one to pull.

        Checkpoints to load land in `<folder>/rank-<their rank>/<their name>/`; Baseten's
        default folder becomes one private to this job on this node.
        """
        try:
            for name in request.secret_names:
                resolve_secret(name, self.team)  # a missing secret fails the deploy, naming it
            self.image = image_pull(
                request.image, self.holder[0], self.team, self._pull_lines.put, actor_alive
            )
            self.gpus = self.image.container_gpus(_ray_gpu_ids())  # a node without them fails now
            return self.image.during(lambda: self._prepare(request))
        finally:
            self._pull_lines.put(None)

    @property
    def image_digest(self) -> str | None:
        """What the image's name was on this node when prepared (None: no image pulled)."""
        return self.image.digest

    def place(self) -> RankPlace:
        """What the node prepared for the rank, which a container of the job's image sees."""
        binds, read_only = self.binds()
        return RankPlace(
            name=self.holder[0], status_file=str(self.dirs.failed), binds=tuple(binds),
            read_only=tuple(read_only), gpus=self.gpus, digest=self.image_digest,
        )  # fmt: skip

    def pull_lines(self) -> Iterator[str]:
        """The lines `prepare`'s pull says, as it says them; nothing without an image."""
        while (line := self._pull_lines.get()) is not None:
            yield line
        self._pull_lines.put(None)  # for a second reader

    def _prepare(self, request: PrepareRequest) -> tuple[CacheSeeded | None, tuple[Delivery, ...]]:
        dirs = self.dirs
        if dirs.workspace.exists():
            shutil.rmtree(dirs.workspace)
        dirs.workspace.mkdir(parents=True)
        dirs.scratch.mkdir(parents=True, exist_ok=True)
        local_tar = dirs.archive
        self.storage.get_file(request.archive_path, local_tar)
        digest = _sha256(local_tar)
        if digest != request.sha256:
            raise RuntimeError(f"code archive {request.archive_path} is corrupt: sha256 {digest}")
        with tarfile.open(local_tar) as tar:
            tar.extractall(dirs.workspace, filter="tar")
        local_tar.unlink()
        dirs.checkpoints.mkdir(exist_ok=True)
        if request.checkpoint_dir:
            Path(request.checkpoint_dir).mkdir(parents=True, exist_ok=True)
            self.checkpoint_dir = Path(request.checkpoint_dir)
        # Before any command runs: what a reused checkpoint_path already holds is not this job's.
        # Taken once per job on a node: a rank prepared again (its agent was lost) keeps it.
        from orchestrator.node.checkpoint_rules import (
            read_earlier_checkpoints,
            write_earlier_checkpoints,
        )

        if read_earlier_checkpoints(dirs.base) is None:
            write_earlier_checkpoints(Path(request.checkpoint_dir or dirs.checkpoints), dirs.base)
        if request.load and request.download_folder:
            self._download(request.load, request.download_folder)
        cache = self._prepare_cache(request.cache) if request.cache is not None else None
        return cache, tuple(self._place_weights(w) for w in request.weights)

    def _download(self, load: tuple[Manifest, ...], download_folder: str) -> None:
        store = CheckpointStore(self.storage)
        folder = (
            self.dirs.loaded_checkpoints
            if download_folder == DEFAULT_DOWNLOAD_FOLDER
            else Path(download_folder)
        )
        self._download_folder = folder
        for manifest in load:
            dest = folder / f"rank-{manifest.node_rank}" / manifest.name
            if dest.exists():
                shutil.rmtree(dest)
            store.download(manifest, dest)

    def _prepare_cache(self, request: CacheRequest) -> CacheSeeded:
        """Seed this node's copies of the caches, then link them where the job looks."""
        import ray

        from orchestrator.agents.training_cache_seeder import cache_seeder_here
        from orchestrator.node.training_cache_mounts import mount_caches

        seeder = cache_seeder_here()
        seeded = ray.get(seeder.seed.remote(self.storage.url, request.team, request.project))
        explicit_base = request.explicit_base
        base = Path(request.mount_base_path) if explicit_base else self.dirs.cache
        self.cache_mounts = mount_caches(
            base, seeded.project.path, seeded.team.path, request.legacy_hf, explicit_base,
            self.holder, actor_alive,
        )  # fmt: skip
        return dataclasses.replace(seeded, env=self.cache_mounts.env)

    def _place_weights(self, placement: WeightPlacement) -> Delivery:
        """Get the set from this node's cache and show it at `mount_location` (a link, no copy)."""
        import ray

        from orchestrator.agents.weight_cache import weight_cache_here
        from orchestrator.node.mounts import place_link

        started = time.monotonic()
        self._holds_weights = True
        delivered = ray.get(
            weight_cache_here().deliver.remote(
                self.storage.url, placement.weight_set, self.holder[0]
            )
        )
        mount = Path(placement.mount_location)
        place_link(mount, delivered.path, "mount_location", self.holder, actor_alive)
        self._mounts.append((mount, delivered.path))
        # The whole of it as the job sees it: asking the cache, its copy if any, and the link.
        return Delivery(
            tier=delivered.tier,
            seconds=round(time.monotonic() - started, 4),
            bytes_copied=delivered.bytes_copied,
            mount_location=str(mount),
            evicted=delivered.evicted,
            over_budget=delivered.over_budget,
        )

    def binds(self) -> tuple[list[tuple[str, str]], list[str]]:
        """What a container of the job's image sees of this node, each at the path the job's
        variables name: the rank's directories, a checkpoint_path or download_folder of its
        own, and the targets of its cache and weights links (a link's target is not in the
        container). Then the paths inside that are read-only: the weights."""
        own = [p for p in (self.checkpoint_dir, self._download_folder) if p is not None]
        binds = {str(self.dirs.base): str(self.dirs.base)}
        binds.update({str(p): str(p) for p in own if not p.is_relative_to(self.dirs.base)})
        cache_links = self.cache_mounts.links if self.cache_mounts else []
        for link, target in [*cache_links, *self._mounts]:
            binds[str(link)] = target
        return [(host, inside) for inside, host in binds.items()], [str(m) for m, _ in self._mounts]

    def clear(self, keep_checkpoints: bool = True) -> None:
        """Remove the job's scratch, working copy, links and loaded checkpoints from this node;
        its checkpoint directory too unless `keep_checkpoints`; let go of its image."""
        dirs = self.dirs
        with contextlib.suppress(Exception):  # a hold lapses with its agent anyway
            self.image.release()
        self._unmount_weights()
        if self.cache_mounts is not None:
            self.cache_mounts.remove()
        shutil.rmtree(dirs.cache, ignore_errors=True)
        shutil.rmtree(dirs.scratch, ignore_errors=True)
        shutil.rmtree(dirs.workspace, ignore_errors=True)
        shutil.rmtree(dirs.loaded_checkpoints, ignore_errors=True)
        for leftover in (dirs.earlier_checkpoints, dirs.top_level_name, dirs.failed, dirs.oom):
            leftover.unlink(missing_ok=True)
        if not keep_checkpoints:
            shutil.rmtree(dirs.checkpoints, ignore_errors=True)
        for empty in (dirs.checkpoints, dirs.base, dirs.base.parent):
            with contextlib.suppress(OSError):
                empty.rmdir()

    def _unmount_weights(self) -> None:
        """Remove this job's mount links (not a later job's) and let the cache evict its sets."""
        if not self._holds_weights:
            return
        from orchestrator.agents.weight_cache import weight_cache_here
        from orchestrator.node.mounts import remove_links

        remove_links(self._mounts, self.holder, actor_alive)
        self._mounts.clear()
        # Not waited for: the agent is about to go, and a set it held is freed either way once
        # the cache sees it gone.
        with contextlib.suppress(Exception):
            weight_cache_here().release.remote(self.holder[0])
        self._holds_weights = False


def _ray_gpu_ids() -> list[str]:
    """The node's GPUs Ray gave this rank (its indices), none outside Ray."""
    import ray

    return [str(g) for g in ray.get_gpu_ids()] if ray.is_initialized() else []


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()

"""The weight mirror: copies each source once into the storage root, shared by every job.

One named actor per cluster. A job's controller asks it for each of its sources while the job is
CREATED, before any compute is reserved. The source's revision is checked on every request (the
freshness check, made with the asking job's credentials: its secret, or for an object store the
nodes' own when it names none, which its commands could use anyway), so a job that cannot read a
source never gets it from the mirror; a revision already mirrored costs nothing more. Two jobs
asking for the same revision at once share one copy (single-flight).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator import actor_names
from orchestrator.agents.messages import MirrorDone, MirrorFailed, MirrorProgress
from orchestrator.errors import SecretNotFound, SecretStoreError, SourceError
from orchestrator.node.secrets import SecretMasker, resolve_secret
from orchestrator.node.weight_sources import Source, first_line, open_source
from orchestrator.spec.weights import WeightsSource
from orchestrator.storage.parallel import parallel_map
from orchestrator.storage.records import MirrorOutcome
from orchestrator.storage.root import StorageRoot
from orchestrator.storage.weights import (
    MirrorStore,
    WeightFile,
    WeightSet,
    copy_concurrency,
    file_path,
    select,
    set_dir,
    set_key,
)

MIRROR_NAME = actor_names.WEIGHT_MIRROR
PROGRESS_EVERY_S = 1.0


@dataclass
class Progress:
    files_total: int = 0
    bytes_total: int = 0
    files_done: int = 0
    bytes_done: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class _Flight:
    """One copy in progress; everyone asking for the same set waits on it."""

    progress: Progress = field(default_factory=Progress)
    done: threading.Event = field(default_factory=threading.Event)
    result: WeightSet | None = None
    error: str | None = None
    found: bool = False  # committed by an earlier copy after this one was asked for


class WeightMirror:
    """A threaded Ray actor: each `mirror` call streams progress, then the committed set."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flights: dict[str, _Flight] = {}

    def mirror(
        self, storage_root: str, source: WeightsSource, team: str | None = None
    ) -> Iterator[MirrorProgress | MirrorDone | MirrorFailed]:
        """Yields MirrorProgress while copying and finally MirrorDone, or MirrorFailed when the
        source cannot be read."""
        spec = source
        try:
            secret = resolve_secret(spec.secret_name, team) if spec.secret_name else None
        except (SecretNotFound, SecretStoreError) as e:
            yield MirrorFailed(str(e))
            return
        mask = _masker(secret)
        try:
            src = open_source(spec, secret)
            revision = src.resolve()
            key = set_key(src.identity, revision, spec.allow_patterns, spec.ignore_patterns)
            store = MirrorStore(StorageRoot(storage_root))
            if (existing := store.manifest(key)) is not None:
                yield MirrorDone(existing, MirrorOutcome.HIT)
                return
            flight_id = f"{storage_root}|{key}"
            with self._lock:
                flight = self._flights.get(flight_id)
                leader = flight is None
                if flight is None:
                    flight = self._flights[flight_id] = _Flight()
            if leader:
                worker = threading.Thread(
                    target=self._copy,
                    args=(flight_id, flight, src, spec, revision, key, store, mask),
                    daemon=True,
                )
                worker.start()
            while not flight.done.wait(PROGRESS_EVERY_S):
                yield MirrorProgress(**flight.progress.as_dict())
        except SourceError as e:
            yield MirrorFailed(mask(str(e)))
            return
        except Exception as e:  # the storage root, a client library: say why, never a secret
            yield MirrorFailed(mask(f"{spec.source}: {type(e).__name__}: {first_line(e)}"))
            return
        if flight.error is not None:
            yield MirrorFailed(flight.error)
        else:
            assert flight.result is not None
            how = (
                MirrorOutcome.HIT if flight.found
                else MirrorOutcome.MISS if leader else MirrorOutcome.SHARED
            )  # fmt: skip
            yield MirrorDone(flight.result, how)

    def _copy(
        self,
        flight_id: str,
        flight: _Flight,
        src: Source,
        spec: WeightsSource,
        revision: str,
        key: str,
        store: MirrorStore,
        mask: SecretMasker,
    ) -> None:
        try:
            # Another flight may have committed between this one's check and its start.
            if (existing := store.manifest(key)) is not None:
                flight.result, flight.found = existing, True
            else:
                flight.result = copy_set(src, spec, revision, key, store, flight.progress)
        except SourceError as e:
            flight.error = mask(str(e))
        except Exception as e:
            flight.error = mask(f"{spec.source}: {type(e).__name__}: {first_line(e)}")
        finally:
            with self._lock:
                self._flights.pop(flight_id, None)
            flight.done.set()


def copy_set(
    src: Source,
    spec: WeightsSource,
    revision: str,
    key: str,
    store: MirrorStore,
    progress: Progress,
) -> WeightSet:
    """Copy the selected files of `src` under weights/<key>/, files in parallel, manifest last."""
    listed = src.files()
    by_path = {f.path: f for f in listed}
    chosen = select(sorted(by_path), spec.allow_patterns, spec.ignore_patterns)
    if not chosen:
        if not listed:
            raise SourceError(f"{spec.source}: nothing there")
        raise SourceError(
            f"{spec.source}: allow_patterns/ignore_patterns select none of its "
            f"{len(listed)} file(s)"
        )
    progress.files_total = len(chosen)
    progress.bytes_total = sum(by_path[p].size for p in chosen)
    root = store.root
    lock = threading.Lock()
    staging = None if root.is_local else Path(tempfile.mkdtemp(prefix="orchestrator-mirror-"))

    def one(path: str) -> WeightFile:
        target = file_path(key, path)
        if root.is_local:  # straight into place, renamed when whole
            final = Path(root.path(target))
            local = final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}.partial")
        else:  # through local disk: the source's client and the root's may differ
            assert staging is not None
            local = staging / path
        try:
            src.fetch(path, local)
            size = local.stat().st_size
            if by_path[path].size and size != by_path[path].size:
                raise SourceError(
                    f"{spec.source}: {path} arrived with {size} bytes, the source lists "
                    f"{by_path[path].size}"
                )
            if root.is_local:
                os.replace(local, final)
            else:
                root.put_file(local, target)
        finally:
            local.unlink(missing_ok=True)
        with lock:
            progress.files_done += 1
            progress.bytes_done += size
        return WeightFile(path=path, size=size)

    try:
        files = parallel_map(one, chosen, copy_concurrency())
    except BaseException:
        # Nobody reads a set without its manifest; its files would only take up room.
        root.discard(set_dir(key), recursive=True)
        raise
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    weight_set = WeightSet(
        key=key,
        source=src.identity,
        revision=revision,
        allow_patterns=spec.allow_patterns,
        ignore_patterns=spec.ignore_patterns,
        files=files,
        created_at=time.time(),
    )
    store.commit(weight_set)
    return weight_set


def _masker(secret: str | None) -> SecretMasker:
    """Masks the secret and, for JSON credentials, each of its values."""
    values = [secret] if secret else []
    if secret:
        with contextlib.suppress(ValueError, AttributeError):
            values += [str(v) for v in json.loads(secret).values()]
    return SecretMasker(values)

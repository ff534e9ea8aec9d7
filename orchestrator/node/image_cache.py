"""A node's job images: each pulled once however many jobs ask at the same time, and the ones
this node pulled removed, least recently used first, when they hold more than the budget.

State is files, not a process: a lock file per image (the first job to ask pulls; the others
wait on its lock, then find the image here) and `images.json` (which images this node pulled,
when each was last used, and which agents hold it), under its own lock. Images someone put on
the node by other means are used, never removed. An image is never removed while a job holds
it: its agent is alive (a dead agent's hold lapses) or a container of it exists.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from orchestrator import settings
from orchestrator.home import orchestrator_home
from orchestrator.node import podman

GIB = 1024**3
STATE = "images.json"


class ImageCache:
    """`alive(holder)`: whether the agent named `holder` still runs (its hold counts)."""

    def __init__(
        self, directory: Path | None = None, budget_bytes: int | None = None,
        alive: Callable[[str], bool] = lambda _: True,
    ) -> None:  # fmt: skip
        self.directory = directory or orchestrator_home() / "images"
        self.directory.mkdir(parents=True, exist_ok=True)
        self.budget_bytes = budget_bytes  # None: ORCHESTRATOR_IMAGE_CACHE_GIB, else _budget's
        self.alive = alive

    def ensure(
        self, image: str, holder: str, credentials: tuple[str, str] | None = None,
        say: Callable[[str], None] = lambda _: None,
    ) -> list[str]:  # fmt: skip
        """`image` on this node, held for `holder` until `release`; what was removed for its
        room. Pulled here unless it is here already; a pull another job started is waited for."""
        key = hashlib.sha256(image.encode()).hexdigest()[:24]
        with _locked(self.directory / f"pull-{key}.lock", lambda: say(
            f"image {image}: waiting for the pull of it under way on this node"
        )):  # fmt: skip
            # Held before it is looked for: another job's eviction never takes it in between.
            self._hold(image, holder)
            pulled = not podman.exists(image)
            if pulled:
                say(f"image {image}: pulling it onto this node")
                started = time.monotonic()
                podman.pull(image, credentials, say=lambda line: say(f"image {image}: {line}"))
                say(f"image {image}: pulled in {time.monotonic() - started:.1f} s")
            else:
                say(f"image {image}: on this node already")
            with self._state() as state:
                entry = self._hold(image, holder, state)  # again: an eviction may have dropped it
                entry["pulled"] = entry["pulled"] or pulled
                # Only a pull adds to what the images hold.
                removed = self._evict(state, keep=image) if pulled else []
        if removed:
            say(f"images removed from this node for room (least recently used, no job's): "
                f"{', '.join(removed)}")  # fmt: skip
        return removed

    def _hold(self, image: str, holder: str, state: dict[str, dict] | None = None) -> dict:
        """`holder` among the image's holders, its last use now; its entry in `state` (else in
        images.json, under its lock)."""
        if state is None:
            with self._state() as stored:
                return self._hold(image, holder, stored)
        entry = state.setdefault(image, {"pulled": False, "holders": []})
        entry["last_used"] = time.time()
        entry["holders"] = sorted({*entry["holders"], holder})
        return entry

    def release(self, holder: str) -> None:
        with self._state() as state:
            for entry in state.values():
                entry["holders"] = [h for h in entry["holders"] if h != holder]

    def _evict(self, state: dict[str, dict], keep: str) -> list[str]:
        """The images this node pulled, least recently used first, removed while they hold
        more than the budget; none held by a live agent or used by a container."""
        facts = {image: podman.image_facts(image) for image in list(state)}
        for image in [image for image, found in facts.items() if found is None]:
            del state[image], facts[image]  # removed by other means
        ours = {image: found for image, found in facts.items() if state[image]["pulled"]}
        total = sum(size for _, size in ours.values())
        budget = self.budget_bytes if self.budget_bytes is not None else _budget(total, keep)
        if total <= budget:
            return []
        in_use = podman.images_in_use()
        removed = []
        for image in sorted(ours, key=lambda i: state[i]["last_used"]):
            if total <= budget:
                break
            ident, size = ours[image]
            state[image]["holders"] = [h for h in state[image]["holders"] if self.alive(h)]
            if image == keep or state[image]["holders"] or ident in in_use:
                continue
            if podman.remove_image(image):
                total -= size
                removed.append(image)
                del state[image]
        return removed

    @contextlib.contextmanager
    def _state(self) -> Iterator[dict[str, dict]]:
        """images.json, read and written back under its lock."""
        path = self.directory / STATE
        with _locked(self.directory / f"{STATE}.lock"):
            try:
                state = json.loads(path.read_text())
            except (FileNotFoundError, ValueError):
                state = {}
            yield state
            temporary = path.with_suffix(".tmp")
            temporary.write_text(json.dumps(state, indent=1, sort_keys=True))
            os.replace(temporary, path)


@contextlib.contextmanager
def _locked(path: Path, waiting: Callable[[], None] = lambda: None) -> Iterator[None]:
    """An exclusive lock on `path` (released if the process dies); `waiting` is called once
    if another holds it."""
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            waiting()
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _budget(held: int, image: str) -> int:
    """ORCHESTRATOR_IMAGE_CACHE_GIB, else 80% of what the images could use: the free space of
    the disk podman keeps them on (`image`'s) plus what the ones pulled here hold (as the weight
    cache does)."""
    if (value := settings.IMAGE_CACHE_GIB.get()) is not None:
        return int(value * GIB)
    return int((shutil.disk_usage(podman.storage_dir(image)).free + held) * 0.8)

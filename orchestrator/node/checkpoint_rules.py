"""The uploader's rules: which entries of `$BT_CHECKPOINT_DIR` are checkpoints (each directory,
and the files at the top together as one), what says a checkpoint is not finished yet, and which
later checkpoint of a series says an earlier one is.
docs/architecture.md#the-checkpoint-uploader states them in words.
"""

from __future__ import annotations

import contextlib
import enum
import fnmatch
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

import psutil

from orchestrator.storage.local_checkpoint import (
    COMPLETE_MARKER,
    EARLIER_CHECKPOINTS,
    Snapshot,
    snapshot,
    top_level_name,
    top_snapshot,
)

# Names writers give a checkpoint while they write it, renaming it when done: transformers
# 4.36-4.37 and Orbax. ORCHESTRATOR_CHECKPOINT_TEMPORARY_PATTERNS adds more.
TEMPORARY_PATTERNS = ("tmp-checkpoint-*", "*.orbax-checkpoint-tmp-*")


class EntryKind(str, enum.Enum):
    CHECKPOINT = "checkpoint"  # a directory: uploaded under its name
    HIDDEN = "hidden"  # a name starting with '.': being written, by convention; ignored
    TEMPORARY = "temporary"  # a known writer's temporary name: ignored until renamed
    LINK = "link"  # a symbolic link: never followed (it may point anywhere on the node)
    FILE = "file"  # a regular file: one of the top-level checkpoint's files (TOP_LEVEL)
    SPECIAL = "special"  # a socket, FIFO or device: nothing to upload
    TAKEN = "taken"  # a directory named as the job's top-level checkpoint was, after it was


def top_level(root: Path, extra_patterns: Iterable[str] = ()) -> dict[str, EntryKind]:
    """Every entry directly under `root`, by kind; empty if `root` does not exist. The
    completion marker at the top is HIDDEN: it marks the top-level files, it is none of them."""
    patterns = (*TEMPORARY_PATTERNS, *extra_patterns)
    kinds: dict[str, EntryKind] = {}
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return kinds
    for entry in entries:
        try:
            if entry.is_symlink():
                kind = EntryKind.LINK
            elif any(fnmatch.fnmatchcase(entry.name, p) for p in patterns):
                kind = EntryKind.TEMPORARY
            elif entry.is_file(follow_symlinks=False):
                kind = EntryKind.HIDDEN if entry.name == COMPLETE_MARKER else EntryKind.FILE
            elif not entry.is_dir(follow_symlinks=False):
                kind = EntryKind.SPECIAL
            elif entry.name.startswith("."):
                kind = EntryKind.HIDDEN
            else:
                kind = EntryKind.CHECKPOINT
        except FileNotFoundError:
            continue
        kinds[entry.name] = kind
    return kinds


_HF_CHECKPOINT = re.compile(r"checkpoint-\d+")
_HF_FIRST_FILES = {"config.json", "adapter_config.json", "training_args.bin"}


def unfinished(name: str, seen: Snapshot, rank: int) -> str | None:
    """Why a writer we know has not finished this checkpoint yet, or None.

    - The Hugging Face Trainer makes `checkpoint-<step>`, saves the model (config.json or
      adapter_config.json first) and training_args.bin, then the optimizer, scheduler and RNG
      state, and trainer_state.json after them.
    - torch.distributed.checkpoint writes `.metadata` beside the shards after every shard is
      written. Only the coordinator does, on node rank 0: other nodes' shards never get one.
    """
    names = seen.names()
    if (
        _HF_CHECKPOINT.fullmatch(name)
        and names & _HF_FIRST_FILES
        and "trainer_state.json" not in names
    ):
        return "a Hugging Face checkpoint without trainer_state.json, which the Trainer writes last"
    if rank == 0:
        shard_dirs = {n.rpartition("/")[0] for n in names if n.endswith(".distcp")}
        for d in sorted(shard_dirs):
            if (f"{d}/.metadata" if d else ".metadata") not in names:
                where = f"{d}/" if d else ""
                return f"torch.distributed.checkpoint shards without {where}.metadata"
    return None


_NUMBERS = re.compile(r"\d+")


def follows(newer: str, older: str) -> bool:
    """Whether `newer` is a later checkpoint of `older`'s series: the same name once each run of
    digits is blanked out (`checkpoint-#`, `step_#`, `epoch=#-step=#`), no number smaller and
    one larger. Trainers save a series one checkpoint after another, so starting the later one
    says the earlier is whole; `best` or an export never speaks for `checkpoint-2`, nor a count
    that went back (`run4-step-50` after `run3-step-100`)."""
    if _NUMBERS.sub("#", newer) != _NUMBERS.sub("#", older):
        return False
    new, old = ([int(n) for n in _NUMBERS.findall(name)] for name in (newer, older))
    return bool(new) and new != old and all(a >= b for a, b in zip(new, old, strict=True))


def open_for_writing(directory: Path) -> set[str]:
    """Files under `directory` some process we can see holds open for writing.

    Processes of other users are invisible here (a container with another user): the settle
    time is then the only guard.
    """
    prefix = f"{os.path.realpath(directory)}{os.sep}"
    writing: set[str] = set()
    for proc in psutil.process_iter():
        try:
            files = proc.open_files()
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        writing.update(f.path for f in files if f.path.startswith(prefix) and f.mode != "r")
    return writing


WARN_FRACTION = 0.9  # of volume_size_gib: said once


def volume_use(directory: Path, rank: int, limit: int) -> tuple[str | None, str | None]:
    """What the checkpoint directory's size says against volume_size_gib (`limit`, bytes): the
    error when it is over, else a warning when it is near."""
    if not directory.is_dir():
        return None, None
    used = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    gib = f"volume_size_gib={limit / 2**30:g}"
    if used > limit:
        return (f"checkpoint directory on rank {rank} holds {used / 2**30:.2f} GiB, over {gib}: "
                "delete old checkpoints or raise volume_size_gib"), None  # fmt: skip
    if used > WARN_FRACTION * limit:
        return None, f"warning: checkpoint directory uses {used / 2**30:.2f} GiB of {gib}"
    return None, None


def earlier_checkpoints(directory: Path) -> dict[str, str]:
    """What a reused checkpoint directory holds as a job starts: name -> fingerprint.

    Which checkpoints are an earlier job's is decided from this, never from file times. The
    top-level files are one, under the name the uploader gives them from the same listing.
    """
    found = {}
    entries = top_level(directory)
    for name, kind in entries.items():
        if kind == EntryKind.CHECKPOINT:
            try:
                found[name] = snapshot(directory / name).fingerprint
            except FileNotFoundError:
                continue
    if EntryKind.FILE in entries.values():
        with contextlib.suppress(FileNotFoundError):
            top = top_snapshot(directory, TEMPORARY_PATTERNS)
            if top.files:
                found[top_level_name(n for n, k in entries.items() if k != EntryKind.FILE)] = (
                    top.fingerprint
                )
    return found


def write_earlier_checkpoints(directory: Path, job_dir: Path) -> None:
    """Taken by the node agent before the commands run, kept in the rank's job directory on the
    node, where the rank's uploader (a restarted one too) reads it."""
    target = job_dir / EARLIER_CHECKPOINTS
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(earlier_checkpoints(directory)))
    os.replace(tmp, target)


def read_earlier_checkpoints(job_dir: Path) -> dict[str, str] | None:
    """What `write_earlier_checkpoints` kept, or None while the agent has not written it."""
    try:
        return dict(json.loads((job_dir / EARLIER_CHECKPOINTS).read_text()))
    except FileNotFoundError:
        return None

"""What a rank's checkpoint uploader knows of each name in `$BT_CHECKPOINT_DIR`, and when one is
complete: the bookkeeping and judgments behind agents/checkpoint_uploader.py, apart from its
thread, its storage calls and Ray. The rules are docs/architecture.md#the-checkpoint-uploader.
"""

from __future__ import annotations

import fnmatch
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.node.checkpoint_places import CheckpointPlaces
from orchestrator.node.checkpoint_rules import (
    TEMPORARY_PATTERNS,
    EntryKind,
    follows,
    open_for_writing,
    unfinished,
)
from orchestrator.node.rank_writes import QuietSpell, RankWrites
from orchestrator.storage.checkpoints import Manifest, UploadSettings
from orchestrator.storage.local_checkpoint import Snapshot
from orchestrator.storage.records import CheckpointEntry

# Why a checkpoint is complete, as the log says it.
RENAMED = "renamed into place"
MARKED = "marked complete"
SETTLED = "settled"
WRITER_DONE = "its writer exited cleanly"

IGNORED_WHY = {
    EntryKind.SPECIAL: "a socket, FIFO or device, not a file: nothing to upload",
    EntryKind.TAKEN: "a directory with the name the files at the top of $BT_CHECKPOINT_DIR have "
    "as their checkpoint in this job: rename it",
    EntryKind.LINK: "a symbolic link at the top of $BT_CHECKPOINT_DIR is not followed",
    EntryKind.TEMPORARY: "a writer's temporary directory, never renamed into place",
}


@dataclass
class Tracked:
    """One checkpoint name, as this uploader knows it."""

    seen: Snapshot | None = None
    changed_at: float = 0.0  # monotonic: when `seen` last differed from the scan before
    changed_wall: float = 0.0
    changed_scan: int = 0  # the scan that first saw `seen`
    ready: str | None = None  # why the content in `seen` is complete, once it is
    ready_wall: float = 0.0
    stored: Manifest | None = None  # the version in the storage root
    looked_up: bool = False  # asked the storage root for a manifest (a restarted uploader)
    failed: str | None = None
    failed_at: float = 0.0
    failed_said: str | None = None  # the kind of failure last said: each kind is said once
    restored: str | None = None  # the fingerprint of the stored version restored here
    gone: str | None = None  # deleted locally before it was stored: why it is not
    cut_off: str | None = None  # `seen`, cut off by its writer's end, is kept off a whole version
    uncommitted: str | None = None  # a Ray Train directory the job ended without committing
    said: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class Sighting:
    """When one of this job's checkpoints was first listed: the latest it can have been made."""

    scan: int
    ctime_ns: int  # its directory's ctime then (by the file clock that dates what was written)


class CheckpointTracker:
    """Every name the uploader has met in `local_dir`, and the judgments made of them. Not
    thread-safe: the uploader calls it under its one lock. `say` gets each event's message."""

    def __init__(
        self, rank: int, local_dir: Path, settings: UploadSettings, say: Callable[[str], None]
    ) -> None:
        self.rank, self.local_dir, self.settings, self.say = rank, local_dir, settings, say
        # Each checkpoint's files by name: a directory's, or the top-level files' (places.top).
        self.places = CheckpointPlaces(
            local_dir, (*TEMPORARY_PATTERNS, *settings.temporary_patterns)
        )
        self.earlier: dict[str, str] = {}  # an earlier job's: name -> fingerprint at the start
        self.tracked: dict[str, Tracked] = {}
        self.ignored: dict[str, EntryKind] = {}  # present now, not checkpoints
        # Another rank's checkpoints restored here for a retried attempt: name -> (fingerprint,
        # whose). Not this rank's to upload unless the job changes them.
        self.restored: dict[str, tuple[str, str]] = {}
        self.said_earlier: set[str] = set()
        # (clean, wall time, how) once the rank's commands have ended: nothing settles after.
        self.writer_end: tuple[bool, float, str] | None = None
        # A Ray Train job's: a directory is complete only once Train commits it (the uploader
        # marks it then), never by settling, its writer's end or a later one of a series.
        self.commit_only = False
        self.scans = 0  # scans begun
        self.sightings: dict[str, Sighting] = {}  # this job's checkpoints listed now
        # name -> the scan in which a later one of its series was first listed while a file of
        # it was held open for writing: not whole when the later one started.
        self.open_when_followed: dict[str, int] = {}
        self.open_writers: set[str] | None = None  # per scan, asked only when needed
        # What this rank was seen writing (`writes`): the first entry of the job's found here,
        # and the last scan of this watch that found none while the commands ran (no spell
        # while `quiet_since` is None: a restarted uploader does not know they run).
        self.wrote: tuple[str, float] | None = None
        self.quiet_since: float | None = time.time()
        self.quiet_until: float | None = None

    # --- judgments -----------------------------------------------------------------------------

    def judge(self, name: str, t: Tracked, now: float) -> str | None:
        """Why the content last seen is complete, or None while it may still be written."""
        assert t.seen is not None
        if t.seen.marked_complete:
            return MARKED
        if self.awaits_commit(name):
            return None
        if self.writer_end is not None:
            if self.writer_end[0]:
                return WRITER_DONE
            newer = self.followed(name, t)
            return None if newer is None else f"{newer}, later in its series, started after it"
        quiet = now - t.changed_at
        if quiet < self.settings.settle_s:
            return None
        if unfinished(name, t.seen, self.rank) and quiet < self.settings.format_wait_s:
            return None
        if self.open_writers is None:
            self.open_writers = open_for_writing(self.local_dir)
        if any(f.path in self.open_writers for f in t.seen.files):
            return None
        return SETTLED

    def awaits_commit(self, name: str) -> bool:
        """A Ray Train checkpoint directory: complete only once committed (marked)."""
        return self.commit_only and not self.places.is_top(name)

    @staticmethod
    def ready(t: Tracked, why: str | None) -> None:
        t.ready, t.ready_wall = why, time.time()

    @staticmethod
    def is_current(t: Tracked) -> bool:
        stored, seen = t.stored, t.seen
        if stored is None or seen is None:
            return False
        return seen.fingerprint in (stored.source, t.restored)

    def why_incomplete(self, name: str, t: Tracked) -> str:
        assert t.seen is not None and self.writer_end is not None
        _, ended, how = self.writer_end
        quiet = max(0.0, ended - t.changed_wall)
        why = f"{how} {quiet:.1f} s after its last change, before it was complete"
        if known := unfinished(name, t.seen, self.rank):
            why += f" ({known})"
        return why

    def followed(self, name: str, t: Tracked) -> str | None:
        """A later checkpoint of `name`'s series started after `name` last changed, which says
        it is whole (trainers start the next save once the last is written), unless its writer
        said otherwise: a known writer's rule (`unfinished`), a completion marker older than its
        files, or a file of it held open for writing when the later one was first listed."""
        seen = t.seen
        if seen is None or seen.marker_ns is not None or unfinished(name, seen, self.rank):
            return None
        if self.places.is_top(name):
            return None  # files overwritten in place, not a series
        if self.open_when_followed.get(name, -1) >= t.changed_scan:
            return None
        for newer, sighting in sorted(self.sightings.items()):
            # First listed no earlier than the scan that first saw this content, and, for the
            # order inside one scan, made no earlier than this content's newest file.
            if (
                follows(newer, name)
                and sighting.scan >= t.changed_scan
                and seen.newest_ns <= sighting.ctime_ns
            ):
                return newer
        return None

    def keep_stored(self, name: str, t: Tracked, why: str) -> None:
        """Content cut off by its writer's end (`why`) never replaces a complete stored version
        (files rewritten in place, as nanoGPT's ckpt.pt is): that version stays the one to
        resume from, and this content is set aside before a retry."""
        assert t.stored is not None and t.seen is not None
        version = t.stored.version or 1
        t.cut_off = (
            f"changed after version {version} was stored, then {why}: version {version} stays "
            "stored, and what was written after it is not uploaded"
        )
        self.once(t, f"cut off {t.seen.fingerprint}", f"checkpoint {name} {t.cut_off}")

    def to_set_aside(
        self, number: int, newer: set[str], kept: tuple[str, ...]
    ) -> list[tuple[str, str, Tracked | None]]:
        """What to move out of the directory before attempt `number`, and why: checkpoints not
        complete when the last attempt ended, a name resumed from (`kept`: the resume point's,
        then the files at the top that come with it) if it changed since the version resumed
        from was stored, those `newer` than the resume point, and other ranks' copies restored
        for an earlier attempt. (name, why, its Tracked or None)."""
        resume = kept[0] if kept else None
        aside: list[tuple[str, str, Tracked | None]] = []
        for name, t in self.tracked.items():
            if not self.exists(name):
                continue
            current = self.is_current(t)
            if name in kept:
                if t.stored is None or t.seen is None or current:
                    continue
                why = (f"it changed after version {t.stored.version or 1}, the one attempt "
                       f"{number} resumes from, was stored")  # fmt: skip
            elif name in newer:
                why = f"it is newer than {resume}, the last checkpoint every rank stored"
                if resume is None:
                    why = "the job starts again: no checkpoint is one every rank can resume from"
            elif not (t.stored.complete if t.stored is not None and current else t.ready):
                if t.seen is not None and not t.seen.files:
                    continue  # an empty directory made first: the trainer fills it later
                stored = "not stored"
                if t.stored is not None:
                    stored = (f"version {t.stored.version or 1}, from before, stays stored"
                              if t.cut_off else "stored as INCOMPLETE")  # fmt: skip
                why = f"it was not complete when the last attempt ended ({stored})"
            else:
                continue
            aside.append((name, why, t))
        for name, (_, whose) in self.restored.items():
            if name not in kept and self.exists(name):
                aside.append((name, f"a copy of {whose} restored for an earlier attempt", None))
        return aside

    def waiting(self) -> list[Tracked]:
        """Checkpoints not stored as they are that are complete, failed to upload, or quiet for
        settle_s (one whose first storage lookup waits out an outage)."""
        quiet_since = time.monotonic() - self.settings.settle_s
        return [
            t for name, t in list(self.tracked.items())
            if t.gone is None and t.seen is not None and t.seen.files and not self.is_current(t)
            and (t.ready is not None or t.failed is not None
                 or (t.changed_at <= quiet_since and not self.awaits_commit(name)))
        ]  # fmt: skip

    # --- what a scan notices -------------------------------------------------------------------

    def notice(self, entries: dict[str, EntryKind], vanished: set[str]) -> None:
        """A scan's listing of the directory (and the names inotify saw come and go since the
        last): a new scan begins."""
        self.scans += 1
        self.open_writers = None
        self.notice_new(entries)
        self.notice_vanished(vanished)
        self.ignored = {n: k for n, k in self.ignored.items() if entries.get(n) == k}
        for name, kind in entries.items():
            if kind not in (EntryKind.CHECKPOINT, EntryKind.HIDDEN, EntryKind.FILE):
                self.ignore(name, kind)
        self.notice_deleted(entries)

    def notice_new(self, entries: dict[str, EntryKind]) -> None:
        """Note each of this job's checkpoints the first time it is listed (for `followed`),
        and which earlier ones of its series then have a file held open for writing. The
        top-level files are in no series."""
        listed = {n for n, k in entries.items() if k == EntryKind.CHECKPOINT}
        self.sightings = {n: s for n, s in self.sightings.items() if n in listed}
        new = []
        for name in sorted(listed - self.sightings.keys()):
            if name in self.earlier or name in self.restored:
                continue  # not this job's: it says nothing of this job's checkpoints
            try:
                ctime_ns = os.stat(self.local_dir / name, follow_symlinks=False).st_ctime_ns
            except FileNotFoundError:
                continue
            self.sightings[name] = Sighting(self.scans, ctime_ns)
            new.append(name)
        if not new or len(listed) < 2:
            return
        for older in self._held_open(listed):
            if any(follows(name, older) for name in new):
                self.open_when_followed[older] = self.scans

    def _held_open(self, names: set[str]) -> set[str]:
        """Those of `names` with a file some process holds open for writing."""
        if self.open_writers is None:
            self.open_writers = open_for_writing(self.local_dir)
        return {self.places.owner(p) for p in self.open_writers} & names

    def notice_vanished(self, names: set[str]) -> None:
        """Checkpoints made and deleted between two scans (seen only by inotify)."""
        patterns = (*TEMPORARY_PATTERNS, *self.settings.temporary_patterns)
        for name in sorted(names):
            if (
                name in self.tracked or name in self.earlier or name in self.restored
                or name.startswith(".") or any(fnmatch.fnmatchcase(name, p) for p in patterns)
            ):  # fmt: skip
                continue
            t = self.tracked[name] = Tracked()
            t.gone = "deleted by the job before it was uploaded (it existed for less than a scan)"
            self.say(f"{name} was {t.gone}")

    def notice_deleted(self, entries: dict[str, EntryKind]) -> None:
        present = set(self.places.checkpoints(entries)) | entries.keys() - {self.places.top}
        for name, t in self.tracked.items():
            if name in present or t.gone or t.stored is not None or t.seen is None:
                continue
            t.gone = "deleted by the job before it was uploaded"
            self.say(f"{name} was {t.gone}")

    def ignore(self, name: str, kind: EntryKind) -> None:
        if self.ignored.get(name) == kind:
            return
        self.ignored[name] = kind
        if kind != EntryKind.TEMPORARY:  # temporaries are expected while a writer works
            self.say(f"ignoring {_shown(name, kind)}: {IGNORED_WHY[kind]}")

    def once(self, t: Tracked, key: str, message: str) -> None:
        if key not in t.said:
            t.said.add(key)
            self.say(message)

    def notice_writing(self, entries: dict[str, EntryKind], appeared: set[str], at: float) -> None:
        """Whether the rank has written anything here yet: any entry (a file at the top, a
        hidden or temporary directory too), or one seen come and go, but an earlier job's
        checkpoint and another rank's restored copy (top-level files among them as one). While
        nothing is and the commands run, the quiet spell reaches `at` (the listing's start)."""
        if self.wrote is not None:
            return
        theirs = self.earlier.keys() | self.restored.keys()
        top_theirs = self.places.top in theirs
        listed = {n for n, k in entries.items() if k != EntryKind.FILE or not top_theirs}
        ours = sorted((listed | appeared | self.tracked.keys()) - theirs)
        if ours:
            self.wrote = (ours[0], at)
        elif self.writer_end is None and self.quiet_since is not None:
            self.quiet_until = at

    def new_watch(self) -> None:
        """An attempt begins: its quiet spell starts now."""
        self.quiet_since, self.quiet_until = time.time(), None

    def writes(self) -> RankWrites:
        """What this watch has seen of the rank writing; the spell ends where its commands did."""
        until = self.quiet_until
        if until is not None and self.writer_end is not None:
            until = min(until, self.writer_end[1])
        spells: tuple[QuietSpell, ...] = ()
        if until is not None and self.quiet_since is not None and until >= self.quiet_since:
            spells = (QuietSpell(self.quiet_since, until),)
        wrote, at = self.wrote or (None, None)
        return RankWrites(self.rank, wrote, at, spells)

    # --- reporting -----------------------------------------------------------------------------

    def entries(self) -> list[CheckpointEntry]:
        """What became of every name found: for the status at the end of the job."""
        entries = [
            CheckpointEntry(rank=self.rank, name=name, state="earlier_job",
                            reason="in the checkpoint directory before this job started")
            for name in sorted(self.earlier)
        ]  # fmt: skip
        for name, (_, whose) in sorted(self.restored.items()):
            if self.exists(name):
                why = f"a copy of {whose}, restored for a retry"
                entries.append(
                    CheckpointEntry(rank=self.rank, name=name, state="restored", reason=why)
                )
        for name, t in sorted(self.tracked.items()):
            entries.append(self._entry(name, t))
        for name, kind in sorted(self.ignored.items()):
            entries.append(CheckpointEntry(rank=self.rank, name=_shown(name, kind),
                                           state="ignored", reason=IGNORED_WHY[kind]))  # fmt: skip
        return entries

    def _entry(self, name: str, t: Tracked) -> CheckpointEntry:
        entry = CheckpointEntry(rank=self.rank, name=name, state="pending")
        stored = t.stored
        if stored is not None:
            entry.files, entry.size_bytes = len(stored.files), stored.size_bytes
        emptied = t.seen is not None and not t.seen.files
        if stored is not None and (self.is_current(t) or not self.exists(name) or emptied):
            entry.state = "uploaded" if stored.complete else "incomplete"
            entry.reason = stored.incomplete_reason
        elif not self.exists(name):
            entry.state, entry.reason = "deleted", t.gone or "deleted by the job"
        elif t.cut_off is not None:
            entry.state, entry.reason = "incomplete", t.cut_off
        elif t.uncommitted is not None:
            entry.state, entry.reason = "ignored", t.uncommitted
        elif emptied:
            entry.state, entry.reason = "ignored", "an empty directory: nothing to upload"
        elif t.failed:
            entry.state = "failed"
            entry.reason = t.failed + (
                f" (version {stored.version or 1}, from before its last change, is stored)"
                if stored
                else ""
            )
        else:
            entry.reason = "the flush deadline passed before it was uploaded"
        return entry

    def exists(self, name: str) -> bool:
        return self.places.exists(name)


def _shown(name: str, kind: EntryKind) -> str:
    """A directory that has the top-level checkpoint's name is told apart from it: `name/`."""
    return f"{name}/" if kind == EntryKind.TAKEN else name
